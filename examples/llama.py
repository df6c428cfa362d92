"""A Llama-style decoder-only transformer, written as people write one in JAX today.

RMSNorm (pre-norm), rotary position embeddings (split-halves form), grouped-query
attention through ``jax.nn.dot_product_attention(..., is_causal=True)``, a SwiGLU MLP,
an untied embedding and LM head, mean next-token cross-entropy (``loss``: the targets'
log-probabilities gathered, or summed against one-hot targets as MaxText does).

Parameters (D = d_model, H = n_heads, K = n_kv_heads, Dh = d_head, F = d_ff, V = vocab)::

    embed:      {tokens [V, D]}
    layers[i]:  attn_norm {scale [D]}
                attn {wq [D, H, Dh], wk [D, K, Dh], wv [D, K, Dh], wo [H, Dh, D]}
                mlp_norm {scale [D]}
                mlp {w_gate [D, F], w_up [D, F], w_down [F, D]}
    final_norm: {scale [D]}
    head:       {w [D, V]}

The attention projections are 3-D kernels, the layout of flax's ``DenseGeneral`` and
``nnx.Einsum``, applied with ``jnp.einsum``. With ``scan_layers=True``, ``layers`` is one
dict of the same keys whose leaves are stacked on a leading [L] axis, run under
``jax.lax.scan`` (the same per-layer values as the unrolled form).
Batch: ``{'tokens': i32[B, S], 'targets': i32[B, S]}``.

**Mixed precision.** Parameters are float32 master weights (and so is the adam state);
each layer casts its weights to ``config.dtype`` where it uses them, activations are
``config.dtype``, RMSNorm statistics and the loss are float32. The tiny default computes
in float32 so that partitioned and unpartitioned runs agree tightly; the Llama-3 shaped
configs compute in bfloat16.
With ``master_weights=True`` (Megatron-LM's and NeMo's bf16 training) the parameters
themselves are ``config.dtype``, and the optimizer state holds a float32 master copy
with the adam moments: the step takes gradients of the ``config.dtype`` parameters,
updates the master copy in float32 and casts it back (`build_master_weights_train_step`).

**Rematerialisation.** ``remat=True`` wraps each layer in ``jax.checkpoint`` with a
policy from ``REMAT_POLICIES``: ``None`` saves nothing but the layer's inputs (the whole
layer is recomputed in the backward pass); ``"dots"`` is
``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``: the projection and MLP
matmuls (no batch dims in their ``dot_general``) are saved, the attention matmuls
(batched over batch and heads) and every elementwise op are recomputed;
``"dots_with_context"`` saves the attention's output (named ``"context"``) too, as
MaxText's ``minimal_with_context``.

**Fused kernels.** ``fused_kernels=True`` differentiates RMSNorm and SwiGLU as
Transformer Engine's and Megatron-LM's fused kernels do (`examples._fused`): the same
values and gradients, but each keeps only its inputs (and the norm its per-row
statistic) for the backward pass, where written out JAX keeps the norm's float32 copies
and SwiGLU's activation too. NeMo's Llama configurations run with both.

**FP8.** ``fp8=True`` runs each layer's seven projections as Transformer Engine and
MaxText's ``quantization=fp8`` run them (`examples._fp8`): forward operands in E4M3, the
output's gradient in E5M2, the dots' results in ``dtype``; the attention's own matmuls,
the norms and the LM head stay in ``dtype``. ``fp8_scaling`` picks the recipe: delayed
scaling's scales (``"delayed"``, MaxText's) or each tensor's own maximum
(``"current"``, Transformer Engine's current scaling, Megatron-Bridge's FP8-CS).

**Expert schedules.** ``SCHEDULES`` maps a name to a function of the mesh axis names
returning a list of tactics for ``tactics.apply_schedule`` (see their docstrings).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from examples._common import (build_master_weights_train_step, build_train_step, dense_init, init_layers,
                              next_token_loss, normal, token_batch)
from examples._fp8 import SCALINGS, fp8_dot
from examples._fused import fused_rms_norm, fused_swiglu

_QKV = ("query_proj", "key_proj", "value_proj")
#: The named policies -> the values they save, by the names the layer gives them
#: (`jax.ad_checkpoint.checkpoint_name`, MaxText's names): MaxText's ``save_qkv_proj``,
#: ``save_dot_except_mlpwi`` and ``save_dot_except_mlp``, and torchtitan's selective op
#: checkpointing (every matmul but every second one of a block, in call order, and the
#: attention's output).
_NAMES = {
    "qkv": _QKV,
    "dots_except_mlp_in": (*_QKV, "out_proj", "mlpwo"),
    "dots_except_mlp": (*_QKV, "out_proj"),
    "every_other_dot": ("query_proj", "value_proj", "mlpwi_0", "mlpwo", "context"),
}
#: ``remat_policy`` name -> the ``jax.checkpoint`` policy it stands for.
REMAT_POLICIES = {
    None: None,  # jax.checkpoint's default: save only the layer's inputs
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # MaxText's ``minimal_with_context``: every projection and the attention's output.
    "dots_with_context": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("context")),
    **{name: jax.checkpoint_policies.save_only_these_names(*names) for name, names in _NAMES.items()},
}
#: The names a policy reads (`_named`: only those are given, other programs stay as
#: they were).
_READ = {**_NAMES, "dots_with_context": ("context",)}
#: ``loss`` name -> what it is (`next_token_loss`): how the cross-entropy picks each
#: target's log-probability.
LOSSES = {
    "gather": "take_along_axis (optax's form, PyTorch's cross_entropy)",
    "one_hot": "a sum against the one-hot targets (MaxText's cross_entropy_with_logits)",
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model sizes, numerics, layout switches and optimiser settings of the Llama example."""

    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 8
    n_kv_heads: int = 2  # fewer than n_heads: grouped-query attention
    d_ff: int = 128
    vocab: int = 256
    seq_len: int = 16
    batch: int = 8
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5
    dtype: Any = jnp.float32  # compute dtype of activations; parameters stay float32
    causal: bool = True  # False: every token attends to the whole sequence (an encoder)
    scan_layers: bool = False  # stack layer params on [L] and run lax.scan
    remat: bool = False  # wrap each layer in jax.checkpoint
    remat_policy: str | None = None  # a key of REMAT_POLICIES (only with remat=True)
    learning_rate: float = 1e-3
    adam_eps: float = 1e-8
    master_weights: bool = False  # parameters in `dtype`, float32 master copy in the optimizer state
    loss: str = "gather"  # how the cross-entropy picks the targets: a key of LOSSES
    fused_kernels: bool = False  # RMSNorm and SwiGLU keep only their inputs, as fused kernels do
    fp8: bool = False  # the layers' projections in FP8 (`examples._fp8`); activations stay `dtype`
    fp8_scaling: str = "delayed"  # the FP8 recipe: a key of `examples._fp8.SCALINGS` (only with fp8=True)

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"LlamaConfig: d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: n_heads={self.n_heads} must be a multiple of "
                             f"n_kv_heads={self.n_kv_heads} (each KV head serves a group of query heads)")
        if self.d_head % 2:
            raise ValueError(f"LlamaConfig: d_head={self.d_head} must be even for rotary embeddings")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"LlamaConfig: unknown remat_policy {self.remat_policy!r}; "
                             f"allowed: {list(REMAT_POLICIES)}")
        if self.loss not in LOSSES:
            raise ValueError(f"LlamaConfig: unknown loss {self.loss!r}; allowed: {list(LOSSES)}")
        if self.remat_policy is not None and not self.remat:
            raise ValueError(f"LlamaConfig: remat_policy={self.remat_policy!r} needs remat=True")
        if self.fp8_scaling not in SCALINGS:
            raise ValueError(f"LlamaConfig: unknown fp8_scaling {self.fp8_scaling!r}; allowed: {list(SCALINGS)}")
        if self.fp8_scaling != "delayed" and not self.fp8:
            raise ValueError(f"LlamaConfig: fp8_scaling={self.fp8_scaling!r} needs fp8=True")

    @property
    def d_head(self) -> int:
        """Per-head width ``d_model // n_heads``."""
        return self.d_model // self.n_heads


