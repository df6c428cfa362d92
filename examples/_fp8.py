"""FP8 matmuls as Transformer Engine and MaxText's ``quantization=fp8`` run a layer's
projections: the forward operands in E4M3, the output's gradient in E5M2 (TE's
``HYBRID`` format), each dot accumulating in float32 and scaled back, every other op in
the compute dtype.

Each tensor is quantized with one scale a tensor (``x / scale`` cast to FP8, the dot's
result multiplied by both scales), by one of two recipes (`SCALINGS`):

- ``"delayed"`` (`Fp8Scales`, MaxText's ``quantization=fp8`` and TE's
  ``DelayedScaling``): each scale comes from an amax history of earlier steps; here the
  history is frozen, the scales constants of the call. What that leaves out is the
  history's update, a reduction of each quantized tensor's absolute maximum that XLA
  and TE fuse into the kernel producing the tensor, and the maxima's all-reduces. Under
  MaxText's ``quantization=fp8`` (flax's ``Fp8DotGeneralOp``, as of December 2024)
  those are three scalar max all-reduces a dot: the input's and the output gradient's
  over every device the batch is split over, the kernel's over its shards, all in the
  backward layer loop (its SPMD-partitioned HLO under JAX 0.4.37), each read only by
  the next step's history. They are off the critical path, and at NCCL's small-message
  latencies 0.03-0.15 s a step on a 70B model of 80 layers.
- ``"current"`` (`CurrentScaling`, TE's ``Float8CurrentScaling``, Megatron-Bridge's
  "FP8-CS"): each tensor's scale is its own absolute maximum over the format's
  largest value, taken just before its cast. The cast waits on that reduction, so each
  quantized tensor is read once for its maximum and once for its cast (and a sharded
  one's maximum is all-reduced over its shards): the program holds both.

The dots, their FP8 operands and the quantizing casts are all in the program.

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


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Each tensor's scale from its own absolute maximum, taken just before its cast
    (module docstring): ``amax / largest finite value of the FP8 format``, 1 for a tensor
    of zeros."""


#: The recipes `fp8_dot` runs, by name (module docstring).
SCALINGS = {"delayed": Fp8Scales(), "current": CurrentScaling()}


def fp8_dot(scaling: str):
    """``dot(spec, x, w)``: `fp8_einsum` under the recipe named ``scaling`` (a key of
    `SCALINGS`)."""
    if scaling not in SCALINGS:
        raise ValueError(f"fp8_dot: unknown scaling {scaling!r}; allowed: {list(SCALINGS)}")
    return functools.partial(_einsum_with, SCALINGS[scaling])


def _einsum_with(scales, spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    return fp8_einsum(spec, x, w, scales)


def _scale(x: jax.Array, scales, role: str, dtype):
    """The scale of ``x``, quantized to `dtype` in `role` ('activation', 'weight' or
    'gradient'): the recipe's constant, or under `CurrentScaling` ``x``'s absolute
    maximum over `dtype`'s largest value."""
    if isinstance(scales, Fp8Scales):
        return getattr(scales, role)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)


def _quantize(x: jax.Array, scale, dtype) -> jax.Array:
    """``x / scale`` in `dtype`, saturated at its largest finite value."""
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * (1.0 / scale), -top, top).astype(dtype)


def _transposed(spec: str) -> tuple[str, str]:
    """The einsums of an ``"x,w->y"`` spec's gradients: ``(y, w -> x)`` and ``(x, y -> w)``."""
    ins, out = spec.split("->")
    x, w = ins.split(",")
    return f"{out},{w}->{x}", f"{x},{out}->{w}"


def _dot(spec: str, a: jax.Array, b: jax.Array, scale, dtype) -> jax.Array:
    # The result in the compute dtype, scaled there: the one FP8 GEMM with scaling and a
    # bfloat16 output that XLA:GPU's GEMM rewriter and TE call, not a float32 buffer.
    return jnp.einsum(spec, a, b, preferred_element_type=dtype) * jnp.asarray(scale, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def fp8_einsum(spec: str, x: jax.Array, w: jax.Array, scales: Fp8Scales | CurrentScaling = Fp8Scales()) -> jax.Array:
    """``jnp.einsum(spec, x, w)`` with both operands in E4M3 and the gradients' dots in
    FP8, scaled as ``scales`` says (module docstring); the result in the operands' dtype,
    which they share (the compute dtype). ``spec`` names two operands and sums no index
    only one of them has."""
    return _fp8_fwd(spec, x, w, scales)[0]


def _fp8_fwd(spec, x, w, scales):
    # Checked here, where a differentiated call starts too (it never runs the primal).
    if x.dtype != w.dtype:
        raise TypeError(f"fp8_einsum: x is {x.dtype} and w is {w.dtype}; cast both to the compute dtype first")
    sx, sw = _scale(x, scales, "activation", E4M3), _scale(w, scales, "weight", E4M3)
    qx, qw = _quantize(x, sx, E4M3), _quantize(w, sw, E4M3)
    y = _dot(spec, qx, qw, sx * sw, x.dtype)
    # Constant scales are the recipe's, not residuals: the delayed program saves the FP8
    # operands alone.
    return y, ((qx, qw) if isinstance(scales, Fp8Scales) else (qx, qw, sx, sw))


def _fp8_bwd(spec, scales, res, g):
    qx, qw = res[:2]
    sx, sw = (scales.activation, scales.weight) if isinstance(scales, Fp8Scales) else res[2:]
    sg = _scale(g, scales, "gradient", E5M2)
    qg = _quantize(g, sg, E5M2)
    to_x, to_w = _transposed(spec)
    dx = _dot(to_x, qg, qw, sg * sw, g.dtype)
    dw = _dot(to_w, qx, qg, sx * sg, g.dtype)
    return dx, dw


fp8_einsum.defvjp(_fp8_fwd, _fp8_bwd)
