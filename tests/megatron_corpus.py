"""A corpus of transformer language models in the layouts JAX model code uses, for the
Megatron tactic (`tests/test_megatron_corpus.py`): flax linen, flax nnx and equinox
attention modules as they ship, and hand-written `jnp` variants of every attention and
MLP layout.

A builder returns `(forward(params, batch) -> logits, params, batch)` of a tiny model
(batch 4, sequence 8, width 32, 4 heads, vocab 64) with concrete parameters filled from
numpy (no XLA compile to initialise); `train_step` makes it a value_and_grad +
optax.adam step.
"""

from __future__ import annotations

import math

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

B, T, E, H, D, F, V = 4, 8, 32, 4, 8, 64, 64


# -- plumbing -----------------------------------------------------------------------------
def _fill(tree, seed: int = 0):
    """Concrete values for an abstract pytree: N(0, 0.2^2) floats, from numpy."""
    rng = np.random.default_rng(seed)

    def leaf(x):
        return jnp.asarray((0.2 * rng.standard_normal(x.shape)).astype(x.dtype))

    return jax.tree.map(leaf, tree)


def _batch(seed: int = 1, **extra):
    rng = np.random.default_rng(seed)
    out = {"tokens": rng.integers(0, V, (B, T), dtype=np.int32), "targets": rng.integers(0, V, (B, T), dtype=np.int32)}
    out.update({k: rng.integers(0, V, (B, T), dtype=np.int32) for k in extra})
    return {k: jnp.asarray(v) for k, v in out.items()}


def train_step(forward, params, batch, *, rename: bool = False):
    """`(step, (params, opt_state, batch))`: cross-entropy of `forward(params, batch)`
    against `batch['targets']`, one adam update (eps 1e-3: near-zero gradients cannot
    flip updates between the plan and the reference). With `rename`, the parameters
    (and so the optimizer state) get meaningless keys `k000, k001, ...` in the same leaf
    order: a split found from the dataflow must not change."""
    opt = optax.adam(1e-3, eps=1e-3)
    tree = None
    if rename:
        leaves, tree = jax.tree_util.tree_flatten(params)
        params = {f"k{i:03d}": x for i, x in enumerate(leaves)}

    def step(params, opt_state, batch):
        def loss(p):
            if tree is not None:
                p = jax.tree_util.tree_unflatten(tree, [p[k] for k in sorted(p)])
            logits = forward(p, batch)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, (params, opt.init(params), batch)


def causal(t: int = T):
    """`[t, t]` lower-triangular boolean mask."""
    return jnp.tril(jnp.ones((t, t), jnp.bool_))


def attend(q, k, v, mask=None):
    """Softmax attention on `[b, t, h, d]` heads (keys may have fewer heads: grouped)."""
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)


def layer_norm(p, x, eps=1e-5):
    """LayerNorm with `scale` and `bias` over the last dim."""
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]


def rms_norm(scale, x, eps=1e-6):
    """RMSNorm with a learned scale over the last dim."""
    return x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps) * scale


def rotary(x, base=10000.0):
    """Rotary position embedding of `[b, t, h, d]` on interleaved pairs (emits stack)."""
    t, d = x.shape[1], x.shape[-1]
    freq = base ** (-jnp.arange(0, d, 2) / d)
    angle = jnp.arange(t)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)



def S(*shape):
    """An abstract float32 parameter of `shape` (filled by `_fill`)."""
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _norm():
    return {"scale": S(E), "bias": S(E)}


# -- flax linen ---------------------------------------------------------------------------
class LinenBlock(nn.Module):
    """Pre-LN block: `linen.MultiHeadDotProductAttention` (causal self-attention, and
    cross-attention to `memory` when given, non-causal when `causal` is False) and a
    `linen.Dense` GELU MLP."""

    causal: bool = True

    @nn.compact
    def __call__(self, x, memory=None):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2])) if self.causal else None
        h = nn.LayerNorm(name="ln1")(x)
        x = x + nn.MultiHeadDotProductAttention(H, qkv_features=E, name="attn")(h, mask=mask)
        if memory is not None:
            h = nn.LayerNorm(name="ln_cross")(x)
            x = x + nn.MultiHeadDotProductAttention(H, qkv_features=E, name="cross")(h, memory)
        h = nn.LayerNorm(name="ln2")(x)
        return x + nn.Dense(E, name="down")(nn.gelu(nn.Dense(F, name="up")(h)))


