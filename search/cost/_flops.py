"""Work of one op, counted the way XLA's `HloCostAnalysis` counts it.

`op_work(op, program) -> (flops, transcendentals)` for the whole (unpartitioned) op,
from its primitive's traits (`partir.rules.get_traits`: the one table of what each
primitive costs, beside its factor rule): `flops` and `transcendentals` per result
element for elementwise ops (what `compiled.cost_analysis()` reports on this JAX
version: one flop for arithmetic, comparisons, selects and converts, one
transcendental for `exp`, `tanh`, ..., more for the special functions XLA expands);
`2*m*n*k` for a dot; `flops` per element reduced for a reduction; data movement
(reshape, transpose, broadcast, slice, pad, concatenate, gather, iota) is free. A
primitive without a rule has no traits: the IR replicates it and warns, and it counts
no work.

A partitioned op does `work / k` per device, where `k` is the number of devices its
factor tiling splits it over (an op on replicated values pays in full on every device).
"""

from __future__ import annotations

import math

import numpy as np

from partir.rules import Work, get_traits


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
    shapes `ins` and result shapes `outs`, by its traits' `Work`."""
    traits = get_traits(prim)
    if traits is None:
        return 0.0, 0.0
    out = _size(outs[0]) if outs else 0
    work = _WORK.get(traits.work)
    return work(traits, params, ins, outs, out) if work is not None else (0.0, 0.0)


def _window(params) -> int:
    return _size(params["window_dimensions"])


def _scanned(params, ins, out) -> float:
    # An associative scan / sorting network: about 2 log2(n) operations per element.
    n = ins[0][params.get("axis", params.get("dimension", 0))]
    return float(out * 2 * max(1, math.ceil(math.log2(max(n, 2)))))


def _contraction(params, ins, out) -> float:
    (contracting, _), _ = params["dimension_numbers"]  # 2 * every result element * the contracted size
    return 2.0 * out * _size(ins[0][d] for d in contracting)


#: How each kind of work is counted: (traits, params, operand shapes, result shapes,
#: result elements) -> (flops, transcendentals).
_WORK = {
    Work.ELEMENTWISE: lambda t, p, ins, outs, out: (t.flops * out, t.transcendentals * out),
    Work.POWER: lambda t, p, ins, outs, out: (float(out * max(1, abs(p["y"]) - 1)), 0.0),
    Work.POLYNOMIAL: lambda t, p, ins, outs, out: (2.0 * out * len(p.get("coefficients", ())), 0.0),
    Work.REDUCTION: lambda t, p, ins, outs, out: (float(t.flops * (_size(ins[0]) - out)), 0.0),
    Work.CONTRACTION: lambda t, p, ins, outs, out: (_contraction(p, ins, out), 0.0),
    Work.CONVOLUTION: lambda t, p, ins, outs, out: (_conv_flops(p, ins, outs), 0.0),
    Work.WINDOW: lambda t, p, ins, outs, out: (float(out * (_window(p) - 1)), 0.0),
    # Per source element and window element: XLA's select comparisons and the scatter's
    # add come to 7.5 flops (measured on a 2x2 max-pool gradient).
    Work.WINDOW_GRAD: lambda t, p, ins, outs, out: (7.5 * _window(p) * _size(ins[0]), 0.0),
    Work.SCATTER: lambda t, p, ins, outs, out: (float(_size(ins[2])), 0.0),
    Work.SCAN: lambda t, p, ins, outs, out: (_scanned(p, ins, out), 0.0),
    Work.REGION: lambda t, p, ins, outs, out: body_work(p["jaxpr"]),  # a region partitioned by hand
}


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
