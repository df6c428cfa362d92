"""Pipelined layer scans under the `jit` lowering: each runs as a `jax.shard_map` region
over the plan's mesh, the stage program of the `shard_map` lowering
(`_shardmap_pipeline`), inside the program XLA partitions.

A layer dim split over the stage axis is a layout XLA's partitioner would gather before
a scan reads it (the scan computes whole along its layer dim); the stage program reads
each stage's block in place and sends activations and their gradients between stages
with `ppermute`s, which compile to the collective-permutes the cost model lists. What
enters the region arrives in the plan's layouts at rest (its `in_specs`), and what
leaves it is in theirs (its `out_specs`), so XLA moves nothing at its boundary that the
plan does not.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from .._graph import made_from_scalars
from ._frame import _Blocks
from ._shardmap import Interpreter
from ._shardmap_pipeline import run_pipelined


class JitPipelines:
    """The pipelined scans of a plan, by body region, run as `shard_map` regions on
    `mesh` (a lowering mesh)."""

    def __init__(self, part, mesh):
        self.part, self.mesh = part, mesh
        self.interp = Interpreter(part, list(made_from_scalars(part.program)))

    def __contains__(self, body: int) -> bool:
        return body in self.interp.pipelined

    def run(self, eqn, body: int, ins, results, operands) -> list:
        """The results (global arrays) of pipelined scan `eqn` (operand value ids `ins`,
        -1 for a literal; result ids `results`) on `operands`."""
        part, interp = self.part, self.interp
        pipe, layout, inner = interp.pipelined[body]
        passed = [k for k, v in enumerate(ins) if v >= 0]

        def stages(*blocks):
            ops = list(operands)
            for k, b in zip(passed, blocks):
                ops[k] = b
            interp.values, interp.wholes = _Blocks(interp), {}
            return tuple(run_pipelined(interp, pipe, layout, inner, eqn, ins, results, ops, {}))

        region = jax.shard_map(stages, mesh=self.mesh, in_specs=tuple(part.tiling(ins[k]).spec() for k in passed),
                               out_specs=tuple(part.tiling(r).spec() if r >= 0 else PartitionSpec() for r in results),
                               check_vma=False)
        return list(region(*(operands[k] for k in passed)))
