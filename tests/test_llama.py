"""The Llama example (examples/llama.py) and the large-model configs: numerics of its
building blocks, scanned/unrolled/rematerialised forms computing the same step, plans
under its expert schedules matching plain jit, and the Llama-3 and Mixtral shaped
configs lifting abstractly with the parameter counts they imply."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partir
import tactics
from examples import llama, moe
from examples._common import stack_layers
from partir import MeshSpec

EPS = 1e-3  # Adam eps large enough that near-zero gradients cannot flip updates
TINY = llama.LlamaConfig(adam_eps=EPS)


# -- building blocks ----------------------------------------------------------------------
def _reference_attention(q, k, v):
    """Causal softmax attention with every KV head repeated for its group of query heads."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    s = q.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def test_grouped_query_attention_serves_each_query_head_from_its_group():
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 8, 8, 16))
    k, v = (jax.random.normal(key, (2, 8, 2, 16)) for key in (kk, kv))
    out = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True))(q, k, v)
    np.testing.assert_allclose(out, jax.jit(_reference_attention)(q, k, v), rtol=1e-5, atol=1e-6)


def test_rotary_scores_depend_only_on_relative_position():
    cos, sin = llama.rotary_tables(TINY)
    kq, kk = jax.random.split(jax.random.key(1))
    q = jnp.broadcast_to(jax.random.normal(kq, (TINY.d_head,)), (1, TINY.seq_len, 1, TINY.d_head))
    k = jnp.broadcast_to(jax.random.normal(kk, (TINY.d_head,)), (1, TINY.seq_len, 1, TINY.d_head))
    rq, rk = llama.apply_rotary(q, cos, sin)[0, :, 0], llama.apply_rotary(k, cos, sin)[0, :, 0]
    scores = rq @ rk.T  # [query position, key position]
    np.testing.assert_allclose(jnp.linalg.norm(rq, axis=-1), jnp.linalg.norm(q[0, :, 0], axis=-1), rtol=1e-5)
    for offset in (0, 1, 5):
        diagonal = jnp.diagonal(scores, offset)
        np.testing.assert_allclose(diagonal, jnp.full_like(diagonal, diagonal[0]), rtol=1e-4, atol=1e-4)


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="n_heads=8 must be a multiple of n_kv_heads=3"):
        llama.LlamaConfig(n_kv_heads=3)
    with pytest.raises(ValueError, match=r"unknown remat_policy 'all'; allowed: \[None, 'dots', 'dots_with_context', 'qkv', "
                                         r"'dots_except_mlp_in', 'dots_except_mlp', 'every_other_dot'\]"):
        llama.LlamaConfig(remat=True, remat_policy="all")
    with pytest.raises(ValueError, match="remat_policy='dots' needs remat=True"):
        llama.LlamaConfig(remat_policy="dots")


# -- forms of the same model --------------------------------------------------------------
@functools.cache
def _train_step(config):
    # One step function per config, so that jax.jit compiles each once for all tests.
    return llama.make_train_step(config)


@functools.cache
def _step_outputs(config):
    step, args = _train_step(config)
    return args, jax.jit(step)(*args)


def _stack(tree):
    """``tree`` with its per-layer lists stacked as the scanned form holds them."""
    is_layers = lambda x: isinstance(x, list)  # noqa: E731
    return jax.tree.map(lambda x: stack_layers(x) if is_layers(x) else x, tree, is_leaf=is_layers)


# Full rematerialisation of the unrolled layers repeats what the scanned form with the
# "dots" policy shows; it runs in `make test-all`.
@pytest.mark.parametrize("variant", [
    {"scan_layers": True, "remat": True, "remat_policy": "dots"},
    pytest.param({"remat": True}, marks=pytest.mark.slow),
], ids=["scan-remat-dots", "remat"])
def test_forms_compute_the_same_step(variant):
    """Loss, updated parameters and adam state (whose first moment is 0.1x the gradient)."""
    (params, _, _), (new_params, opt_state, loss) = _step_outputs(TINY)
    (other_params, _, _), (other_new, other_state, other_loss) = _step_outputs(dataclasses.replace(TINY, **variant))
    if variant.get("scan_layers"):
        params, new_params, opt_state = (_stack(t) for t in (params, new_params, opt_state))
    jax.tree.map(np.testing.assert_array_equal, other_params, params)  # same init
    np.testing.assert_allclose(other_loss, loss, rtol=1e-6)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-7)
    jax.tree.map(close, (other_new, other_state), (new_params, opt_state))