#: Llama-3 8B: 32 layers, 32 query heads, 8 KV heads, a 128256-token vocabulary, rotary
#: theta 500000 (the default), 4096-token sequences, a 64-sequence global batch; bfloat16
#: activations, layers scanned and wholly rematerialised (``remat_policy=None``), as runs at
#: this scale are set up. 8,030,261,248 parameters, as published. For ``abstract=True`` only.
LLAMA3_8B = LlamaConfig(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, vocab=128256,
                        seq_len=4096, batch=64, dtype=jnp.bfloat16, scan_layers=True, remat=True)

#: Llama-3 70B: 80 layers, 64 query heads, 8 KV heads, a 256-sequence global batch; set up
#: like ``LLAMA3_8B``. 70,553,706,496 parameters, as published. For ``abstract=True`` only.
LLAMA3_70B = LlamaConfig(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, d_ff=28672, vocab=128256,
                         seq_len=4096, batch=256, dtype=jnp.bfloat16, scan_layers=True, remat=True)


def init_layer(config: LlamaConfig, key: jax.Array) -> dict:
    """Parameters of one decoder layer (see module docstring)."""
    d, h, k, dh, f = config.d_model, config.n_heads, config.n_kv_heads, config.d_head, config.d_ff
    kq, kk, kv, ko, kg, ku, kd = jax.random.split(key, 7)
    return {
        "attn_norm": {"scale": jnp.ones((d,), jnp.float32)},
        "attn": {"wq": dense_init(kq, d, (d, h, dh)), "wk": dense_init(kk, d, (d, k, dh)),
                 "wv": dense_init(kv, d, (d, k, dh)), "wo": dense_init(ko, h * dh, (h, dh, d))},
        "mlp_norm": {"scale": jnp.ones((d,), jnp.float32)},
        "mlp": {"w_gate": dense_init(kg, d, (d, f)), "w_up": dense_init(ku, d, (d, f)),
                "w_down": dense_init(kd, f, (f, d))},
    }


