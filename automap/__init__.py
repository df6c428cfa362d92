"""automap: an SPMD auto-partitioner for JAX.

The user-facing layer: it ties the IR (`partir`), the tactics (`tactics`) and the
search (`search`) into something you call on a train step, and a CLI.
"""

__version__ = "0.1.0"