def test_fused_kernels_compute_the_plain_step():
    """RMSNorm and SwiGLU as fused kernels differentiate them (`fused_kernels`, custom
    VJPs) give the written-out forms' loss, updated parameters and adam state."""
    (params, _, _), plain = _step_outputs(TINY)
    (fused_params, _, _), fused = _step_outputs(dataclasses.replace(TINY, fused_kernels=True))
    jax.tree.map(np.testing.assert_array_equal, fused_params, params)
    np.testing.assert_allclose(fused[2], plain[2], rtol=1e-6)
    close = functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-7)
    jax.tree.map(close, fused[:2], plain[:2])


def _kept(config) -> list:
    """The avals the forward layer scan of `config`'s step keeps for the backward (its
    stacked outputs, [L, ...]), from the step's jaxpr."""
    step, args = llama.make_train_step(config, abstract=True)
    scan = next(e for e in jax.make_jaxpr(step)(*args).eqns if e.primitive.name == "scan")
    return [v.aval for v in scan.outvars[scan.params["num_carry"]:]]


def test_fused_kernels_keep_their_inputs_and_no_float32_copy_of_the_residual_stream():
    """Written out, a bfloat16 layer keeps its norms' float32 copies of the residual
    stream [B, S, D]; as fused kernels it keeps none (the norms' per-row statistics, and
    the XLA attention's float32 softmax, as before), and fewer bytes in all."""
    config = dataclasses.replace(TINY, dtype=jnp.bfloat16, scan_layers=True)
    stream = (config.n_layers, config.batch, config.seq_len, config.d_model)
    plain, fused = (_kept(dataclasses.replace(config, fused_kernels=f)) for f in (False, True))
    copies = [[a for a in kept if a.shape == stream and a.dtype == jnp.float32] for kept in (plain, fused)]
    assert len(copies[0]) >= 2 and not copies[1]
    assert sum(a.size * a.dtype.itemsize for a in fused) < sum(a.size * a.dtype.itemsize for a in plain)


@pytest.mark.slow  # 5 s; the plan's numerics run by default (next test)
def test_fused_kernels_keep_less_as_xla_finds():
    """The modeled peak of a data-parallel step falls with the fused kernels as XLA's
    does, and is XLA's within a fifth."""
    import search

    base = llama.LlamaConfig(n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, d_ff=512, vocab=256, seq_len=128,
                             batch=16, scan_layers=True)
    found = {}
    for fused in (False, True):
        step, args = llama.make_train_step(dataclasses.replace(base, fused_kernels=fused), abstract=True)
        part = tactics.apply_schedule(partir.lift(step, *args), MeshSpec.of(data=8),
                                      [tactics.DataParallel("data")]).partitioning
        found[fused] = search.compare_with_xla(part, args)
    assert found[True].memory_xla < found[False].memory_xla and found[True].memory_model < found[False].memory_model
    assert 0.8 < found[True].memory_ratio < 1.2


#: Plans of a tiny Llama with fused kernels: NeMo's layout (data, tensor and sequence
#: parallel, 1F1B over two stages) by default; with recomputation in the stages, and
#: NeMo's 8B layout (context parallel in zigzag order, data parallel, ZeRO-1), in
#: `make test-slow`.
FUSED_PLANS = {
    "dp-tp-sp-1f1b": ([tactics.DataParallel("data"), tactics.Megatron("model"), tactics.SequenceParallel("model"),
                       tactics.Pipeline("stage", microbatches=4, schedule="1f1b")],
                      MeshSpec.of(data=2, model=2, stage=2)),
    "dp-tp-sp-1f1b-remat": ([tactics.DataParallel("data"), tactics.Megatron("model"),
                             tactics.SequenceParallel("model"), tactics.Pipeline("stage", microbatches=4, schedule="1f1b"),
                             tactics.Remat("full")], MeshSpec.of(data=2, model=2, stage=2)),
    "cp-dp-zero1": ([tactics.ContextParallel("context", balance="zigzag"), tactics.DataParallel("data"),
                     tactics.ZeRO("data", stage=1)], MeshSpec.of(data=4, context=2)),
}


