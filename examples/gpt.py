"""A GPT-style decoder-only transformer in plain ``jax.numpy``.

Parameters (D = d_model, F = d_ff, V = vocab, S = seq_len, L = n_layers)::

    embed:  tokens [V, D], positions [S, D]
    layers[i]:  ln1 {scale [D], bias [D]}
                attn {wq, wk, wv, wo: [D, D]}   (fused_qkv: {wqkv [D, 3D] head-major, wo [D, D]})
                ln2 {scale [D], bias [D]}
                mlp {w1 [D, F], b1 [F], w2 [F, D], b2 [D]}
    ln_f:   {scale [D], bias [D]}
    head:   {w [D, V]}                          (untied from the embedding)

With ``scan_layers=True``, ``layers`` is a single dict of the same keys whose leaves
are stacked on a leading [L] axis, and the layers run under ``jax.lax.scan``.
Batch: ``{'tokens': i32[B, S], 'targets': i32[B, S]}``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from examples._common import build_train_step, dense_init, init_layers, next_token_loss, normal, token_batch

#: ``remat_policy`` name -> the ``jax.checkpoint`` policy it stands for.
REMAT_POLICIES = {
    None: None,  # jax.checkpoint's default: save only the layer's inputs
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model sizes, layout switches and optimiser settings of the GPT example."""

    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 8
    d_ff: int = 256
    vocab: int = 256
    seq_len: int = 16
    batch: int = 8
    scan_layers: bool = False  # stack layer params on [L] and run lax.scan
    remat: bool = False  # wrap each layer in jax.checkpoint
    remat_policy: str | None = None  # a key of REMAT_POLICIES (only with remat=True)
    fused_qkv: bool = False  # one [D, 3D] projection instead of wq/wk/wv
    causal: bool = True  # False: every token attends to the whole sequence (an encoder)
    learning_rate: float = 1e-3
    adam_eps: float = 1e-8

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be divisible by n_heads")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"GPTConfig: unknown remat_policy {self.remat_policy!r}; allowed: {list(REMAT_POLICIES)}")
        if self.remat_policy is not None and not self.remat:
            raise ValueError(f"GPTConfig: remat_policy={self.remat_policy!r} needs remat=True")

    @property
    def d_head(self) -> int:
        """Per-head width ``d_model // n_heads``."""
        return self.d_model // self.n_heads


def _layer_norm_params(d: int) -> dict:
    return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}


def init_layer(config: GPTConfig, key: jax.Array) -> dict:
    """Parameters of one transformer block (see module docstring)."""
    d, f = config.d_model, config.d_ff
    kq, kk, kv, ko, k1, k2 = jax.random.split(key, 6)
    if config.fused_qkv:
        # Same values as the split form, so fused and unfused models agree, with the
        # columns grouped by head as Megatron-LM lays them out: [H, (q, k, v), Dh].
        h, dh = config.n_heads, config.d_head
        parts = [dense_init(k, d, (d, d)).reshape(d, h, 1, dh) for k in (kq, kk, kv)]
        attn = {"wqkv": jnp.concatenate(parts, axis=2).reshape(d, 3 * d)}
    else:
        attn = {"wq": dense_init(kq, d, (d, d)), "wk": dense_init(kk, d, (d, d)),
                "wv": dense_init(kv, d, (d, d))}
    attn["wo"] = dense_init(ko, d, (d, d))
    return {
        "ln1": _layer_norm_params(d),
        "attn": attn,
        "ln2": _layer_norm_params(d),
        "mlp": {"w1": dense_init(k1, d, (d, f)), "b1": jnp.zeros((f,), jnp.float32),
                "w2": dense_init(k2, f, (f, d)), "b2": jnp.zeros((d,), jnp.float32)},
    }


