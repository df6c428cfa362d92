"""Reductions and scans along dims."""

from __future__ import annotations

from .._rule import factor_rule
from ._registry import Namer, register
from ._traits import Fusion, Traits, Work


def _reduction(flops: float = 1.0, fusion: Fusion = Fusion.INPUT) -> Traits:
    """A reduction of `flops` flops per element reduced that input fusions take their
    producers into (XLA's variadic arg-max/arg-min reduce compares and selects value
    and index: 9 per element)."""
    return Traits(Work.REDUCTION, fusion, flops=flops)


#: reduce_* primitive -> the kind of partial result a split reduced dim leaves.
REDUCTION_KINDS = {
    "reduce_sum": "sum",
    "reduce_max": "max",
    "reduce_min": "min",
    "reduce_prod": "prod",
    "reduce_and": "and",
    "reduce_or": "or",
}

#: Reductions whose partial results one all-reduce cannot combine (an arg-max needs the
#: value and the index): their reduced dims are blocked, i.e. gathered before the op.
BLOCKED_REDUCTIONS = ["argmax", "argmin", "reduce_xor", "reduce"]

#: Collectives over positional axes (what `vmap` leaves of a psum, pmax or pmin over its
#: named axis) -> the kind of partial result a split reduced dim leaves.
COLLECTIVE_REDUCTIONS = {"psum": "sum", "pmax": "max", "pmin": "min"}

#: Scans along one dim (`axis` param): that dim is blocked.
CUMULATIVE = ["cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"]


def _reduce_rule(in_shapes, out_shapes, axes, *, kind=None):
    # All operands (variadic `reduce` has several) share factors dim by dim; the generic
    # `reduce`'s init values (scalars, after the operands) join nothing.
    name = Namer()
    dims = [name(d) for d in range(len(in_shapes[0]))]
    kept = [f for d, f in enumerate(dims) if d not in axes]
    gone = [f for d, f in enumerate(dims) if d in axes]
    ins = [dims if len(s) == len(dims) else [] for s in in_shapes]
    outs = [kept] * len(out_shapes)
    if kind is None:
        return factor_rule(ins, outs, in_shapes, out_shapes, blocked=gone)
    return factor_rule(ins, outs, in_shapes, out_shapes, reduction=gone, reduce_kind=kind)


def _def_reduction(prim: str, kind: str) -> None:
    def rule(in_shapes, out_shapes, params):
        """`([i, j]) -> ([i]) reduction={j}` for a reduction over dim 1."""
        return _reduce_rule(in_shapes, out_shapes, tuple(params["axes"]), kind=kind)

    rule.__name__ = f"{prim}_rule"
    register(prim, traits=_reduction())(rule)


for _prim, _kind in REDUCTION_KINDS.items():
    _def_reduction(_prim, _kind)


@register(*BLOCKED_REDUCTIONS, traits={"argmax": _reduction(9), "argmin": _reduction(9),
                                     "reduce_xor": _reduction(fusion=Fusion.NONE), "reduce": _reduction(0, Fusion.NONE)})
def blocked_reduction(in_shapes, out_shapes, params):
    """`([i, j]) -> ([i]) blocked={j}`: the reduced dims must be whole on every device."""
    axes = params.get("axes", params.get("dimensions"))
    return _reduce_rule(in_shapes, out_shapes, tuple(axes))


@register(*CUMULATIVE, traits=Traits(Work.SCAN))
def cumulative(in_shapes, out_shapes, params):
    """`([i, j]) -> ([i, j]) blocked={j}` for a scan along dim 1."""
    name = Namer()
    dims = [name(d) for d in range(len(in_shapes[0]))]
    return factor_rule([dims], [dims], in_shapes, out_shapes, blocked=[dims[params["axis"]]])


def _def_collective(prim: str, kind: str) -> None:
    def rule(in_shapes, out_shapes, params):
        """Each operand is reduced over the positional `axes` into its own result, as a
        `reduce_*` would: `([i, j], [k, l]) -> ([j], [l]) reduction={i, k}`. Named axes
        exist only inside `shard_map` bodies, which lift does not enter."""
        axes = params["axes"]
        if not all(isinstance(a, int) for a in axes):
            raise ValueError(f"named axes {axes} (a collective inside shard_map or pmap)")
        name = Namer()
        ins = [[name((k, d)) for d in range(len(s))] for k, s in enumerate(in_shapes)]
        outs = [[f for d, f in enumerate(spec) if d not in axes] for spec in ins]
        gone = [spec[d] for spec in ins for d in axes]
        return factor_rule(ins, outs, in_shapes, out_shapes, reduction=gone, reduce_kind=kind)

    rule.__name__ = f"{prim}_rule"
    register(prim, traits=Traits(Work.MOVE))(rule)  # over positional axes: counted as no work, as always


for _prim, _kind in COLLECTIVE_REDUCTIONS.items():
    _def_collective(_prim, _kind)
