"""A region the user partitioned by hand: `shard_map`. Its body runs on each device's
blocks with collectives of its own, so the plan does not look inside: the region is
fixed. Its operands are read, and its results made, as its `in_specs`/`out_specs` say
over the axes it makes manual, and whole along the mesh's other axes; the plan moves its
values there and back (the reshards the cost model charges) and is free on every other
value."""

from __future__ import annotations

import dataclasses

from .._errors import PartitioningError
from .._rule import FixedLayout
from ._registry import conservative_rule, register
from ._traits import Traits, Work


def manual_axes(params) -> frozenset:
    """The mesh axes a `shard_map` equation makes manual (every mesh axis unless it
    names some: `axis_names=`)."""
    for key in ("newly_manual_axes", "manual_axes", "axis_names"):
        axes = params.get(key)
        if axes:
            return frozenset(axes)
    return frozenset(params["mesh"].axis_names)


def _dims(spec, rank: int) -> tuple[tuple[str, ...], ...]:
    """A `PartitionSpec` as axes per dim (a spec may be shorter than the rank)."""
    entries = list(spec) + [None] * (rank - len(spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


@register("shard_map", traits=Traits(Work.REGION))
def shard_map(in_shapes, out_shapes, params):
    """Every dim its own blocked factor, and the layouts fixed by the specs:
    `([i, j], [k, l]) -> ([m, n]) blocked={...} fixed=(P(None, 'model'), P('model', None)) -> (P(None, None))`."""
    mesh = params["mesh"]
    fixed = FixedLayout(tuple(_dims(s, len(shape)) for s, shape in zip(params["in_specs"], in_shapes)),
                        tuple(_dims(s, len(shape)) for s, shape in zip(params["out_specs"], out_shapes)),
                        tuple((str(n), int(k)) for n, k in mesh.shape.items()))
    return dataclasses.replace(conservative_rule(in_shapes, out_shapes), fixed=fixed)


def check_fixed_regions(program, mesh) -> None:
    """Every region the user partitioned by hand (a `shard_map`) runs over axes of `mesh`
    with the same sizes; else a `PartitioningError` naming the first that does not."""
    sizes = mesh.sizes()
    for op in program.ops:
        fixed = op.rule.fixed
        if fixed is None:
            continue
        wrong = [f"{n}={k}" for n, k in fixed.mesh if sizes.get(n) != k]
        if wrong:
            name = program.name(next((v for v in op.results if v >= 0), op.operands[0]))
            raise PartitioningError(
                f"{op.primitive} making {name} runs over mesh axes {', '.join(wrong)}, which the plan's mesh {mesh} "
                "does not have: plan over the mesh the shard_map names (same axis names and sizes)")

