"""Lowering: a partitioned program becomes a callable that runs on a device mesh.

One small interface, `lower(part, mesh, backend=...)`, over a table of backends,
registered here: `jit` (`_jit`: the plan's layouts stated, XLA's partitioner inserts
the collectives) and `shard_map` (`_shardmap`: each device's program, with exactly the
modeled collectives). What they share is in `_common` (the jitted callable with the
plan's layouts), `_eval` (binding equations), `_hooks` and `_recompute` (how values are
read and residuals recomputed), `_spmd` (moving blocks between layouts), `_local` (one
op on a device's blocks), `_ring` (the dots that move a value round a ring, shard_map
only: the jit lowering refuses them) and `_boundaries` (values crossing region
boundaries).
"""

from __future__ import annotations

from typing import Callable

from .._errors import PartitioningError
from .._mesh import lowering_mesh
from .._partitioning import Partitioning
from ._common import LAYOUT_ONLY, Lowered, jit_with_layouts
from ._jit import CONSTRAIN_MODES, lower_jit, stated_on_the_way
from ._shardmap import lower_shard_map

#: Backend name -> `fn(part, jax_mesh, **options) -> callable`.
_BACKENDS: dict[str, Callable] = {"jit": lower_jit, "shard_map": lower_shard_map}


def register_backend(name: str):
    """Decorator: add a lowering backend `fn(part, jax_mesh, **options) -> callable`."""

    def deco(fn):
        _BACKENDS[name] = fn
        return fn

    return deco


def lower(part: Partitioning, mesh=None, *, backend: str = "jit", **options):
    """Lower a partitioning to a callable taking the original (non-static) arguments.

    `mesh` is a `jax.sharding.Mesh` whose axes match the plan's, Auto or Explicit (as
    `jax.make_mesh` makes them); by default one is built from the first devices. The
    plan's layouts are stated on the same devices with Auto axes (`lowering_mesh`), and
    the outputs come back sharded over `mesh` itself, valid in its axis types. Returns
    what the backend returns (`jit`: a `jax.jit` object, so `.lower(*args).compile()`
    shows the partitioned HLO).
    """
    if backend not in _BACKENDS:
        raise PartitioningError(f"unknown lowering backend {backend!r}; choose one of {sorted(_BACKENDS)}")
    if mesh is None:
        mesh = part.mesh.jax_mesh()
    elif dict(mesh.shape) != part.mesh.sizes():
        raise PartitioningError(
            f"the plan is for mesh {part.mesh} but the given mesh has axes {dict(mesh.shape)}; "
            "pass a mesh with the same axis names and sizes"
        )
    lowering_mesh(mesh)  # Manual axes: an error before any work
    return _BACKENDS[backend](part, mesh, **options)


__all__ = ["CONSTRAIN_MODES", "LAYOUT_ONLY", "Lowered", "jit_with_layouts", "lower", "register_backend",
           "stated_on_the_way"]
