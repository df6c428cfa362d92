"""Contractions: dot_general and convolutions."""

from __future__ import annotations

from .._rule import factor_rule
from ._registry import Namer, register


@register("dot_general")
def dot_general(in_shapes, out_shapes, params):
    """Batch dims are shared by both operands and the result, free dims pass through,
    contracting dims are reductions: a matmul is `([i, j], [j, k]) -> ([i, k]) reduction={j}`."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lhs_shape, rhs_shape = in_shapes
    name = Namer()
    lhs = [name(("l", d)) for d in range(len(lhs_shape))]
    rhs = [None] * len(rhs_shape)
    for l, r in zip(lb, rb):
        rhs[r] = lhs[l]
    for l, r in zip(lc, rc):
        rhs[r] = lhs[l]
    rhs = [f if f is not None else name(("r", d)) for d, f in enumerate(rhs)]
    out = [lhs[d] for d in lb]
    out += [lhs[d] for d in range(len(lhs_shape)) if d not in lb and d not in lc]
    out += [rhs[d] for d in range(len(rhs_shape)) if d not in rb and d not in rc]
    return factor_rule([lhs, rhs], [out], in_shapes, out_shapes, reduction=[lhs[d] for d in lc])


@register("conv_general_dilated")
def conv_general_dilated(in_shapes, out_shapes, params):
    """Batch `n` passes through, input features `c` are a reduction, output features `o`
    pass from the kernel to the result; spatial dims are blocked (no halo exchange):
    NHWC x HWIO -> NHWC is `([i, j, k, l], [m, n, l, o]) -> ([i, p, q, o]) reduction={l} ...`.
    Grouped convolutions block their feature (or batch) dims."""
    dn = params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    (lhs_shape, rhs_shape), (out_shape,) = in_shapes, out_shapes
    name = Namer()
    lhs = [name(("l", d)) for d in range(len(lhs_shape))]
    rhs = [name(("r", d)) for d in range(len(rhs_shape))]
    out = [name(("o", d)) for d in range(len(out_shape))]
    spatial = [lhs[d] for d in lhs_spec[2:]] + [rhs[d] for d in rhs_spec[2:]] + [out[d] for d in out_spec[2:]]
    blocked = list(spatial)
    grouped = params.get("feature_group_count", 1) > 1
    batch_grouped = params.get("batch_group_count", 1) > 1
    if batch_grouped:
        blocked += [lhs[lhs_spec[0]], out[out_spec[0]], rhs[rhs_spec[0]], out[out_spec[1]]]
    else:
        out[out_spec[0]] = lhs[lhs_spec[0]]
    reduction = []
    if grouped:
        blocked += [lhs[lhs_spec[1]], rhs[rhs_spec[1]], rhs[rhs_spec[0]], out[out_spec[1]]]
    else:
        rhs[rhs_spec[1]] = lhs[lhs_spec[1]]
        reduction = [lhs[lhs_spec[1]]]
        if not batch_grouped:
            out[out_spec[1]] = rhs[rhs_spec[0]]
    return factor_rule([lhs, rhs], [out], in_shapes, out_shapes, reduction=reduction, blocked=blocked)