def init_params(config: GPTConfig, key: jax.Array) -> dict:
    """All parameters; the per-layer values do not depend on ``scan_layers``."""
    kt, kp, kl, kh = jax.random.split(key, 4)
    layers = init_layers(functools.partial(init_layer, config), kl, config.n_layers, config.scan_layers)
    d = config.d_model
    return {
        "embed": {
            # Unit-scale token embeddings keep the residual stream O(1).
            "tokens": normal(kt, (config.vocab, d)),
            "positions": 0.1 * normal(kp, (config.seq_len, d)),
        },
        "layers": layers,
        "ln_f": _layer_norm_params(d),
        "head": {"w": dense_init(kh, d, (d, config.vocab))},
    }


def make_batch(config: GPTConfig, key: jax.Array) -> dict:
    """Random token sequences; targets are the inputs shifted left by one."""
    return token_batch(key, config.batch, config.seq_len, config.vocab)


def layer_norm(p: dict, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    """Layer normalisation over the last axis with learned scale and bias."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def attention(p: dict, x: jax.Array, config: GPTConfig) -> jax.Array:
    """Multi-head self-attention on ``x [B, S, D]``, causal unless `config.causal` is False."""
    b, s, d = x.shape
    h, dh = config.n_heads, config.d_head
    if config.fused_qkv:
        # Head-major columns: splitting them into contiguous blocks keeps whole heads.
        q, k, v = jnp.split((x @ p["wqkv"]).reshape(b, s, h, 3 * dh), 3, axis=-1)
    else:
        q, k, v = ((x @ w).reshape(b, s, h, dh) for w in (p["wq"], p["wk"], p["wv"]))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
    if config.causal:
        mask = jnp.tril(jnp.ones((s, s), jnp.bool_))
        # A finite fill keeps softmax free of NaNs and its gradient exact zeros.
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, s, d)
    return out @ p["wo"]


def mlp(p: dict, x: jax.Array) -> jax.Array:
    """Position-wise feed-forward block with a tanh-approximated gelu."""
    return jax.nn.gelu(x @ p["w1"] + p["b1"], approximate=True) @ p["w2"] + p["b2"]


def block(p: dict, x: jax.Array, config: GPTConfig) -> jax.Array:
    """One pre-LayerNorm transformer block; shared by the unrolled and scanned forms."""
    x = x + attention(p["attn"], layer_norm(p["ln1"], x), config)
    return x + mlp(p["mlp"], layer_norm(p["ln2"], x))


def forward(params: dict, tokens: jax.Array, config: GPTConfig) -> jax.Array:
    """Logits ``[B, S, V]`` for ``tokens [B, S]``."""
    # Indexing the table lowers to a gather (its gradient to a scatter-add).
    x = params["embed"]["tokens"][tokens] + params["embed"]["positions"]
    layer = functools.partial(block, config=config)
    if config.remat:
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[config.remat_policy])
    if config.scan_layers:
        x, _ = jax.lax.scan(lambda h, p: (layer(p, h), None), x, params["layers"])
    else:
        for p in params["layers"]:
            x = layer(p, x)
    return layer_norm(params["ln_f"], x) @ params["head"]["w"]


def loss_fn(params: dict, batch: dict, config: GPTConfig) -> jax.Array:
    """Mean next-token cross-entropy."""
    return next_token_loss(forward(params, batch["tokens"], config), batch["targets"])


def init(config: GPTConfig, key: jax.Array) -> tuple[dict, dict]:
    """Deterministic ``(params, batch)`` from ``key``."""
    kp, kb = jax.random.split(key)
    return init_params(config, kp), make_batch(config, kb)


def make_train_step(config: GPTConfig | None = None, *, abstract: bool = False, seed: int = 0):
    """Return ``(step, (params, opt_state, batch))`` for the GPT (see package docs)."""
    return build_train_step(loss_fn, init, config or GPTConfig(), abstract=abstract, seed=seed)


def factory():
    """``make_train_step()`` with the default config."""
    return make_train_step()