@pytest.mark.parametrize("name", [n if n == "dp-tp-sp-1f1b" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in FUSED_PLANS])
def test_fused_kernels_plan_matches_jit(name):
    config = llama.LlamaConfig(n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, vocab=32, seq_len=8,
                               batch=16, scan_layers=True, adam_eps=EPS, fused_kernels=True)
    step, args = _train_step(config)
    schedule, mesh = FUSED_PLANS[name]
    res = tactics.apply_schedule(partir.lift(step, *args), mesh, schedule)
    partir.check_equivalence(step, args, res.partitioning, rtol=2e-5, atol=2e-6)


def test_bfloat16_activations_with_float32_master_weights():
    config = dataclasses.replace(TINY, dtype=jnp.bfloat16, scan_layers=True)
    step, (params, opt_state, batch) = llama.make_train_step(config)
    assert {x.dtype for x in jax.tree.leaves((params, opt_state))} <= {jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)}
    body = next(e for e in jax.make_jaxpr(step)(params, opt_state, batch).eqns if e.primitive.name == "scan")
    dots = [e for e in body.params["jaxpr"].jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    loss = jax.jit(functools.partial(llama.loss_fn, config=config))(params, batch)
    loss32 = jax.jit(functools.partial(llama.loss_fn, config=TINY))(_train_step(TINY)[1][0], batch)
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, loss32, rtol=2e-2)


@pytest.mark.slow  # 9 s; the master-weights step without ZeRO runs in `make test`
def test_master_weights_step_under_zero1_matches_jit():
    """Megatron's mixed precision (bfloat16 parameters, a float32 master copy and the adam
    moments in the optimizer state) under ZeRO-1: the master copy and moments sharded,
    the bfloat16 parameters whole before and after the step, and the plan computing
    what plain jit does, over two steps."""
    config = dataclasses.replace(TINY, dtype=jnp.bfloat16, scan_layers=True, master_weights=True)
    step, args = llama.make_train_step(config)
    assert {x.dtype for x in jax.tree.leaves(args[0])} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(args[1]["master"])} == {jnp.dtype(jnp.float32)}
    prog = partir.lift(step, *args)
    part = tactics.apply_schedule(prog, MeshSpec.of(data=8),
                                  [tactics.DataParallel("data"), tactics.ZeRO("data", stage=1)]).partitioning
    ins = dict(zip(prog.input_names, prog.inputs))
    outs = dict(zip(prog.output_names, prog.outputs))
    assert not any(part.tiling(v).axes() for n, v in ins.items() if n.startswith("params"))
    assert not any(part.tiling(v).axes() for n, v in outs.items() if n.startswith("out[0]"))
    sharded = [n for n, v in ins.items() if n.startswith("opt_state") and "data" in part.tiling(v).axes()]
    assert len(sharded) == 3 * len(jax.tree.leaves(args[0]))  # master, mu and nu of every parameter
    # bfloat16 parameters round to 8 bits: a parameter may differ by one unit of its last
    # place where the plan sums the gradient in another order.
    partir.check_equivalence(step, args, part, rtol=2e-2, atol=2e-3, steps=2)


# -- expert schedules ---------------------------------------------------------------------
SCHEDULE_CASES = {
    # name: (mesh, axis names, scan_layers)
    "dp+tp+sp+zero3": (MeshSpec.of(data=2, model=4), {}, False),
    "fsdp+tp": (MeshSpec.of(data=2, fsdp=2, model=2), {}, True),
    "fsdp": (MeshSpec.of(data=8), {}, False),
}