class LinenLM(nn.Module):
    """`linen.Embed`, two `LinenBlock`s, a final LayerNorm and an untied `linen.Dense` head."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(V, E, name="embed")(tokens)
        for i in range(2):
            x = LinenBlock(name=f"block{i}")(x)
        return nn.Dense(V, name="head")(nn.LayerNorm(name="ln_f")(x))


class LinenEncoderDecoder(nn.Module):
    """A non-causal encoder block over `batch['source']` and a decoder block with causal
    self-attention and cross-attention to the encoder's output."""

    @nn.compact
    def __call__(self, source, tokens):
        embed = nn.Embed(V, E, name="embed")
        memory = nn.LayerNorm(name="ln_enc")(LinenBlock(causal=False, name="encoder")(embed(source)))
        x = LinenBlock(name="decoder")(embed(tokens), memory)
        return nn.Dense(V, name="head")(nn.LayerNorm(name="ln_f")(x))


class DenseGeneralBlock(nn.Module):
    """Hand-written attention over `linen.DenseGeneral` Q/K/V `[embed, heads, head_dim]`
    and output `[heads, head_dim, embed]` kernels, RMSNorm, a GeGLU MLP."""

    @nn.compact
    def __call__(self, x):
        h = nn.RMSNorm(name="norm1")(x)
        q, k, v = (nn.DenseGeneral((H, D), use_bias=False, name=n)(h) for n in ("q", "k", "v"))
        x = x + nn.DenseGeneral(E, axis=(-2, -1), use_bias=False, name="o")(attend(q, k, v, causal()))
        h = nn.RMSNorm(name="norm2")(x)
        gate = nn.gelu(nn.Dense(F, use_bias=False, name="gate")(h))
        return x + nn.Dense(E, use_bias=False, name="down")(gate * nn.Dense(F, use_bias=False, name="up")(h))


class DenseGeneralLM(nn.Module):
    """`linen.Embed`, one `DenseGeneralBlock`, an untied head."""

    @nn.compact
    def __call__(self, tokens):
        x = DenseGeneralBlock(name="block")(nn.Embed(V, E, name="embed")(tokens))
        return nn.Dense(V, use_bias=False, name="head")(nn.RMSNorm(name="norm_f")(x))


def linen(module, *inputs):
    """Builder of a linen module's model over `inputs` (batch keys); its parameters are
    the `params` collection."""

    def build():
        batch = _batch(source=True) if len(inputs) > 1 else _batch()
        abstract = jax.eval_shape(lambda: module.init(jax.random.key(0), *(batch[k] for k in inputs)))["params"]
        return (lambda p, b: module.apply({"params": p}, *(b[k] for k in inputs))), _fill(abstract), batch

    return build