def init_params(config: LlamaConfig, key: jax.Array) -> dict:
    """All parameters (float32); the per-layer values do not depend on ``scan_layers``."""
    ke, kl, kh = jax.random.split(key, 3)
    d = config.d_model
    return {
        "embed": {"tokens": normal(ke, (config.vocab, d))},
        "layers": init_layers(functools.partial(init_layer, config), kl, config.n_layers, config.scan_layers),
        "final_norm": {"scale": jnp.ones((d,), jnp.float32)},
        "head": {"w": dense_init(kh, d, (d, config.vocab))},
    }


def make_batch(config: LlamaConfig, key: jax.Array) -> dict:
    """Random token sequences; targets are the inputs shifted left by one."""
    return token_batch(key, config.batch, config.seq_len, config.vocab)


def rms_norm(p: dict, x: jax.Array, eps: float, fused: bool = False) -> jax.Array:
    """RMS normalisation over the last axis (statistics in float32), learned scale;
    ``fused``: as a fused kernel differentiates it (`examples._fused`)."""
    if fused:
        return fused_rms_norm(x, p["scale"], eps)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * p["scale"].astype(x.dtype)


def rotary_tables(config: LlamaConfig) -> tuple[jax.Array, jax.Array]:
    """``cos, sin [S, Dh/2]`` of the rotation angles ``position * theta^(-2i/Dh)``."""
    dh = config.d_head
    inv_freq = config.rope_theta ** (-jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
    angles = jnp.arange(config.seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles).astype(config.dtype), jnp.sin(angles).astype(config.dtype)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, S, heads, Dh]``: the first and second halves of the head dim are
    the two coordinates of each rotated pair (the split-halves form)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _unnamed(x: jax.Array, name: str) -> jax.Array:
    return x


