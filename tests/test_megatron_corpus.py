"""The Megatron tactic on the layouts real JAX model code uses (`megatron_corpus`): flax
linen and nnx and equinox attention modules as they ship, and hand-written variants of
every layout. For each model: the split on a 2x4 mesh is the expected one, also under
renamed parameters; the parameters left whole are reported with a reason; and,
compiled, the plan computes what plain `jax.jit` computes with the blocks' collectives
over `model`."""

import dataclasses
import math
from collections import Counter
from typing import Callable

import jax
import numpy as np
import pytest

import megatron_corpus as C
import partir
import tactics as T
from partir import MeshSpec

MESH = MeshSpec.of(data=2, model=4)
SCHEDULE = [T.DataParallel("data"), T.Megatron("model")]
#: Elements of one activation [batch, sequence, embed] on one device (batch split over data).
ACTIVATION = C.B // 2 * C.T * C.E


@dataclasses.dataclass(frozen=True)
class Case:
    """One model of the corpus: how to build its train step, what it exercises, the split
    expected (`split`: parameter glob -> dim over `model`, negative from the end), the
    collectives of its compiled plan (see `_collectives`) and, for weights that a matmul
    reads but that stay whole, the reasons Megatron gives (`why`: glob -> `WHY` keys; any
    other parameter left whole is one that no matmul reads)."""

    name: str
    layout: str
    build: Callable[[], tuple]  # () -> (forward(params, batch) -> logits, params, batch)
    split: dict
    collectives: dict
    why: dict = dataclasses.field(default_factory=dict)  # glob -> why a matmul weight stays whole
    fast: bool = False  # compiled in the default test run (the others are marked slow)
    textbook: str = ""  # why the split is not the textbook one, when it is not


#: Collective buffers over `model` of at least one activation's size, per (kind, pass,
#: primitive): a row-parallel block all-reduces its output once in the forward; in the
#: backward each column-parallel projection's input gradient is all-reduced (one per
#: block when Q/K/V or gate/up are one matmul: XLA:CPU reduces the partial gradients of
#: separate projections one by one, before adding them). The embedding's lookup is
#: reduced once; the LM head's input gradient once. All-gathers (`gathered`) count by
#: kind alone: XLA names them after the op or after the constraint that asks for them.
def _collectives(fwd, bwd, lookups=1, gathered=0):
    out = {("all-reduce", "forward", "dot_general"): fwd, ("all-reduce", "forward", "gather"): lookups,
           ("all-reduce", "backward", "dot_general"): bwd}
    if gathered:
        out["all-gather"] = gathered
    return out


_ATTN = {"[qkv]*/kernel*": 1, "[qkv]*/bias*": 0, "out/kernel*": 0}
_DENSE_MLP = {"up/*": -1, "down/kernel*": 0}


def _under(prefix, rules):
    return {f"{prefix}/{k}": d for k, d in rules.items()}