# -- flax nnx -----------------------------------------------------------------------------
class NnxBlock(nnx.Module):
    """Pre-LN block: `nnx.MultiHeadAttention` (causal) and an `nnx.Linear` ReLU MLP."""

    def __init__(self, rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(E, rngs=rngs), nnx.LayerNorm(E, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=E, qkv_features=E, decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(E, F, rngs=rngs), nnx.Linear(F, E, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x), mask=causal()[None, None])
        return x + self.down(nnx.relu(self.up(self.ln2(x))))


class NnxLM(nnx.Module):
    """`nnx.Embed`, two `NnxBlock`s, an untied `nnx.Linear` head."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(V, E, rngs=rngs)
        self.block0, self.block1 = NnxBlock(rngs), NnxBlock(rngs)
        self.ln_f, self.head = nnx.LayerNorm(E, rngs=rngs), nnx.Linear(E, V, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.ln_f(self.block1(self.block0(self.embed(tokens)))))


class NnxEinsumLM(nnx.Module):
    """`nnx.Einsum` Q/K/V `[embed, heads, head_dim]`, an `nnx.LinearGeneral` output
    projection `[heads, head_dim, embed]`, an `nnx.LinearGeneral` SwiGLU MLP, RMSNorm,
    and the embedding table reused, transposed, as the LM head (`nnx.Embed.attend`)."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(V, E, rngs=rngs)
        self.norm1, self.norm2, self.norm_f = (nnx.RMSNorm(E, rngs=rngs) for _ in range(3))
        self.q, self.k, self.v = (nnx.Einsum("bte,ehd->bthd", (E, H, D), rngs=rngs) for _ in range(3))
        self.o = nnx.LinearGeneral((H, D), E, axis=(-2, -1), use_bias=False, rngs=rngs)
        self.gate, self.up = (nnx.LinearGeneral(E, F, use_bias=False, rngs=rngs) for _ in range(2))
        self.down = nnx.LinearGeneral(F, E, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        h = self.norm1(x)
        x = x + self.o(attend(self.q(h), self.k(h), self.v(h), causal()))
        h = self.norm2(x)
        x = x + self.down(nnx.silu(self.gate(h)) * self.up(h))
        return self.embed.attend(self.norm_f(x))


def nnx_model(cls):
    """Builder of an nnx module's model; its parameters are the module's state."""

    def build():
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: cls(nnx.Rngs(0))))
        return (lambda p, b: nnx.merge(graphdef, p)(b["tokens"])), _fill(abstract), _batch()

    return build


# -- equinox ------------------------------------------------------------------------------
class EqxBlock(eqx.Module):
    """Pre-LN block on one sequence: `eqx.nn.MultiheadAttention` (causal) and an
    `eqx.nn.Linear` GELU MLP (Linear weights are `[out, in]`)."""

    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        ka, ku, kd = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(E), eqx.nn.LayerNorm(E)
        self.attn = eqx.nn.MultiheadAttention(H, E, key=ka)
        self.up, self.down = eqx.nn.Linear(E, F, key=ku), eqx.nn.Linear(F, E, key=kd)

    def __call__(self, x):
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h, mask=causal())
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(lambda t: self.down(jax.nn.gelu(self.up(t))))(h)


class EqxLM(eqx.Module):
    """`eqx.nn.Embedding`, two `EqxBlock`s, a LayerNorm and an untied `eqx.nn.Linear` head."""

    embed: eqx.nn.Embedding
    blocks: list
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        ke, k0, k1, kh = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(V, E, key=ke)
        self.blocks = [EqxBlock(k0), EqxBlock(k1)]
        self.ln_f, self.head = eqx.nn.LayerNorm(E), eqx.nn.Linear(E, V, key=kh)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        for block in self.blocks:
            x = block(x)
        return jax.vmap(lambda t: self.head(self.ln_f(t)))(x)


def equinox_lm():
    """`EqxLM` over a batch (`vmap`); its parameters are the module's arrays."""
    abstract = eqx.filter_eval_shape(EqxLM, jax.random.key(0))
    params, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return (lambda p, b: jax.vmap(eqx.combine(p, static))(b["tokens"])), _fill(params), _batch()