def _named(read: tuple[str, ...], x: jax.Array, name: str) -> jax.Array:
    return checkpoint_name(x, name) if name in read else x


def attention(p: dict, x: jax.Array, rope: tuple[jax.Array, jax.Array], causal: bool = True,
              tag=_unnamed, dot=jnp.einsum) -> jax.Array:
    """Grouped-query self-attention on ``x [B, S, D]``, causal unless told otherwise;
    ``tag(value, name)`` names the projections' outputs (for a named remat policy);
    ``dot(spec, x, w)`` runs the projections (`examples._fp8.fp8_dot` for FP8)."""
    q = tag(dot("bsd,dhk->bshk", x, p["wq"]), "query_proj")
    k = tag(dot("bsd,dhk->bshk", x, p["wk"]), "key_proj")
    v = tag(dot("bsd,dhk->bshk", x, p["wv"]), "value_proj")
    q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
    # K/V keep their n_kv_heads heads: dot_product_attention groups the query heads.
    out = tag(jax.nn.dot_product_attention(q, k, v, is_causal=causal), "context")
    return tag(dot("bshk,hkd->bsd", out, p["wo"]), "out_proj")


def mlp(p: dict, x: jax.Array, tag=_unnamed, fused: bool = False, dot=jnp.einsum) -> jax.Array:
    """SwiGLU feed-forward block: ``(silu(x W_gate) * x W_up) W_down``; ``fused``: the
    gating as a fused kernel differentiates it (`examples._fused`); ``dot`` as for
    `attention`."""
    gate = tag(dot("bsd,df->bsf", x, p["w_gate"]), "mlpwi_0")
    if fused:
        hidden = fused_swiglu(gate, dot("bsd,df->bsf", x, p["w_up"]))
    else:  # the gate's activation before the up projection: the op order the program always had
        act = jax.nn.silu(gate)
        hidden = act * dot("bsd,df->bsf", x, p["w_up"])
    return tag(dot("bsf,fd->bsd", hidden, p["w_down"]), "mlpwo")


def block(p: dict, x: jax.Array, rope: tuple[jax.Array, jax.Array], config: LlamaConfig) -> jax.Array:
    """One pre-norm decoder layer; shared by the unrolled and scanned forms."""
    p = jax.tree.map(lambda w: w.astype(config.dtype), p)  # float32 master -> compute dtype
    # Names only those the policy reads: other programs stay as they were.
    read = _READ.get(config.remat_policy, ()) if config.remat else ()
    tag = functools.partial(_named, read) if read else _unnamed
    fused = config.fused_kernels
    dot = fp8_dot(config.fp8_scaling) if config.fp8 else jnp.einsum
    x = x + attention(p["attn"], rms_norm(p["attn_norm"], x, config.norm_eps, fused), rope, config.causal, tag,
                      dot)
    return x + mlp(p["mlp"], rms_norm(p["mlp_norm"], x, config.norm_eps, fused), tag, fused, dot)


def forward(params: dict, tokens: jax.Array, config: LlamaConfig) -> jax.Array:
    """Float32 logits ``[B, S, V]`` for ``tokens [B, S]``."""
    # Look the rows up in float32, then cast: casting the table would convert all V rows.
    x = params["embed"]["tokens"][tokens].astype(config.dtype)
    rope = rotary_tables(config)
    layer = functools.partial(block, config=config)
    if config.remat:
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[config.remat_policy])
    if config.scan_layers:
        x, _ = jax.lax.scan(lambda h, p: (layer(p, h, rope), None), x, params["layers"])
    else:
        for p in params["layers"]:
            x = layer(p, x, rope)
    x = rms_norm(params["final_norm"], x, config.norm_eps, config.fused_kernels)
    return (x @ params["head"]["w"].astype(config.dtype)).astype(jnp.float32)