CASES = [
    Case("linen_mha", "flax linen.MultiHeadDotProductAttention (3-D DenseGeneral kernels, biases), linen.Dense MLP",
         C.linen(C.LinenLM(), "tokens"),
         {"params/embed/embedding": 0, **_under("params/block?/attn", _ATTN), **_under("params/block?", _DENSE_MLP),
          "params/head/*": -1},
         _collectives(4, 1 + 2 * (3 + 1)), fast=True),
    Case("linen_encoder_decoder", "non-causal encoder; decoder self- and cross-attention (linen)",
         C.linen(C.LinenEncoderDecoder(), "source", "tokens"),
         {"params/embed/embedding": 0, **_under("params/*/attn", _ATTN), **_under("params/decoder/cross", _ATTN),
          **_under("params/*", _DENSE_MLP), "params/head/*": -1},
         # The backward also reduces the encoder output's gradient from the cross K/V.
         _collectives(5, 1 + (3 + 1) + (1 + 2 + 3 + 1), lookups=2)),
    Case("linen_dense_general", "linen.DenseGeneral Q/K/V [embed, heads, head_dim], output [heads, head_dim, "
         "embed]; RMSNorm; GeGLU", C.linen(C.DenseGeneralLM(), "tokens"),
         {"params/embed/embedding": 0, "params/block/[qkv]/kernel": 1, "params/block/o/kernel": 0,
          "params/block/gate/kernel": 1, "params/block/up/kernel": 1, "params/block/down/kernel": 0,
          "params/head/kernel": 1},
         _collectives(2, 1 + 3 + 2)),
    Case("nnx_mha", "flax nnx.MultiHeadAttention (LinearGeneral), nnx.Linear MLP", C.nnx_model(C.NnxLM),
         {"params/embed/embedding*": 0, **_under("params/block?/attn", _ATTN), **_under("params/block?", _DENSE_MLP),
          "params/head/*": -1},
         _collectives(4, 1 + 2 * (3 + 1))),
    Case("nnx_einsum_tied", "nnx.Einsum Q/K/V, nnx.LinearGeneral output and SwiGLU, RMSNorm, tied embeddings "
         "(nnx.Embed.attend)", C.nnx_model(C.NnxEinsumLM),
         {"params/embed/embedding*": 0, "params/[qkv]/kernel*": 1, "params/o/kernel*": 0, "params/gate/kernel*": 1,
          "params/up/kernel*": 1, "params/down/kernel*": 0},
         _collectives(2, 1 + 3 + 2)),
    Case("equinox_mha", "equinox nn.MultiheadAttention and nn.Linear ([out, in] weights) under vmap", C.equinox_lm,
         {"params/embed/weight": 0, "params/blocks/*/attn/[qkv]*_proj/weight": 0,
          "params/blocks/*/attn/output_proj/weight": 1, "params/blocks/*/up/*": 0, "params/blocks/*/down/weight": 1,
          "params/head/*": 0},
         _collectives(4, 1 + 2 * (3 + 1))),
    Case("bert_2d_bias", "2-D Q/K/V [embed, embed] with biases reshaped into heads; non-causal post-LN encoder",
         C.bert,
         {"params/embed": 0, "params/layers/*/w[qkv]": 1, "params/layers/*/b[qkv]": 0, "params/layers/*/wo": 0,
          "params/layers/*/[wb]1": -1, "params/layers/*/w2": 0, "params/head": 1, "params/head_b": 0},
         _collectives(4, 1 + 2 * (3 + 1))),
    *(Case(f"fused_qkv_{cut}", f"one [embed, 3 embed] [q; k; v] projection cut by {how} after the matmul",
           C.fused_qkv(cut),
           {"params/embed": 0, "params/layers/*/wo": 0, "params/layers/*/[wb]1": -1, "params/layers/*/w2": 0,
            "params/head": 1},
           # The projection runs whole; its pieces' gradients are gathered in the backward,
           # once per piece (the lowering keeps XLA from merging them with the forward's).
           _collectives(4, 1 + 2, gathered=6), why={"params/layers/*/qkv": {"gather", "cut"}},
           fast=False)
      for cut, how in (("split", "jnp.split"), ("slices", "slicing"))),
    *(Case(f"fused_qkv_view_{stored}", f"one {shape} [q; k; v] kernel used as {use}, viewed as [3, heads, head_dim] "
           f"and cut by {how}", C.fused_view(stored, cut),
           {"params/embed": 0, "params/layers/*/wo": 0, "params/layers/*/[wb]1": -1, "params/layers/*/w2": 0,
            "params/head": 1},
           # Each device keeps its heads of q, k and v: a factor of the fused dim, not
           # a block of it, so the kernel and its projection stay whole and the view is
           # split; the view's gradient is gathered in the backward.
           _collectives(2, 1 + 1, gathered=1), why={"params/layers/*/qkv": {"gather", "cut"}})
      for stored, shape, use, cut, how in (("out_in", "[3 embed, embed]", "x @ w.T", "unstack", "jnp.unstack"),
                                           ("in_out", "[embed, 3 embed]", "x @ w", "moveaxis", "jnp.moveaxis"))),
    Case("gqa_group", "grouped-query attention, 8 query heads over 4 KV heads (queries reshaped to groups)",
         C.grouped(4, 8, "group"),
         {"params/embed": 0, "params/layers/*/[qkv]": 1, "params/layers/*/o": 0, "params/layers/*/gate": 1,
          "params/layers/*/up": 1, "params/layers/*/down": 0, "params/head": 1},
         _collectives(2, 1 + 3 + 2)),
    Case("gqa_repeat", "grouped-query attention, 2 KV heads (fewer than the axis) repeated with jnp.repeat",
         C.grouped(2, 8, "repeat"),
         {"params/embed": 0, "params/layers/*/q": 1, "params/layers/*/o": 0, "params/layers/*/gate": 1,
          "params/layers/*/up": 1, "params/layers/*/down": 0, "params/head": 1},
         # K/V run whole and are sliced by heads: their gradients are gathered back.
         _collectives(2, 1 + 1 + 2, gathered=2),
         why={"params/layers/*/[kv]": {"cannot-tile", "gather"}}),
    Case("gqa_group_few_kv", "grouped-query attention, 2 KV heads (fewer than the axis), queries reshaped to groups",
         C.grouped(2, 8, "group"),
         {"params/embed": 0, "params/layers/*/gate": 1, "params/layers/*/up": 1, "params/layers/*/down": 0,
          "params/head": 1},
         _collectives(1, 1 + 2),
         why={"params/layers/*/q": {"gather", "activation-contraction"},
              "params/layers/*/[kv]": {"cannot-tile", "activation-contraction"}, "params/layers/*/o": {"spreads"}},
         textbook="not textbook: splitting 8 query heads over 4 devices and then reshaping them to [2 KV heads, "
                  "4 per group] would need the axis split across two dims; the attention stays whole"),
    Case("mqa", "multi-query attention: one KV head, 2-D [embed, head_dim] K/V kernels", C.grouped(1, 4, "repeat"),
         {"params/embed": 0, "params/layers/*/q": 1, "params/layers/*/o": 0, "params/layers/*/gate": 1,
          "params/layers/*/up": 1, "params/layers/*/down": 0, "params/head": 1},
         _collectives(2, 1 + 1 + 2), why={"params/layers/*/[kv]": {"gather"}}),
    *(Case(f"mqa_{q_kernel}", f"multi-query attention through einsum: query kernel [{order}], one [embed, "
           "head_dim] key/value head read by every query head, output [heads, head_dim, embed]",
           C.multi_query(q_kernel),
           {"params/embed": 0, "params/layers/*/q": dim, "params/layers/*/o": 0, "params/layers/*/gate": 1,
            "params/layers/*/up": 1, "params/layers/*/down": 0, "params/head": 1},
           # The key/value gradients, summed over the heads, are reduced too (smaller
           # than an activation).
           _collectives(2, 1 + 1 + 2), why={"params/layers/*/[kv]": {"gather"}}, fast=False)
      for q_kernel, order, dim in (("hed", "heads, embed, head_dim", 0), ("ehd", "embed, heads, head_dim", 1))),
    Case("padded_encoder", "BERT as HF Flax writes it: Dense Q/K/V with biases, additive [batch, 1, 1, seq] padding "
         "mask, dropout, learned position embeddings looked up at arange(seq)", C.padded_encoder,
         {"params/embed": 0, "params/layers/*/[qkv]/kernel": 1, "params/layers/*/[qkv]/bias": 0,
          "params/layers/*/o/kernel": 0, "params/layers/*/[wb]1": -1, "params/layers/*/w2": 0, "params/head": 1},
         _collectives(2, 1 + 3 + 1), why={"params/pos": {"positions"}}),
    Case("torch_layout", "[out, in] kernels used as x @ w.T; einsum kernels [heads, embed, head_dim], "
         "[embed, head_dim, heads], output [embed, heads, head_dim]", C.torch_layout,
         {"params/embed": 0, "params/layers/*/wq": 0, "params/layers/*/wk": 2, "params/layers/*/wv": 0,
          "params/layers/*/wo": 1, "params/layers/*/[wb]1": 0, "params/layers/*/w2": 1, "params/head": 0},
         _collectives(2, 1 + 3 + 1)),
    Case("llama_scan", "layers stacked under lax.scan; RMSNorm, rotary embeddings (stack), SwiGLU, tied "
         "embeddings", C.llama_scan,
         {"params/embed": 0, "params/layers/[qkv]": 2, "params/layers/o": 1, "params/layers/gate": 2,
          "params/layers/up": 2, "params/layers/down": 1},
         # The scanned body's collectives appear once in the HLO text.
         _collectives(2, 1 + 3 + 2)),
]
BY_NAME = {c.name: c for c in CASES}