# In `make test-slow` (3 s each): the default run holds Llama's textbook tensor-parallel
# splits in test_megatron_splits_scanned_layers_as_unrolled_ones, its tensor and sequence
# parallel plan to jax.jit in tests/test_context.py::test_context_and_sequence_parallelism_together_match_jit,
# and its FSDP plan in tests/test_pipeline.py's stage under the user's checkpoint.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) for n in sorted(SCHEDULE_CASES)])
def test_schedule_plan_matches_jit(name):
    mesh, axes, scan = SCHEDULE_CASES[name]
    step, args = _train_step(dataclasses.replace(TINY, scan_layers=scan))
    prog = partir.lift(step, *args)
    assert prog.fallbacks == ()
    res = tactics.apply_schedule(prog, mesh, llama.SCHEDULES[name](**axes))
    tilings = {n: res.partitioning.tiling(v) for v, n in zip(prog.inputs, prog.input_names)
               if n.startswith("params")}
    # Every schedule shards every parameter over its ZeRO/FSDP axis ...
    zero_axis = "fsdp" if "fsdp" in mesh.names else "data"
    assert all(zero_axis in t.axes() for t in tilings.values())
    # ... and those with tensor parallelism split the MLP and the vocabulary over 'model'.
    layer = "params['layers']" if scan else "params['layers'][1]"
    for n in ("['mlp']['w_gate']", "['mlp']['w_up']", "['mlp']['w_down']", "params['embed']['tokens']"):
        assert ("model" in tilings[n if n.startswith("params") else layer + n].axes()) == ("tp" in name), n
    partir.check_equivalence(step, args, res.partitioning, rtol=2e-5, atol=2e-6, steps=2)


# (4 s: in `make test-slow`, with the schedule's other plans above.)
@pytest.mark.slow
def test_one_hot_loss_is_the_gathered_one_and_its_plan_matches_jit():
    """MaxText's cross-entropy (`loss='one_hot'`: log-probabilities summed against one-hot
    targets) computes the gathered form's loss; under data, tensor (the vocabulary split
    over 'model') and sequence parallelism with ZeRO-3 its plan computes what jit does."""
    config = dataclasses.replace(TINY, loss="one_hot")
    (_, _, _), (_, _, gathered) = _step_outputs(TINY)
    step, args = _train_step(config)
    np.testing.assert_allclose(jax.jit(step)(*args)[2], gathered, rtol=1e-6)
    res = tactics.apply_schedule(partir.lift(step, *args), MeshSpec.of(data=2, model=4),
                                 llama.SCHEDULES["dp+tp+sp+zero3"]())
    partir.check_equivalence(step, args, res.partitioning, rtol=2e-5, atol=2e-6)


def test_an_unknown_loss_is_refused_listing_the_allowed():
    with pytest.raises(ValueError, match=r"unknown loss 'xent'; allowed: \['gather', 'one_hot'\]"):
        llama.LlamaConfig(loss="xent")


# -- tensor parallelism, scanned and unrolled ----------------------------------------------
# Each layer's weights in their own dims, split over 'model' on the textbook dims: Q/K/V on
# the heads, the output projection on its heads (row parallel), the MLP column then row.
TEXTBOOK = {"['attn']['wq']": 1, "['attn']['wk']": 1, "['attn']['wv']": 1, "['attn']['wo']": 0,
            "['mlp']['w_gate']": 1, "['mlp']['w_up']": 1, "['mlp']['w_down']": 0}


def _megatron_params(config, mesh):
    step, args = llama.make_train_step(config, abstract=True)
    prog = partir.lift(step, *args)
    part = tactics.apply_schedule(prog, mesh, [tactics.DataParallel("data"), tactics.Megatron("model")]).partitioning
    return {n: part.tiling(v).dims for v, n in zip(prog.inputs, prog.input_names) if n.startswith("params")}


def test_megatron_splits_scanned_layers_as_unrolled_ones():
    """The scanned layers (bfloat16 compute: the backward reads the forward's cast weights
    back as stacked residuals) get each unrolled layer's split, their dims offset by the
    layer dim."""
    config = dataclasses.replace(TINY, n_kv_heads=4, dtype=jnp.bfloat16)  # 4 KV heads over 'model'
    mesh = MeshSpec.of(data=2, model=4)
    unrolled = _megatron_params(config, mesh)
    scanned = _megatron_params(dataclasses.replace(config, scan_layers=True), mesh)
    for name, dims in scanned.items():
        if not name.startswith("params['layers']"):
            assert dims == unrolled[name], name
            continue
        assert dims[0] == (), name  # never split on the layer dim
        for i in range(config.n_layers):
            assert dims[1:] == unrolled[name.replace("['layers']", f"['layers'][{i}]")], (name, i)
    for leaf, dim in TEXTBOOK.items():
        assert [d for d, axes in enumerate(scanned["params['layers']" + leaf]) if "model" in axes] == [dim + 1], leaf


