"""Elementwise families: every operand dim shares a factor with the same result dim."""

from __future__ import annotations

from .._rule import factor_rule
from ._registry import Namer, register

UNARY = """abs acos acosh asin asinh atan atanh bessel_i0e bessel_i1e cbrt ceil clz conj cos cosh
digamma erf erf_inv erfc exp exp2 expm1 floor imag integer_pow is_finite lgamma log log1p log2 logistic
neg not population_count real reduce_precision round rsqrt sign sin sinh sqrt square tan tanh
convert_element_type copy copy_p stop_gradient sharding_constraint one_minus_square reshard mesh_cast""".split()

NARY = """add add_any sub mul div rem pow max min atan2 nextafter and or xor eq ne lt le gt ge
shift_left shift_right_arithmetic shift_right_logical complex igamma igammac igamma_grad_a
random_gamma_grad polygamma zeta select_n clamp threefry2x32 mulhi lt_to le_to regularized_incomplete_beta
polynomial""".split()

#: Identity ops over several values: operand i is result i.
IDENTITY_N = ["optimization_barrier", "device_put"]


def elementwise(in_shapes, out_shapes, params):
    """`([i, j], [i, j]) -> ([i, j])`; rank-0 operands (scalars, literals) join nothing.
    A dim whose size differs from the result's (an implicit broadcast) gets its own factor."""
    name = Namer()
    out = out_shapes[0]
    res = [name(d) for d in range(len(out))]
    ins = []
    for s in in_shapes:
        if len(s) != len(out):
            ins.append([name.fresh() for _ in s])
        else:
            ins.append([res[d] if s[d] == out[d] else name.fresh() for d in range(len(s))])
    outs = [res if s == out else [name.fresh() for _ in s] for s in out_shapes]
    return factor_rule(ins, outs, in_shapes, out_shapes)


def identity_n(in_shapes, out_shapes, params):
    """Operand i and result i share every dim: `([i], [j]) -> ([i], [j])`."""
    name = Namer()
    specs = [[name((k, d)) for d in range(len(s))] for k, s in enumerate(in_shapes)]
    return factor_rule(specs, specs[: len(out_shapes)], in_shapes, out_shapes)


def bitcast_convert_type(in_shapes, out_shapes, params):
    """Same width: elementwise. A narrower result gains a minor dim, a wider one loses it;
    that extra dim is blocked."""
    (a,), (b,) = in_shapes, out_shapes
    if len(a) == len(b):
        return elementwise(in_shapes, out_shapes, params)
    name = Namer()
    shared = [name(d) for d in range(min(len(a), len(b)))]
    extra = name.fresh()
    ins, outs = (shared + [extra], shared) if len(a) > len(b) else (shared, shared + [extra])
    return factor_rule([ins], [outs], in_shapes, out_shapes, blocked=[extra])


register(*UNARY, *NARY)(elementwise)
register(*IDENTITY_N)(identity_n)
register("bitcast_convert_type")(bitcast_convert_type)