@pytest.fixture(scope="module")
def planned():
    """`planned(name, rename=False) -> (step, args, Partitioned)`, each made once."""
    cache = {}

    def get(name, rename=False):
        if (name, rename) not in cache:
            forward, params, batch = BY_NAME[name].build()
            step, args = C.train_step(forward, params, batch, rename=rename)
            cache[name, rename] = (step, args, T.apply_schedule(partir.lift(step, *args), MESH, SCHEDULE))
        return cache[name, rename]

    return get


def _params(prog):
    return [(v, n) for v, n in zip(prog.inputs, prog.input_names) if n.startswith("params")]


def _model_dims(res):
    """Each parameter's dim split over 'model' (None: whole), by name."""
    out = {}
    for v, n in _params(res.program):
        dims = [d for d, axes in enumerate(res.partitioning.tiling(v).dims) if "model" in axes]
        assert len(dims) <= 1, n
        out[n] = dims[0] if dims else None
    return out


def _expected(globs: dict, prog) -> dict:
    """Parameter name -> the value of the one glob it matches (None if none); every glob
    must match some parameter."""
    out, used = {}, set()
    for v, n in _params(prog):
        hits = [(g, d) for g, d in globs.items() if partir.path_matches(g, n)]
        assert len(hits) <= 1, f"{n} matches {hits}"
        used.update(g for g, _ in hits)
        out[n] = hits[0][1] if hits else None
    assert used == set(globs), f"globs matching no parameter: {set(globs) - used}"
    return out


