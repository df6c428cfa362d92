"""FP8 matmuls as Transformer Engine and MaxText's ``quantization=fp8`` run a layer's
projections: the forward operands in E4M3, the output's gradient in E5M2 (TE's
``HYBRID`` format), each dot accumulating in float32 and scaled back, every other op in
the compute dtype.

Each tensor is quantized with one scale a tensor (``x / scale`` cast to FP8, the dot's
result multiplied by both scales), as delayed scaling does. Delayed scaling takes each
scale from an amax history of earlier steps; here the history is frozen: the scales are
constants of the call (`Fp8Scales`). What that leaves out is the history's update, a
reduction of each quantized tensor's absolute maximum that XLA and TE fuse into the
kernel producing the tensor, and one small all-reduce of the maxima a step off the
critical path (MaxText's amax reductions feed the next step's scales, not this step's
dots). The dots, their FP8 operands and the quantizing casts are all in the program.

The backward saves the forward's FP8 operands (half the bytes of bfloat16), as TE's FP8
linear layers do, and runs both gradient dots in FP8 with the E5M2 gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


@dataclasses.dataclass(frozen=True)
class Fp8Scales:
    """Per-tensor scales (a tensor is divided by its scale before the cast to FP8):
    `activation` for a dot's input, `weight` for its kernel, `gradient` for the output's
    gradient. The defaults keep unit-scale activations and weights in E4M3's range
    (448 at most) and a mean loss's per-token gradients (about 1/tokens) in E5M2's
    normal range (6.1e-5 at least)."""

    activation: float = 1.0
    weight: float = 1.0
    gradient: float = 2.0**-16


def _quantize(x: jax.Array, scale: float, dtype) -> jax.Array:
    """``x / scale`` in `dtype`, saturated at its largest finite value."""
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * (1.0 / scale), -top, top).astype(dtype)


def _transposed(spec: str) -> tuple[str, str]:
    """The einsums of an ``"x,w->y"`` spec's gradients: ``(y, w -> x)`` and ``(x, y -> w)``."""
    ins, out = spec.split("->")
    x, w = ins.split(",")
    return f"{out},{w}->{x}", f"{x},{out}->{w}"


def _dot(spec: str, a: jax.Array, b: jax.Array, scale: float, dtype) -> jax.Array:
    # The result in the compute dtype, scaled there: the one FP8 GEMM with scaling and a
    # bfloat16 output that XLA:GPU's GEMM rewriter and TE call, not a float32 buffer.
    return jnp.einsum(spec, a, b, preferred_element_type=dtype) * jnp.asarray(scale, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def fp8_einsum(spec: str, x: jax.Array, w: jax.Array, scales: Fp8Scales = Fp8Scales()) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` with both operands in E4M3 and the gradients' dots in
    FP8 (module docstring); the result in the operands' dtype, which they share (the
    compute dtype). ``spec`` names two operands and sums no index only one of them has."""
    return _fp8_fwd(spec, x, w, scales)[0]


def _fp8_fwd(spec, x, w, scales):
    # Checked here, where a differentiated call starts too (it never runs the primal).
    if x.dtype != w.dtype:
        raise TypeError(f"fp8_einsum: x is {x.dtype} and w is {w.dtype}; cast both to the compute dtype first")
    qx, qw = _quantize(x, scales.activation, E4M3), _quantize(w, scales.weight, E4M3)
    y = _dot(spec, qx, qw, scales.activation * scales.weight, x.dtype)
    return y, (qx, qw)


def _fp8_bwd(spec, scales, res, g):
    qx, qw = res
    qg = _quantize(g, scales.gradient, E5M2)
    to_x, to_w = _transposed(spec)
    dx = _dot(to_x, qg, qw, scales.gradient * scales.weight, g.dtype)
    dw = _dot(to_w, qx, qg, scales.activation * scales.gradient, g.dtype)
    return dx, dw


fp8_einsum.defvjp(_fp8_fwd, _fp8_bwd)
