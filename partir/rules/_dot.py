"""Contractions: dot_general and convolutions."""

from __future__ import annotations

from .._rule import factor_rule
from ._registry import Namer, conservative_rule, register
from ._traits import Traits, Work

#: Contractions are kernels of their own (cuBLAS, the MXU): XLA fuses nothing into them here.
CONTRACTION = Traits(Work.CONTRACTION)


@register("dot_general", traits=CONTRACTION)
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


@register("scaled_dot", traits=CONTRACTION)
def scaled_dot(in_shapes, out_shapes, params):
    """`(lhs * lhs_scale) @ (rhs * rhs_scale)`: lhs and rhs as in `dot_general`; a scale
    shares the non-contracting dims of its operand, and a contracting dim of `K` values
    in blocks of `s` is the factor pair `(K/s)*s`, whose major factor the scale shares:
    `([i, j*k], [j*k, l], [i, j], [j, l]) -> ([i, l]) reduction={j, k}`."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lhs, rhs, lsc, rsc = in_shapes
    name, sizes = Namer(), {}

    def factor(key, n):
        sizes[name(key)] = n
        return name(key)

    L, LS = [None] * len(lhs), [None] * len(lhs)
    R, RS = [None] * len(rhs), [None] * len(rhs)
    for d, n in enumerate(lhs):
        if d in lc:
            r, blocks = rc[lc.index(d)], lsc[d]
            if rsc[r] != blocks or n % blocks:
                raise ValueError(f"scales of {blocks} and {rsc[r]} blocks along a contracting dim of {n}")
            major = factor(("c", d), blocks)
            L[d] = R[r] = [major] if blocks == n else [major, factor(("s", d), n // blocks)]
            LS[d] = RS[r] = [major]
        else:
            L[d] = LS[d] = [factor(("l", d), n)]
    for l, r in zip(lb, rb):
        R[r] = RS[r] = L[l]
    for d, n in enumerate(rhs):
        if R[d] is None:
            R[d] = RS[d] = [factor(("r", d), n)]
    out = [L[d] for d in lb] + [L[d] for d in range(len(lhs)) if d not in lb and d not in lc]
    out += [R[d] for d in range(len(rhs)) if d not in rb and d not in rc]
    return factor_rule([L, R, LS, RS], [out], in_shapes, out_shapes, sizes=sizes,
                       reduction=[f for d in lc for f in L[d]])


@register("ragged_dot_general", traits=CONTRACTION)
def ragged_dot_general(in_shapes, out_shapes, params):
    """A grouped matmul (`lax.ragged_dot`): lhs rows fall into groups of data-dependent
    sizes, each multiplied by its group's rhs. Contracting, batch and rhs output dims are
    as in `dot_general`; the ragged row dim, the group dim and the group sizes are
    blocked: `([i, j], [k, j, l], [m]) -> ([i, l]) reduction={j} blocked={i, k, m}`.
    Other ragged forms (a ragged contracting dim, as in the gradient) run whole."""
    dn = params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = dn.dot_dimension_numbers
    ragged, groups = dn.lhs_ragged_dimensions, dn.rhs_group_dimensions
    lhs, rhs, sizes = in_shapes
    if len(groups) != 1 or any(d in lc or d in lb for d in ragged):
        # Ragged contracting or batch dims (the gradient's form): each group's rows
        # make a result of their own; run whole.
        return conservative_rule(in_shapes, out_shapes)
    (group,) = groups
    name = Namer()
    lf = [name(("l", d)) for d in range(len(lhs))]
    rf = [name(("r", d)) for d in range(len(rhs))]
    for l, r in (*zip(lc, rc), *zip(lb, rb)):
        rf[r] = lf[l]
    out = [lf[d] for d in lb] + [lf[d] for d in range(len(lhs)) if d not in lb and d not in lc]
    out += [rf[d] for d in range(len(rhs)) if d not in rb and d not in rc and d != group]
    gs = [name(("g", d)) for d in range(len(sizes))]
    return factor_rule([lf, rf, gs], [out], in_shapes, out_shapes, reduction=[lf[d] for d in lc],
                       blocked=[lf[d] for d in ragged] + [rf[group]] + gs)


@register("conv_general_dilated", traits=Traits(Work.CONVOLUTION))
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