# -- hand-written jnp layouts -------------------------------------------------------------
def _heads(x, n=H):
    return x.reshape(*x.shape[:-1], n, x.shape[-1] // n)


def _mlp(l, x):
    return jax.nn.gelu(x @ l["w1"] + l["b1"]) @ l["w2"] + l["b2"]


def _mlp_params():
    return {"w1": S(E, F), "b1": S(F), "w2": S(F, E), "b2": S(E)}


def bert():
    """2-D Q/K/V `[embed, embed]` with biases, reshaped into heads after the matmul
    (BERT, GPT-2); a non-causal post-LN encoder."""
    layer = {"wq": S(E, E), "bq": S(E), "wk": S(E, E), "bk": S(E), "wv": S(E, E), "bv": S(E),
             "wo": S(E, E), "bo": S(E), "ln1": _norm(), "ln2": _norm(), **_mlp_params()}
    params = {"embed": S(V, E), "pos": S(T, E), "layers": [layer, layer], "head": S(E, V), "head_b": S(V)}

    def forward(p, batch):
        x = p["embed"][batch["tokens"]] + p["pos"]
        for l in p["layers"]:
            q, k, v = (_heads(x @ l[w] + l[b]) for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
            a = attend(q, k, v).reshape(x.shape) @ l["wo"] + l["bo"]
            x = layer_norm(l["ln1"], x + a)
            x = layer_norm(l["ln2"], x + _mlp(l, x))
        return x @ p["head"] + p["head_b"]

    return forward, _fill(params), _batch()


def fused_qkv(cut: str):
    """One `[embed, 3 * embed]` projection of `[q; k; v]` (and bias), cut after the
    matmul with `jnp.split` (nanoGPT, GPT-2's `c_attn`) or, `cut='slices'`, by slicing."""
    layer = {"ln1": _norm(), "qkv": S(E, 3 * E), "bqkv": S(3 * E), "wo": S(E, E), "ln2": _norm(), **_mlp_params()}
    params = {"embed": S(V, E), "layers": [layer, layer], "ln_f": _norm(), "head": S(E, V)}

    def forward(p, batch):
        x = p["embed"][batch["tokens"]]
        for l in p["layers"]:
            h = layer_norm(l["ln1"], x)
            y = h @ l["qkv"] + l["bqkv"]
            parts = jnp.split(y, 3, axis=-1) if cut == "split" else (y[..., :E], y[..., E:2 * E], y[..., 2 * E:])
            q, k, v = (_heads(t) for t in parts)
            x = x + attend(q, k, v, causal()).reshape(x.shape) @ l["wo"]
            x = x + _mlp(l, layer_norm(l["ln2"], x))
        return layer_norm(p["ln_f"], x) @ p["head"]

    return lambda: (forward, _fill(params), _batch())


def fused_view(stored: str, cut: str):
    """One fused `[q; k; v]` kernel, `[3 embed, embed]` used as `x @ w.T` (`stored`
    'out_in') or `[embed, 3 embed]` used as `x @ w` ('in_out'), its result viewed as
    `[batch, seq, 3, heads, head_dim]` before the cut (timm's `reshape` + `unbind`):
    `cut` 'unstack' (`jnp.unstack`) or 'moveaxis' (the 3 moved first, then unpacked)."""
    layer = {"ln1": _norm(), "qkv": S(3 * E, E) if stored == "out_in" else S(E, 3 * E), "wo": S(E, E), "ln2": _norm(),
             **_mlp_params()}
    params = {"embed": S(V, E), "layers": [layer], "ln_f": _norm(), "head": S(E, V)}

    def forward(p, batch):
        x = p["embed"][batch["tokens"]]
        for l in p["layers"]:
            h = layer_norm(l["ln1"], x)
            y = (h @ l["qkv"].T if stored == "out_in" else h @ l["qkv"]).reshape(B, T, 3, H, D)
            q, k, v = jnp.unstack(y, axis=2) if cut == "unstack" else jnp.moveaxis(y, 2, 0)
            x = x + attend(q, k, v, causal()).reshape(x.shape) @ l["wo"]
            x = x + _mlp(l, layer_norm(l["ln2"], x))
        return layer_norm(p["ln_f"], x) @ p["head"]

    return lambda: (forward, _fill(params), _batch())


def multi_query(q_kernel: str):
    """Multi-query attention as t5x and PaLM write it: 3-D query kernel `[heads, embed,
    head_dim]` (`q_kernel` 'hed') or `[embed, heads, head_dim]` ('ehd'), one key/value
    head `[embed, head_dim]` that every query head reads through einsum (no repeat),
    output kernel `[heads, head_dim, embed]`."""
    layer = {"norm1": S(E), "q": S(H, E, D) if q_kernel == "hed" else S(E, H, D), "k": S(E, D), "v": S(E, D),
             "o": S(H, D, E), "norm2": S(E), "gate": S(E, F), "up": S(E, F), "down": S(F, E)}
    params = {"embed": S(V, E), "layers": [layer], "norm_f": S(E), "head": S(E, V)}

    def forward(p, batch):
        x = p["embed"][batch["tokens"]]
        for l in p["layers"]:
            h = rms_norm(l["norm1"], x)
            q = jnp.einsum(f"bte,{q_kernel}->bthd", h, l["q"])
            k, v = h @ l["k"], h @ l["v"]
            s = jnp.where(causal(), jnp.einsum("bthd,bsd->bhts", q, k) / math.sqrt(D), jnp.finfo(q.dtype).min)
            x = x + jnp.einsum("bthd,hde->bte", jnp.einsum("bhts,bsd->bthd", jax.nn.softmax(s, -1), v), l["o"])
            h = rms_norm(l["norm2"], x)
            x = x + (jax.nn.silu(h @ l["gate"]) * (h @ l["up"])) @ l["down"]
        return rms_norm(p["norm_f"], x) @ p["head"]

    return lambda: (forward, _fill(params), _batch())


def padded_encoder():
    """A BERT encoder as HF Flax writes it: learned position embeddings looked up at
    `arange(seq)`, an embedding LayerNorm, Dense Q/K/V/output `{kernel, bias}`, an
    additive `[batch, 1, 1, seq]` padding mask (token 0 pads; the even rows end in two),
    dropout on the attention weights and on each sublayer's output, post-LN."""
    dense = {"kernel": S(E, E), "bias": S(E)}
    layer = {"q": dense, "k": dense, "v": dense, "o": dense, "ln1": _norm(), "ln2": _norm(), **_mlp_params()}
    params = {"embed": S(V, E), "pos": S(T, E), "ln_e": _norm(), "layers": [layer], "head": S(E, V)}
    batch = _batch()
    batch["tokens"] = batch["tokens"].at[::2, -2:].set(0)

    def drop(x, key, rate=0.1):
        return jnp.where(jax.random.bernoulli(key, 1 - rate, x.shape), x / (1 - rate), 0)

    def forward(p, batch):
        tokens, key = batch["tokens"], jax.random.key(0)
        x = p["embed"][tokens] + p["pos"][jnp.broadcast_to(jnp.arange(T), tokens.shape)]
        x = layer_norm(p["ln_e"], x)
        mask = jnp.where(tokens != 0, 0.0, jnp.finfo(x.dtype).min)[:, None, None, :]
        for i, l in enumerate(p["layers"]):
            q, k, v = (_heads(x @ l[n]["kernel"] + l[n]["bias"]).transpose(0, 2, 1, 3) for n in "qkv")
            a = drop(jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / math.sqrt(D) + mask, -1), jax.random.fold_in(key, i))
            o = (a @ v).transpose(0, 2, 1, 3).reshape(x.shape) @ l["o"]["kernel"] + l["o"]["bias"]
            x = layer_norm(l["ln1"], x + drop(o, jax.random.fold_in(key, 100 + i)))
            x = layer_norm(l["ln2"], x + drop(_mlp(l, x), jax.random.fold_in(key, 200 + i)))
        return x @ p["head"]

    return forward, _fill(params), batch


def grouped(kv_heads: int, q_heads: int, style: str):
    """Grouped-query attention with 3-D kernels: `q_heads` query heads share `kv_heads`
    key/value heads (head_dim 4); `style` 'group' reshapes the queries to `[kv, group]`,
    'repeat' repeats the keys and values (`jnp.repeat`); one KV head is multi-query
    attention, written with 2-D `[embed, head_dim]` key/value kernels."""
    d, g = E // q_heads, q_heads // kv_heads
    kv = S(E, d) if kv_heads == 1 else S(E, kv_heads, d)
    layer = {"norm1": S(E), "q": S(E, q_heads, d), "k": kv, "v": kv, "o": S(q_heads, d, E), "norm2": S(E),
             "gate": S(E, F), "up": S(E, F), "down": S(F, E)}
    params = {"embed": S(V, E), "layers": [layer], "norm_f": S(E), "head": S(E, V)}
    spec = "bte,ed->btd" if kv_heads == 1 else "bte,ehd->bthd"

    def forward(p, batch):
        x = p["embed"][batch["tokens"]]
        for l in p["layers"]:
            h = rms_norm(l["norm1"], x)
            q = jnp.einsum("bte,ehd->bthd", h, l["q"])
            k, v = (jnp.einsum(spec, h, l[n]) for n in ("k", "v"))
            if kv_heads == 1:
                k, v = k[:, :, None], v[:, :, None]
            if style == "repeat":
                o = attend(q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2), causal())
            else:
                qg = q.reshape(*q.shape[:2], kv_heads, g, d)
                s = jnp.einsum("btkgd,bskd->bkgts", qg, k) / math.sqrt(d)
                s = jnp.where(causal(), s, jnp.finfo(s.dtype).min)
                o = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, -1), v).reshape(q.shape)
            x = x + jnp.einsum("bthd,hde->bte", o, l["o"])
            h = rms_norm(l["norm2"], x)
            x = x + (jax.nn.silu(h @ l["gate"]) * (h @ l["up"])) @ l["down"]
        return rms_norm(p["norm_f"], x) @ p["head"]

    return lambda: (forward, _fill(params), _batch())