def loss_fn(params: dict, batch: dict, config: LlamaConfig) -> jax.Array:
    """Mean next-token cross-entropy, computed in float32."""
    return next_token_loss(forward(params, batch["tokens"], config), batch["targets"], one_hot=config.loss == "one_hot")


def init(config: LlamaConfig, key: jax.Array) -> tuple[dict, dict]:
    """Deterministic ``(params, batch)`` from ``key``."""
    kp, kb = jax.random.split(key)
    return init_params(config, kp), make_batch(config, kb)


def make_train_step(config: LlamaConfig | None = None, *, abstract: bool = False, seed: int = 0):
    """Return ``(step, (params, opt_state, batch))`` for the Llama (see package docs);
    with ``config.master_weights``, Megatron's mixed precision (module docstring)."""
    config = config or LlamaConfig()
    if config.master_weights:
        return build_master_weights_train_step(loss_fn, init, config, config.dtype, abstract=abstract, seed=seed)
    return build_train_step(loss_fn, init, config, abstract=abstract, seed=seed)


def factory():
    """``make_train_step()`` with the default config."""
    return make_train_step()


def param_count(config: LlamaConfig) -> int:
    """The number of parameters ``config`` implies (embedding, layers, final norm, head)."""
    d, f, v = config.d_model, config.d_ff, config.vocab
    attn = d * config.d_head * (2 * config.n_heads + 2 * config.n_kv_heads)
    layer = attn + 3 * d * f + 2 * d
    return 2 * v * d + config.n_layers * layer + d


# -- expert schedules ----------------------------------------------------------------------
# `tactics` is imported where a schedule is built, so that importing the examples stays
# cheap and free of the partitioner.


def dp_tp_sp_zero3(data: str = "data", model: str = "model") -> list:
    """Megatron-LM's recipe, for a ``data=8, model=8`` mesh: the batch split over
    ``data``; tensor parallelism over ``model`` (column- then row-parallel MLP and
    attention, vocab-parallel embedding and LM head) with sequence parallelism between
    the blocks; ZeRO-3 over ``data`` (parameters, gradients and adam state sharded on
    the dims tensor parallelism leaves free)."""
    import tactics

    return [tactics.DataParallel(data), tactics.Megatron(model), tactics.SequenceParallel(model),
            tactics.ZeRO(data, stage=3)]


def fsdp_tp(fsdp: str = "fsdp", model: str = "model", data: str | None = "data") -> list:
    """MaxText's recipe, for a ``data=2, fsdp=4, model=8`` or ``data=16, fsdp=8,
    model=8`` mesh: the batch split over ``data`` (whole replicas: the slow, cross-slice
    axis) and ``fsdp``; parameters fully sharded over ``fsdp`` (all-gathered per layer,
    gradients reduce-scattered); tensor parallelism over ``model``, placed first so that
    the FSDP shards take the dims it leaves. ``data=None`` when the mesh has no replica
    axis. The batch must divide by ``data * fsdp``: 128 on the larger mesh, which
    ``LLAMA3_70B``'s 256 sequences do and ``LLAMA3_8B``'s 64 do not."""
    import tactics

    replicas = [tactics.DataParallel(data)] if data is not None else []
    return replicas + [tactics.Megatron(model), tactics.FSDP(fsdp)]


def fsdp(*axes: str) -> list:
    """Pure FSDP (ZeRO-3) over every axis given (default ``("data",)``): the batch split
    over all of them and every parameter sharded over each, on a dim of its own when one
    divides; no tensor parallelism, so nothing is left to it."""
    import tactics

    return [tactics.FSDP(a, leave_room=False) for a in axes or ("data",)]


#: Schedule name -> function of the mesh axis names returning a list of tactics for
#: ``tactics.apply_schedule``, e.g. ``SCHEDULES["fsdp+tp"](fsdp="fsdp", model="model")``.
SCHEDULES = {
    "dp+tp+sp+zero3": dp_tp_sp_zero3,
    "fsdp+tp": fsdp_tp,
    "fsdp": fsdp,
}
