"""Elementwise families: every operand dim shares a factor with the same result dim."""

from __future__ import annotations

from .._rule import factor_rule
from ._registry import Namer, register
from ._traits import OPAQUE, Fusion, Traits, Work, arithmetic, transcendental

_CHEAP_ONE_FLOP = """abs ceil floor neg not round sign real imag conj is_finite clz population_count
reduce_precision square convert_element_type add add_any sub mul max min and or xor eq ne lt le gt ge
shift_left shift_right_arithmetic shift_right_logical select_n clamp complex mulhi lt_to le_to""".split()
#: `name` is `jax.ad_checkpoint.checkpoint_name`'s mark: an identity XLA never sees.
_CHEAP_NO_FLOP = "copy copy_p stop_gradient name".split()
#: Layout requests: identities the lowering drops (the plan's constraints replace them);
#: to the cost model a buffer of their own, as they always were.
_LAYOUT = "sharding_constraint reshard mesh_cast".split()
_EXPENSIVE_ONE_FLOP = "div rem".split()
_ONE_TRANSCENDENTAL = "exp log log1p expm1 tanh sqrt rsqrt cbrt pow erf tan atan atan2".split()

#: The elementwise primitives' traits. Flops and transcendentals per element as
#: `compiled.cost_analysis()` counts them on this JAX version (XLA expands the special
#: functions into polynomials: erf_inv, lgamma, the gamma family, bessel, zeta); sin and
#: cos are cheap to XLA's fusion (`IsExpensive`), the other transcendentals and division
#: are expensive.
TRAITS = {
    **{p: arithmetic() for p in _CHEAP_ONE_FLOP},
    **{p: Traits(Work.MOVE, Fusion.CHEAP) for p in _CHEAP_NO_FLOP},
    **{p: OPAQUE for p in _LAYOUT},
    **{p: arithmetic(fusion=Fusion.EXPENSIVE) for p in _EXPENSIVE_ONE_FLOP},
    **{p: transcendental() for p in _ONE_TRANSCENDENTAL},
    "sin": transcendental(fusion=Fusion.CHEAP), "cos": transcendental(fusion=Fusion.CHEAP),
    "exp2": transcendental(flops=1), "log2": transcendental(flops=1), "logistic": transcendental(flops=3),
    "erfc": transcendental(flops=60), "asin": transcendental(2, 5), "acos": transcendental(2, 3),
    "asinh": transcendental(3, 11), "acosh": transcendental(4, 7), "atanh": transcendental(2, 6),
    "sinh": transcendental(3, 10), "cosh": transcendental(2, 3), "erf_inv": transcendental(2, 37),
    "lgamma": transcendental(4, 52), "digamma": transcendental(3, 73), "bessel_i0e": transcendental(1, 83),
    "bessel_i1e": transcendental(1, 83), "igamma": transcendental(6, 268), "igammac": transcendental(6, 268),
    "igamma_grad_a": transcendental(11, 539), "random_gamma_grad": transcendental(11, 539),
    "polygamma": transcendental(19, 254), "zeta": transcendental(11, 122),
    "regularized_incomplete_beta": transcendental(16, 258), "nextafter": arithmetic(23),
    # 1 - x*x, the tanh derivative of newer JAX versions: a multiply and a subtract.
    "one_minus_square": arithmetic(2),
    "integer_pow": Traits(Work.POWER, Fusion.CHEAP),
    # The hash behind jax.random's bits: about 86 integer operations per pair of outputs
    # (measured through `random_bits`: 43 per output word).
    "threefry2x32": arithmetic(86, fusion=Fusion.EXPENSIVE),
    # An evaluated polynomial: Horner's rule, two flops per coefficient.
    "polynomial": Traits(Work.POLYNOMIAL, Fusion.EXPENSIVE),
}

UNARY = """abs acos acosh asin asinh atan atanh bessel_i0e bessel_i1e cbrt ceil clz conj cos cosh
digamma erf erf_inv erfc exp exp2 expm1 floor imag integer_pow is_finite lgamma log log1p log2 logistic
neg not population_count real reduce_precision round rsqrt sign sin sinh sqrt square tan tanh
convert_element_type copy copy_p stop_gradient name sharding_constraint one_minus_square reshard mesh_cast""".split()

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


register(*UNARY, *NARY, traits=TRAITS)(elementwise)
register(*IDENTITY_N, traits=OPAQUE)(identity_n)
register("bitcast_convert_type", traits=OPAQUE)(bitcast_convert_type)
