"""The collectives of a region the user partitioned by hand (a `shard_map` in the
program): its body runs on each device's blocks (its work is counted on its own shapes,
once per device, by `_flops.body_work`), and its collectives are its own (`psum`, `all_gather`, `ppermute`, ...), read
off the body with the mesh axes they name. A loop in the body counts its trips (a
`while` loop once: its trip count is not static); a `cond` counts every branch (an
upper bound). What the body keeps live beyond its results is not modeled."""

from __future__ import annotations

import math

from partir import Kind

from ._flops import body_equations

#: Collective primitives of a `shard_map` body -> (the HLO collective they become, the
#: param naming their mesh axes, whether their HLO buffer is the result rather than the
#: operand).
COLLECTIVES = {
    "psum": (Kind.ALL_REDUCE, "axes", False), "psum_invariant": (Kind.ALL_REDUCE, "axes", False),
    "pmax": (Kind.ALL_REDUCE, "axes", False), "pmin": (Kind.ALL_REDUCE, "axes", False),
    "all_gather": (Kind.ALL_GATHER, "axis_name", True), "all_gather_invariant": (Kind.ALL_GATHER, "axis_name", True),
    "reduce_scatter": (Kind.REDUCE_SCATTER, "axis_name", True), "all_to_all": (Kind.ALL_TO_ALL, "axis_name", False),
    "ppermute": (Kind.COLLECTIVE_PERMUTE, "axis_name", True),
}


def _nbytes(aval) -> float:
    return float(math.prod(getattr(aval, "shape", ()))) * getattr(getattr(aval, "dtype", None), "itemsize", 4)


def body_collectives(jaxpr) -> list[tuple[str, tuple[str, ...], float, float]]:
    """(HLO kind, mesh axes, bytes per device as XLA's HLO shows them, runs per step) of
    each collective the body runs."""
    out = []
    for eqn, trips in body_equations(jaxpr):
        entry = COLLECTIVES.get(eqn.primitive.name)
        if entry is None:
            continue
        kind, key, result = entry
        axes = eqn.params[key]
        axes = (axes,) if isinstance(axes, str) else tuple(a for a in axes if isinstance(a, str))
        for x in (eqn.outvars if result else eqn.invars):
            out.append((kind, axes, _nbytes(x.aval), trips))
    return out