@pytest.mark.parametrize("name", BY_NAME)
def test_split_is_the_expected_one(name, planned):
    _, _, res = planned(name)
    prog = res.program
    assert prog.fallbacks == ()
    want = {n: None if d is None else d % prog.values[prog.resolve(n)].rank
            for n, d in _expected(BY_NAME[name].split, prog).items()}
    assert _model_dims(res) == want
    # The parameters left whole, each with its reasons, structured.
    why = _expected(BY_NAME[name].why, prog)
    left = {}
    for x in res.context.left_out["model"]:
        left.setdefault(prog.name(x.weight), set()).add(x.why)
    assert set(left) == {n for n, d in want.items() if d is None}
    assert left == {n: why[n] or {"no-contraction"} for n in left}
    # Every block's members are split over the axis; a cut block splits its pieces.
    for b in res.context.blocks["model"]:
        assert all(want[prog.name(m)] is not None for m in b.members)
        assert all("model" in res.partitioning.tiling(p).axes() for p in b.pieces)
        assert bool(b.pieces) == (want[prog.name(b.weight)] is None)


#: Renamed by default: a flax module, an equinox one, a layer scan, a fused [q; k; v] view and
#: a layout whose attention stays whole with its reasons; the others (3 s in all) in `make
#: test-slow`: these and tests/test_tactics.py::test_megatron_ignores_parameter_names (the GPT)
#: hold the split to the program's structure, not its names.
RENAMED = {"linen_mha", "equinox_mha", "llama_scan", "fused_qkv_view_out_in", "gqa_group_few_kv"}


@pytest.mark.parametrize("name", [n if n in RENAMED else pytest.param(n, marks=pytest.mark.slow) for n in BY_NAME])
def test_split_ignores_parameter_names(name, planned):
    _, _, plain = planned(name)
    _, _, renamed = planned(name, rename=True)
    assert all(n.startswith("params['k") for _, n in _params(renamed.program))
    tilings = [[r.partitioning.tiling(v) for v in r.program.inputs] for r in (plain, renamed)]
    assert tilings[0] == tilings[1]


def _op_names(c) -> list[str]:
    """The op name of each buffer of a collective. XLA combines several all-reduces into
    one tuple instruction whose op_name factors out their common prefix and joins the
    rest: `jit(run)/transpose(jvp(f))/attn/(query/dot_general:key/dot_general)`."""
    name = c.op_name.removeprefix("jit(run)/")
    if len(c.shapes) == 1 or not name.endswith(")") or ":" not in name:
        return [name] * len(c.shapes)
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            break
    names = [name[:i] + part for part in name[i + 1:-1].split(":")]
    assert len(names) == len(c.shapes), c
    return names


def _big_buffers(cols) -> dict:
    """(kind, pass, primitive) -> count of all-reduce buffers over 'model' of at least
    one activation's size (`transpose(` in an op name marks the backward pass), and
    kind -> count of the other collectives' buffers of that size."""
    counts = Counter()
    for c in cols:
        if c.axes != ("model",):
            continue
        for (_, shape), n in zip(c.shapes, _op_names(c)):
            if math.prod(shape) < ACTIVATION:
                continue
            if c.kind == "all-reduce":
                counts[c.kind, "backward" if "transpose(" in n else "forward", n.rsplit("/", 1)[-1]] += 1
            else:
                counts[c.kind] += 1
    return dict(counts)


@pytest.mark.parametrize("name", [pytest.param(c.name, marks=() if c.fast else pytest.mark.slow) for c in CASES])
def test_plan_matches_jit_with_the_blocks_collectives(name, planned):
    step, args, res = planned(name)
    compiled = res.lower().lower(*args).compile()
    got, want = jax.tree.leaves(compiled(*args)), jax.tree.leaves(jax.jit(step)(*args))
    for n, g, w in zip(res.program.output_names, got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6, err_msg=n)
    cols = partir.collectives(compiled.as_text(), res.mesh.jax_mesh())
    assert _big_buffers(cols) == BY_NAME[name].collectives
    assert not [c for c in cols if c.kind == "collective-permute"]  # no halo exchange anywhere