def torch_layout():
    """Kernels stored `[out, in]` (as PyTorch and some JAX ports keep them) used as
    `x @ w.T`, and einsum-written attention whose kernels name their dims in other
    orders: Q `[heads, embed, head_dim]`, K `[embed, head_dim, heads]`, output
    `[embed, heads, head_dim]`."""
    layer = {"ln1": _norm(), "wq": S(H, E, D), "wk": S(E, D, H), "wv": S(E, E), "wo": S(E, H, D), "ln2": _norm(),
             "w1": S(F, E), "b1": S(F), "w2": S(E, F), "b2": S(E)}
    params = {"embed": S(V, E), "layers": [layer], "ln_f": _norm(), "head": S(V, E)}

    def forward(p, batch):
        x = p["embed"][batch["tokens"]]
        for l in p["layers"]:
            h = layer_norm(l["ln1"], x)
            q = jnp.einsum("bte,hed->bhtd", h, l["wq"])
            k = jnp.einsum("bte,edh->bhtd", h, l["wk"])
            v = _heads(h @ l["wv"].T).transpose(0, 2, 1, 3)
            s = jnp.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(D)
            s = jnp.where(causal(), s, jnp.finfo(s.dtype).min)
            o = jnp.einsum("bhts,bhsd->bhtd", jax.nn.softmax(s, -1), v)
            x = x + jnp.einsum("bhtd,ehd->bte", o, l["wo"])
            h = layer_norm(l["ln2"], x)
            x = x + jax.nn.gelu(h @ l["w1"].T + l["b1"]) @ l["w2"].T + l["b2"]
        return layer_norm(p["ln_f"], x) @ p["head"].T

    return forward, _fill(params), _batch()


