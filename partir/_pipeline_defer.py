"""Weight gradients a pipelined stage reduce-scatters once a step instead of once per
microbatch.

A sum over microbatches made by a reduction whose value the plan keeps split over the
reduced axes at rest (a ZeRO or FSDP weight gradient: partial over `data` as the dot
makes it, reduce-scattered to its shard) would be reduce-scattered at every tick. As
gradient accumulation does, `deferred_scatters` instead leaves it partial and whole
along those axes (on the stage's block) through the linear ops after it, which then run
on those whole blocks (the axes taken off their layout: `widened` ops), accumulates it
so over the microbatches, and the lowering reduce-scatters the accumulated sum once
after the tick loop. Only where it is plainly right: every op after the reduction is
`unary` or `additive` (`partir._pipeline.LINEARITY`) on such sums alone, makes nothing
partial itself, is no region boundary but a call's that moves nothing
(`_pipeline_hoist.call_link`: the gradient of a layer under the user's
`jax.checkpoint` leaves the checkpoint's region so, and a call runs once per tick like
the ops around it), and adds only sums left partial over the same axes; otherwise
`None`, and the all-reduce-only deferral (`_pipeline._deferred`) applies.
"""

from __future__ import annotations

from ._microbatch import LINEARITY, MICROBATCH as micro, SUM, _strip as strip
from ._pipeline_hoist import call_link

#: How `LINEARITY` ops may run on blocks whole along the deferred axes: those taking
#: sums alone (a `multilinear` op would read its other operand whole too, a move the
#: plan does not make).
_WIDENABLE = ("unary", "additive")


def deferred_scatters(ext, ops, kinds: dict):
    """(deferred, widened values, widened ops) of a pipelined body's `ops` (in program
    order; `kinds` their values' microbatch kinds), see the module docstring: `deferred`
    as `ScanLayout.deferred` ((value, mesh axes) left partial), `widened` (value, the
    `Tiling` it is held in, whole along its deferred axes), `ops` (op id, the axes taken
    off its layout). None when some sum cannot be deferred so, or none needs widening."""

    left: dict[int, frozenset] = {}
    wide_ops: dict[int, frozenset] = {}
    for op in ops:
        for v in (r for r in op.results if r >= 0 and kinds.get(r) == SUM):
            ins = [left.get(u, frozenset()) for u in op.operands if u >= 0 and kinds.get(u) == SUM]
            made, rest = ext.produced(v), ext.tiling(v)
            if op.link:
                if any(ins) and not call_link(ext, op):
                    return None  # (a deferred sum crossing a region boundary that moves it)
                if any(ins):
                    left[v] = ins[0]
                continue
            if micro in made.partial:  # the reduction over the batch
                axes = frozenset(made.partial) - {micro}
                if strip(made).dims != strip(rest).without_axes(axes).dims:
                    return None
            else:
                if len(set(ins)) > 1:
                    return None
                axes = ins[0]
                if axes and not _widenable(ext, op, kinds):
                    return None
                if axes:
                    wide_ops[op.id] = axes
            if axes:
                left[v] = axes
    widened = tuple((v, ext.tiling(v).without_axes(axes)) for v, axes in left.items()
                    if axes & set(ext.tiling(v).axes()))
    if not widened:
        return None
    deferred = tuple((v, tuple(a for a in ext.mesh.names if a in axes)) for v, axes in left.items())
    return deferred, widened, tuple(sorted((o, tuple(a for a in ext.mesh.names if a in axes))
                                           for o, axes in wide_ops.items()))


def _widenable(ext, op, kinds: dict) -> bool:
    """Can `op`, reading sums left partial over some axes, run on their blocks whole
    along them: linear in sums alone, partial over nothing itself, its layout the same
    whichever way the lowering and the cost model read it?"""

    if LINEARITY.get(op.primitive) not in _WIDENABLE:
        return False
    if any(u >= 0 and kinds.get(u) != SUM for u in op.operands):
        return False
    block, whole = ext.block_layout(op.id), ext.op_layout(op.id)
    return not block[1] and block[0] == whole[0]
