"""Work of one op, counted the way XLA's `HloCostAnalysis` counts it.

`op_work(op, program) -> (flops, transcendentals)` for the whole (unpartitioned) op.
The counting follows what `compiled.cost_analysis()` reports on this JAX version
(measured, see `tests/test_cost.py`): one flop per result element for arithmetic,
comparisons, selects and converts; none for transcendentals (`exp`, `log`, `tanh`,
`sqrt`, `rsqrt`, `pow`, `erf`, ...), which are counted apart; `2*m*n*k` for a dot;
`in - out` elements for a reduction; data movement (reshape, transpose, broadcast,
slice, pad, concatenate, gather, iota) is free.

A partitioned op does `work / k` per device, where `k` is the number of devices its
factor tiling splits it over (an op on replicated values pays in full on every device).
"""

from __future__ import annotations

import math

import numpy as np

#: Per result element: 1 flop.
ARITHMETIC = set("""add add_any sub mul div rem max min neg abs sign floor ceil round clamp eq ne lt le gt ge
and or not xor select_n convert_element_type square shift_left shift_right_arithmetic shift_right_logical
nextafter is_finite population_count clz real imag conj complex reduce_precision""".split())

#: Per result element: 1 transcendental, no flop.
TRANSCENDENTAL = set("""exp exp2 log log1p expm1 tanh sqrt rsqrt cbrt pow erf erfc erf_inv sin cos tan asin
acos atan asinh acosh atanh sinh cosh atan2 lgamma digamma igamma igammac bessel_i0e bessel_i1e""".split())

#: Reductions: (input - output) elements, times this many flops per element (XLA's
#: variadic arg-max/arg-min reduce compares and selects value and index: 9 per element).
REDUCTIONS = {"reduce_sum": 1, "reduce_max": 1, "reduce_min": 1, "reduce_prod": 1, "reduce_and": 1,
              "reduce_or": 1, "reduce_xor": 1, "argmax": 9, "argmin": 9}


def _size(shape) -> int:
    return int(math.prod(shape))


def op_work(op, program) -> tuple[float, float]:
    """(flops, transcendentals) of the whole op, before partitioning. Links cost nothing;
    a region the user partitioned by hand (`shard_map`) costs its body's work on one
    device (`search._manual`)."""
    if op.link:
        return 0.0, 0.0
    vals = program.values
    ins = tuple(vals[v].shape if v >= 0 else () for v in op.operands)
    outs = tuple(vals[v].shape if v >= 0 else () for v in op.results)
    return eqn_work(op.primitive, op.eqn.params if op.eqn is not None else {}, ins, outs)


def eqn_work(prim: str, params, ins, outs) -> tuple[float, float]:
    """(flops, transcendentals) of one equation of primitive `prim` with `params`, operand
    shapes `ins` and result shapes `outs`."""
    out = _size(outs[0]) if outs else 0
    if prim in ARITHMETIC:
        return float(out), 0.0
    if prim in TRANSCENDENTAL:
        return 0.0, float(out)
    if prim == "integer_pow":
        return float(out * max(1, abs(params["y"]) - 1)), 0.0
    if prim == "one_minus_square":  # 1 - x*x, the tanh derivative of newer JAX versions
        return 2.0 * out, 0.0
    if prim == "logistic":  # XLA expands it: 3 flops and an exp per element
        return 3.0 * out, float(out)
    if prim in REDUCTIONS:
        return float(REDUCTIONS[prim] * (_size(ins[0]) - out)), 0.0
    if prim == "dot_general":  # 2 * every result element * the contracted size
        (contracting, _), _ = params["dimension_numbers"]
        return 2.0 * out * _size(ins[0][d] for d in contracting), 0.0
    if prim == "conv_general_dilated":
        return _conv_flops(params, ins, outs), 0.0
    if prim in ("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window"):
        window = _size(params["window_dimensions"])
        return float(out * (window - 1)), 0.0
    if prim in ("select_and_scatter_add", "select_and_gather_add"):
        # Per source element and window element: XLA's select comparisons and the
        # scatter's add come to 7.5 flops (measured on a 2x2 max-pool gradient).
        window = _size(params["window_dimensions"])
        return 7.5 * window * _size(ins[0]), 0.0
    if prim in ("scatter-add", "scatter_add", "scatter-mul", "scatter-min", "scatter-max"):
        return float(_size(ins[2])), 0.0
    if prim in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort"):
        # An associative scan / sorting network: about 2 log2(n) operations per element.
        n = ins[0][params.get("axis", params.get("dimension", 0))]
        return float(out * 2 * max(1, math.ceil(math.log2(max(n, 2))))), 0.0
    if prim == "shard_map":  # a region partitioned by hand: its body's work on one device
        return body_work(params["jaxpr"])
    return 0.0, 0.0


def _conv_flops(p, ins, outs) -> float:
    """2 * batch * out features * in features per group * valid kernel taps, where a tap
    counts only where it lands inside the (unpadded) input, as XLA counts it."""
    dn = p["dimension_numbers"]
    lhs, rhs, out = ins[0], ins[1], outs[0]
    n = out[dn.out_spec[0]]
    o = out[dn.out_spec[1]]
    c = rhs[dn.rhs_spec[1]]
    taps = 1.0
    for k, (ld, rd, od) in enumerate(zip(dn.lhs_spec[2:], dn.rhs_spec[2:], dn.out_spec[2:])):
        size, ksize, osize = lhs[ld], rhs[rd], out[od]
        stride = p["window_strides"][k]
        lo = p["padding"][k][0]
        ldil = (p.get("lhs_dilation") or (1,) * len(p["window_strides"]))[k]
        rdil = (p.get("rhs_dilation") or (1,) * len(p["window_strides"]))[k]
        dilated = (size - 1) * ldil + 1
        pos = np.arange(osize)[:, None] * stride - lo + np.arange(ksize)[None, :] * rdil
        valid = (pos >= 0) & (pos < dilated) & (pos % ldil == 0)
        taps *= float(valid.sum())
    return 2.0 * n * o * c * taps


def body_equations(jaxpr, trips: float = 1.0):
    """(equation, runs per step) of every equation of `jaxpr` and of the jaxprs nested in
    it: a scan's body `length` times, a `while` loop's once, every `cond` branch once."""
    for eqn in jaxpr.eqns:
        params = eqn.params
        inner = []
        if eqn.primitive.name == "scan":
            inner = [(params["jaxpr"], trips * params["length"])]
        elif eqn.primitive.name == "while":
            inner = [(params["cond_jaxpr"], trips), (params["body_jaxpr"], trips)]
        elif eqn.primitive.name == "cond":
            inner = [(b, trips) for b in params["branches"]]
        else:
            inner = [(p, trips) for p in params.values() if hasattr(p, "eqns") or hasattr(p, "jaxpr")]
        if not inner:
            yield eqn, trips
        for sub, t in inner:
            yield from body_equations(getattr(sub, "jaxpr", sub), t)


def body_work(jaxpr) -> tuple[float, float]:
    """(flops, transcendentals) of one device's run of the body."""
    flops = trans = 0.0
    for eqn, trips in body_equations(jaxpr):
        ins = tuple(tuple(getattr(x.aval, "shape", ())) for x in eqn.invars)
        outs = tuple(tuple(getattr(x.aval, "shape", ())) for x in eqn.outvars)
        f, t = eqn_work(eqn.primitive.name, eqn.params, ins, outs)
        flops, trans = flops + f * trips, trans + t * trips
    return flops, trans