def llama_scan():
    """Layers stacked on a leading `[L]` dim under `lax.scan`: RMSNorm, rotary
    embeddings on `[embed, heads, head_dim]` Q/K, SwiGLU, tied input/output embeddings."""
    layers = {"norm1": S(2, E), "q": S(2, E, H, D), "k": S(2, E, H, D), "v": S(2, E, H, D), "o": S(2, H, D, E),
              "norm2": S(2, E), "gate": S(2, E, F), "up": S(2, E, F), "down": S(2, F, E)}
    params = {"embed": S(V, E), "layers": layers, "norm_f": S(E)}

    def layer(x, l):
        h = rms_norm(l["norm1"], x)
        q, k, v = (jnp.einsum("bte,ehd->bthd", h, l[n]) for n in ("q", "k", "v"))
        x = x + jnp.einsum("bthd,hde->bte", attend(rotary(q), rotary(k), v, causal()), l["o"])
        h = rms_norm(l["norm2"], x)
        return x + (jax.nn.silu(h @ l["gate"]) * (h @ l["up"])) @ l["down"], None

    def forward(p, batch):
        x, _ = jax.lax.scan(layer, p["embed"][batch["tokens"]], p["layers"])
        return rms_norm(p["norm_f"], x) @ p["embed"].T

    return forward, _fill(params), _batch()