@pytest.mark.slow  # float32 scanned Megatron runs by default in tests/test_megatron_corpus.py[llama_scan]
def test_megatron_scanned_plan_matches_jit():
    """The scanned bfloat16 layers' plan (heads and MLP split over 'model') runs as plain
    jit does."""
    config = dataclasses.replace(TINY, dtype=jnp.bfloat16, scan_layers=True)
    step, args = _train_step(config)
    prog = partir.lift(step, *args)
    res = tactics.apply_schedule(prog, MeshSpec.of(data=4, model=2),
                                 [tactics.DataParallel("data"), tactics.Megatron("model")])
    wq = res.partitioning.tiling(prog.match_inputs("params/layers/attn/wq")[0])
    assert wq.dims == ((), (), ("model",), ())  # stacked [L, D, heads, Dh]: split on the heads
    # bfloat16 rounds partial sums before they are reduced: the bound is loose, so each
    # output's worst difference is also held to a tenth of its own scale (a lost or
    # doubled reduction over 'model' is off by half or more; bfloat16 noise stays < 6%).
    worst = partir.check_equivalence(step, args, res.partitioning, rtol=2e-2, atol=2e-3)
    reference = jax.tree.leaves(jax.jit(step)(*args))
    for (name, diff), ref in zip(worst.items(), reference, strict=True):
        assert diff <= 0.1 * float(jnp.max(jnp.abs(ref))), name


# -- the large configs, abstractly --------------------------------------------------------
def _lift_and_count(module, config):
    step, args = module.make_train_step(config, abstract=True)
    prog = partir.lift(step, *args)  # lifting warns (an error here) on a primitive without a rule
    assert prog.fallbacks == ()
    return sum(math.prod(x.shape) for x in jax.tree.leaves(args[0]))


LARGE = {
    # The published Llama-3 counts: this example's layers are Llama-3's.
    "llama3-8b-scan": (llama, llama.LLAMA3_8B, 8_030_261_248),
    "llama3-8b-unrolled": (llama, dataclasses.replace(llama.LLAMA3_8B, scan_layers=False), 8_030_261_248),
    "llama3-70b-scan": (llama, llama.LLAMA3_70B, 70_553_706_496),
    # 46.7e9 in the real model; here two-matrix experts and no attention or embeddings.
    "mixtral-8x7b": (moe, moe.MIXTRAL_8X7B, 30_099_382_272),
}


# The unrolled 8B in `make test-slow` (32 layers to lift: the scanned form's count is the same).
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n == "llama3-8b-unrolled" else ())
                                  for n in sorted(LARGE)])
def test_large_config_lifts_with_its_parameter_count(name):
    module, config, expected = LARGE[name]
    assert module.param_count(config) == expected
    assert _lift_and_count(module, config) == expected


@pytest.mark.slow
def test_llama3_70b_unrolled_lifts():
    config = dataclasses.replace(llama.LLAMA3_70B, scan_layers=False)
    assert _lift_and_count(llama, config) == llama.param_count(config)


def test_mixtral_schedules_apply():
    step, args = moe.make_train_step(moe.MIXTRAL_8X7B, abstract=True)
    prog = partir.lift(step, *args)
    mesh = MeshSpec.of(data=8, expert=8)
    for name, schedule in moe.SCHEDULES.items():
        part = tactics.apply_schedule(prog, mesh, schedule()).partitioning
        w1 = [part.tiling(v) for v in prog.match_inputs("params/moe/*/experts/w1")]
        assert len(w1) == moe.MIXTRAL_8X7B.n_moe_layers
        assert all(t.dims[0] == ("expert",) for t in w1), name
