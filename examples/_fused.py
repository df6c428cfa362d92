"""RMSNorm and SwiGLU as fused kernels keep them: custom VJPs saving only their inputs.

Differentiated as written (`examples/llama.py`'s `rms_norm` and `mlp`), JAX keeps what
each elementwise step's derivative reads: the norm's float32 copy of its input and its
normalised output, SwiGLU's gate activation and product besides its two inputs. Fused
kernels keep less and recompute the rest inside their backward kernel: Transformer
Engine's RMSNorm (the `TELayerNormColumnParallelLinear` of Megatron-LM's layer spec)
saves its input and the per-row inverse RMS; Megatron-LM's SwiGLU fusion
(`bias_activation_fusion`) saves the two projections it multiplies. NeMo's Llama 3
configurations turn both on (`nemo/collections/llm/gpt/model/llama.py`, `Llama3Config`,
its "Fusions" block). These are those contracts in JAX: the same forward values, the
same gradients (up to rounding), and what a training step keeps per layer is what
those kernels keep.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _normalise(x: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """(x / rms(x) in float32, 1 / rms(x) per row in float32)."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return x32 * inv, inv


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fused_rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of ``x`` over its last axis (statistics in float32) times ``scale``, in
    ``x``'s dtype; its backward keeps ``x`` and the inverse RMS (one float32 a row)."""
    return _rms_norm_fwd(x, scale, eps)[0]


def _rms_norm_fwd(x, scale, eps):
    normed, inv = _normalise(x, eps)
    return normed.astype(x.dtype) * scale.astype(x.dtype), (x, inv, scale)


def _rms_norm_bwd(eps, saved, g):
    x, inv, scale = saved
    normed = x.astype(jnp.float32) * inv  # recomputed from the saved input and statistic
    rows = tuple(range(x.ndim - 1))
    d_scale = jnp.sum((normed.astype(x.dtype) * g).astype(jnp.float32), axis=rows).astype(scale.dtype)
    g_normed = g.astype(jnp.float32) * scale.astype(x.dtype).astype(jnp.float32)
    # d(x * inv)/dx applied to g_normed: inv * (g - normed * mean(g * normed)).
    d_x = inv * (g_normed - normed * jnp.mean(g_normed * normed, axis=-1, keepdims=True))
    return d_x.astype(x.dtype), d_scale


fused_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@jax.custom_vjp
def fused_swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up``; its backward keeps ``gate`` and ``up`` and recomputes the
    activation from them (in float32)."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return fused_swiglu(gate, up), (gate, up)


def _swiglu_bwd(saved, g):
    gate, up = saved
    gate32, g32 = gate.astype(jnp.float32), g.astype(jnp.float32)
    sig = jax.nn.sigmoid(gate32)
    d_up = g32 * gate32 * sig
    # silu'(z) = sigmoid(z) * (1 + z * (1 - sigmoid(z))).
    d_gate = g32 * up.astype(jnp.float32) * sig * (1 + gate32 * (1 - sig))
    return d_gate.astype(gate.dtype), d_up.astype(up.dtype)


fused_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
