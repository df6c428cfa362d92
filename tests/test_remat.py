"""Activation rematerialization: blocks found from the program's structure, the `Remat`
tactic, numerics of the recomputing lowering, the cost model against XLA, and the search
taking remat as a decision under a memory limit."""

import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp
import pytest

import partir
import search
import tactics as T
from examples import gpt
from partir import MeshSpec

MESH = MeshSpec.of(data=2, model=4)
# adam_eps large enough that gradients rounding apart by 1e-7 do not move parameters apart
TINY = dict(n_layers=3, d_model=64, n_heads=8, d_ff=128, vocab=64, seq_len=16, batch=8, adam_eps=1e-3)
#: A GPT whose activations dwarf its parameters, as at scale (abstract shapes).
ACTIVE = gpt.GPTConfig(n_layers=4, d_model=128, n_heads=8, d_ff=512, vocab=256, seq_len=256, batch=16, scan_layers=True)
DP_TP = [T.DataParallel("data"), T.Megatron("model")]


def _program(scan, **kw):
    step, args = gpt.make_train_step(gpt.GPTConfig(scan_layers=scan, **{**TINY, **kw}), abstract=True)
    return partir.lift(step, *args)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_blocks_are_the_layers(scan):
    prog = _program(scan)
    blocks = partir.residual_layers(prog)
    if scan:
        (block,) = blocks  # the forward loop's body, one layer per iteration
        assert block.loop >= 0
    else:
        assert len(blocks) == TINY["n_layers"]
        assert len({len(b.ops) for b in blocks}) == 1  # alike layers, alike blocks
    for b in blocks:
        full, dots = partir.recomputed(prog, b, "full"), partir.recomputed(prog, b, "dots")
        assert set(dots) < set(full) <= set(b.residuals)
        assert partir.recomputed(prog, b, "none") == ()


@pytest.mark.parametrize("module", ["gpt", "llama"])
def test_two_layers_are_as_long_as_the_layers_of_a_deeper_program(module):
    # A program of two layers has one cut between them: the layers' length comes from
    # where each layer's parameters first meet the activation, so the search's 2-layer
    # twin sizes what it recomputes as the deep program does (it once took the first
    # layer to start at its first weight read: GPT 94 ops instead of 110, Llama 114
    # instead of 125, and a Remat('dots') peak extrapolated 22% low, some peaks negative).
    from examples import llama

    def layers(n):
        if module == "gpt":
            step, args = gpt.make_train_step(gpt.GPTConfig(**{**TINY, "n_layers": n}), abstract=True)
        else:
            step, args = llama.make_train_step(llama.LlamaConfig(n_layers=n, d_model=64, n_heads=4, n_kv_heads=2,
                                                                 d_ff=128, vocab=64, seq_len=16, batch=8),
                                               abstract=True)
        return [(len(b.ops), len(b.residuals)) for b in partir.layers_of(partir.lift(step, *args))]

    two, three = layers(2), layers(3)
    assert len(two) == 2 and len(three) == 3
    assert set(two) == set(three) and len(set(three)) == 1


def test_remat_tactic_notes_and_errors():
    prog = _program(True)
    res = T.apply_schedule(prog, MESH, DP_TP + [T.Remat("dots")])
    assert res.partitioning.rematerialized
    assert "recomputed" in res.history[-1].notes[0]
    with pytest.raises(T.TacticError,
                       match="not one of none, collectives, dots_with_context, dots, dots_except_mlp_in, dots_except_mlp, every_other_dot, qkv, full"):
        T.apply_schedule(prog, MESH, [T.Remat("everything")])
    with pytest.raises(T.TacticError, match="matches the parameters of no layer"):
        T.apply_schedule(prog, MESH, [T.Remat("full", pattern="params/nothing/*")])
    step, args = gpt.make_train_step(gpt.GPTConfig(n_layers=1, **{k: v for k, v in TINY.items() if k != "n_layers"}),
                                     abstract=True)
    with pytest.raises(T.TacticError, match="found no layers"):
        T.apply_schedule(partir.lift(step, *args), MESH, [T.Remat("full")])


# In `make test-slow`: a scanned Remat's numerics run by default in tests/test_remat_roles.py
# (the tightened user checkpoint) and tests/test_pipeline_uneven.py (recomputing pipelined
# stages); unrolled layers recomputing under DP + Megatron (the same GPT, `Remat('qkv')`) in
# tests/test_remat_roles.py::test_an_unrolled_plan_keeping_some_matmuls_computes_what_jit_computes[qkv].
@pytest.mark.parametrize("scan,policy", [
    pytest.param(True, "full", marks=pytest.mark.slow), pytest.param(False, "dots", marks=pytest.mark.slow),
    pytest.param(True, "dots", marks=pytest.mark.slow), pytest.param(False, "full", marks=pytest.mark.slow)],
    ids=["scan-full", "unrolled-dots", "scan-dots", "unrolled-full"])
def test_recomputing_plan_matches_jit(scan, policy):
    step, args = gpt.make_train_step(gpt.GPTConfig(scan_layers=scan, **{**TINY, "n_layers": 2}))
    res = T.apply_schedule(partir.lift(step, *args), MESH, DP_TP + [T.Remat(policy)])
    assert res.partitioning.rematerialized
    partir.check_equivalence(step, args, res.partitioning, rtol=2e-5, atol=2e-6)


def _xla_memory(part, args):
    m = partir.lower(part, part.mesh.jax_mesh()).lower(*args).compile().memory_analysis()
    return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes


def test_scan_remat_drops_memory_as_modeled():
    # XLA:CPU honours recomputation under scan (not in unrolled code, where its
    # scheduler merges it back): the drop shows in memory_analysis().
    step, args = gpt.make_train_step(ACTIVE, abstract=True)
    prog = partir.lift(step, *args)
    kept = T.apply_schedule(prog, MESH, DP_TP).partitioning
    remat = T.apply_schedule(prog, MESH, DP_TP + [T.Remat("full")]).partitioning
    xla_kept, xla_remat = _xla_memory(kept, args), _xla_memory(remat, args)
    model_kept = search.CostModel(kept, "cpu").cost().memory_peak
    model_remat = search.CostModel(remat, "cpu").cost().memory_peak
    assert xla_remat < 0.6 * xla_kept
    for model, xla in ((model_kept, xla_kept), (model_remat, xla_remat)):
        assert 0.8 <= model / xla <= 1.2, (model, xla)


#: Llama: the rotary embedding rotates the query and key projections, so the backward
#: reads the rotated values, not the projections themselves (the layer norms too).
#: adam_eps as TINY's, for the same reason.
LLAMA = dict(n_layers=3, d_model=64, n_heads=4, n_kv_heads=2, d_ff=256, vocab=64, seq_len=64, batch=8,
             scan_layers=True, adam_eps=1e-3)


def _llama_dots(**kw):
    from examples import llama

    config = llama.LlamaConfig(**{**LLAMA, **kw})
    step, args = llama.make_train_step(config)
    schedule = DP_TP + ([] if config.remat else [T.Remat("dots")])
    return step, args, T.apply_schedule(partir.lift(step, *args), MESH, schedule).partitioning


def test_dots_recomputes_no_projection_it_could_keep():
    """`Remat('dots')` keeps every output of a matmul with no batch dims that its
    recomputation reads, as `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`
    does: on Llama it keeps the query and key projections the rotary embedding reads
    and the output projection the second norm reads, and recomputes no matmul but the
    attention's batched ones (it once ran those three projections again: half the
    recomputation's modeled seconds on NeMo's 70B row), while `full` runs every matmul
    again."""
    *_, part = _llama_dots()
    prog = part.program
    rec = partir.recompute(prog, part.rematerialized)
    dots = [prog.ops[o] for o in rec.ops if prog.ops[o].primitive == "dot_general"]
    assert dots and all(op.eqn.params["dimension_numbers"][1][0] for op in dots)  # batched: the attention's
    sources = {s for srcs in rec.sources.values() for s in srcs}
    residuals = {r for b in partir.residual_layers(prog) for r in b.residuals}
    kept_for_it = [s for s in sources if s not in residuals and prog.producer[s] >= 0
                   and prog.ops[prog.producer[s]].primitive == "dot_general"]
    assert len(kept_for_it) == 3  # the query and key projections; the output one, which the MLP norm reads
    full = T.apply_schedule(prog, MESH, DP_TP + [T.Remat("full")]).partitioning
    again = partir.recompute(prog, full.rematerialized)
    assert sum(prog.ops[o].primitive == "dot_general" for o in again.ops) > len(dots)


@pytest.mark.slow
def test_dots_does_the_work_of_jax_dots_policy_and_computes_what_jit_computes():
    """The same Llama under `Remat('dots')` and under the user's own `jax.checkpoint`
    with `dots_with_no_batch_dims_saveable` (`LlamaConfig(remat=True, remat_policy=
    'dots')`), both scanned (XLA:CPU honours recomputation under scan): XLA's compiled
    flops agree within 1% (60.69 M against 60.86 M; 65.93 M when the projections were
    run again) and its memory within 10% (4675 against 4357 KB); the model's peak is
    XLA's within 20% (4093 KB); the plan computes what jit computes."""
    step, args, ours = _llama_dots()
    _, _, theirs = _llama_dots(remat=True, remat_policy="dots")

    def compiled(part):
        c = partir.lower(part, part.mesh.jax_mesh()).lower(*args).compile()
        cost = c.cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"], _xla_memory(part, args)

    (flops, memory), (flops_jax, memory_jax) = compiled(ours), compiled(theirs)
    assert flops == pytest.approx(flops_jax, rel=0.01)
    assert memory == pytest.approx(memory_jax, rel=0.1)
    assert 0.8 <= search.CostModel(ours.copy(), "cpu").cost().memory_peak / memory <= 1.2
    partir.check_equivalence(step, args, ours, rtol=2e-5, atol=2e-6)


@pytest.fixture(scope="module")
def active():
    step, args = gpt.make_train_step(ACTIVE, abstract=True)
    return partir.lift(step, *args)


def _searched(prog, limit, **kw):
    auto = search.AutomaticPartition(budget_s=600, max_episodes=400, device="h100", memory_limit=limit, **kw)
    res = T.apply_schedule(prog, MESH, [auto])
    (result,) = res.context.search
    return res, result


def _policies(result):
    return [a.tactic.policy for a in result.actions if isinstance(a.tactic, T.Remat)]


# (3 s: in `make test-slow`; the default run holds the search turning Remat on where only
# that fits in tests/test_pipeline_onef_remat.py::test_the_search_rematerializes_a_1f1b_pipeline_where_only_that_fits.)
@pytest.mark.slow
def test_search_turns_remat_on_under_a_limit_and_off_without(active):
    _, free = _searched(active, None)
    assert _policies(free) == []
    # No tiling alone gets under 20 MiB: the search recomputes, and keeps the matmul
    # outputs (`dots`), which costs less recomputation than `full` and fits.
    res, tight = _searched(active, 20 * 2**20)
    assert _policies(tight) == ["dots"]
    cost = search.CostModel(res.partitioning.copy(), "h100", memory_limit=20 * 2**20).cost()
    assert cost.fits and cost.step_time > free.step_time


# (2 s: two searches; in `make test-slow`. The default run holds the error of a limit no
# plan meets, and best_effort's plan, in tests/test_bad_input.py and tests/test_search.py.)
@pytest.mark.slow
def test_a_limit_nothing_meets_is_an_error(active):
    with pytest.raises(T.TacticError, match=r"no plan found fits .* peaks at .*live there: .*smallest peak"):
        _searched(active, 2 * 2**20)
    res, result = _searched(active, 2 * 2**20, best_effort=True)
    assert not result.fits and res.partitioning.decisions


def test_the_search_reaches_sequence_parallelism():
    prog = _program(True)
    auto = search.AutomaticPartition(budget_s=600, max_episodes=1, device="h100")
    _, macros = auto.search_space(partir.Partitioning(prog, MESH), T.Context())
    names = {type(m).__name__ for m in macros}
    assert {"SequenceParallel", "Remat", "Megatron", "FSDP", "DataParallel"} <= names



# In `make test-all` (5 s a form; the unrolled form: XLA:CPU ignores its checkpoint, and the
# plan's recomputation of unrolled layers runs in tests/test_remat_roles.py's unrolled 'qkv' plan).
# The default run holds XLA's collectives of a recomputing plan to the modeled ones in
# tests/test_shardmap.py::test_rematerialized_residuals_are_recomputed_per_device (Megatron),
# and of a recomputation reading FSDP weights in
# tests/test_pipeline.py::test_a_stage_moves_its_weights_and_gradients_once_a_step_through_the_users_checkpoint.
@pytest.mark.parametrize("scan", [pytest.param(s, marks=pytest.mark.slow) for s in (False, True)],
                         ids=["unrolled", "scan"])
def test_recomputation_gathers_again_what_it_reads_in_either_form(scan):
    # Under FSDP the recomputed forward ops gather the weights they read again, behind
    # the barrier that keeps XLA from merging them into the forward pass, though the
    # backward gathers them for the gradients too: so XLA runs the jit lowering, unrolled
    # and under scan alike, and so the model charges both forms. The shard_map lowering's
    # recomputed and backward reads of one recomputed value are one operand, which XLA
    # may gather once: never more than modeled.
    step, args = gpt.make_train_step(gpt.GPTConfig(**{**TINY, "scan_layers": scan}), abstract=True)
    prog = partir.lift(step, *args)
    part = T.apply_schedule(prog, MESH, [T.FSDP("data"), T.Remat("full")]).partitioning
    weight = 16 * 2**10  # the weights' gathered buffers (biases and norms are smaller)
    modeled = Counter((c.kind, int(c.bytes)) for c in search.CostModel(part, "cpu").cost().collectives
                      if c.kind == "all-gather" and c.bytes >= weight)
    for backend in ("jit", "shard_map"):
        text = partir.lower(part, backend=backend).lower(*args).compile().as_text()
        compiled = Counter((k, b) for (k, _, b), n in partir.collective_buffers(
            partir.collectives(text, MESH.jax_mesh())).items() for _ in range(n) if k == "all-gather" and b >= weight)
        if backend == "jit":
            assert compiled == modeled
        else:
            assert not compiled - modeled and compiled[("all-gather", weight)] >= modeled[("all-gather", weight)] // 2


# -- the user's own jax.checkpoint: kept, tightened or relaxed -------------------------

#: A GPT small enough to compile twice in a test, with the user's checkpoint per layer.
SMALL = dict(n_layers=2, d_model=32, n_heads=4, d_ff=64, vocab=32, seq_len=8, batch=4, adam_eps=1e-3, remat=True)


def _user(scan, policy, **kw):
    cfg = dataclasses.replace(ACTIVE, scan_layers=scan, remat_policy=policy, **{"remat": True, **kw})
    step, args = gpt.make_train_step(cfg, abstract=True)
    return partir.lift(step, *args), args


def _actions(res):
    return {d.action for d in res.history[-1].decisions}


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_user_checkpoint_twins_are_the_recomputed_forward_ops(scan):
    full, _ = _user(scan, None)
    dots, _ = _user(scan, "dots")
    for prog, policy in ((full, "full"), (dots, "dots")):
        ckpts = partir.user_checkpoints(prog)
        assert len(ckpts) == (1 if scan else ACTIVE.n_layers)
        for c in ckpts:
            assert c.policy_name == policy
            matmuls = [w for w, _ in c.reruns if prog.ops[prog.producer[w]].primitive == "dot_general"]
            # full: q, k, v, scores, attention, out and mlp-in projections run again (the
            # last matmul's output is not needed); dots: only the two batched ones
            assert len(matmuls) == (7 if policy == "full" else 2)
            for w, v in c.reruns:
                assert not prog.backward[prog.producer[v]] and prog.backward[prog.producer[w]]


def _fidelity(part, args):
    f = search.compare_with_xla(part, args)
    return f.memory_model, f.memory_xla, f.flops_model, f.flops_xla


@pytest.mark.parametrize("policy", [pytest.param(None, marks=pytest.mark.slow), "dots"])
def test_kept_user_checkpoint_is_costed_as_xla_runs_it(policy):
    # No Remat: the plan keeps the user's checkpoint. The backward region's recomputation
    # is counted as work and what the policy drops is not live: XLA agrees (scan form).
    prog, args = _user(True, policy)
    plain, _ = _user(True, None, remat=False)
    part = T.apply_schedule(prog, MESH, DP_TP).partitioning
    mem, xla_mem, flops, xla_flops = _fidelity(part, args)
    assert 0.9 <= mem / xla_mem <= 1.1, (mem, xla_mem)
    assert 0.97 <= flops / xla_flops <= 1.03, (flops, xla_flops)
    base = search.CostModel(T.apply_schedule(plain, MESH, DP_TP).partitioning, "cpu").cost()
    assert flops > 1.05 * base.flops_loops_once and mem < 0.5 * base.memory_peak


def test_kept_user_checkpoint_costs_alike_unrolled_and_scanned():
    # XLA:CPU ignores jax.checkpoint in unrolled code: the unrolled form is held to the
    # scanned one, as GPU XLA runs both.
    costs = []
    for form in (False, True):
        prog, _ = _user(form, "dots")
        costs.append(search.CostModel(T.apply_schedule(prog, MESH, DP_TP).partitioning, "cpu").cost())
    assert abs(costs[0].flops / costs[1].flops - 1) < 0.01
    assert abs(costs[0].memory_peak / costs[1].memory_peak - 1) < 0.1


# (4 s: in `make test-slow`. The default run holds a tightened user checkpoint's numerics in
# tests/test_remat_roles.py and a recomputing scan's memory against XLA's in
# test_scan_remat_drops_memory_as_modeled.)
@pytest.mark.slow
def test_remat_tightens_a_looser_user_checkpoint():
    prog, args = _user(True, "dots")
    kept = T.apply_schedule(prog, MESH, DP_TP + [T.Remat("dots")])
    assert _actions(kept) == set() and "kept" in kept.history[-1].notes[-1]
    res = T.apply_schedule(prog, MESH, DP_TP + [T.Remat("full")])
    assert _actions(res) == {"remat"} and not res.partitioning.reused
    assert "tightened" in res.history[-1].notes[-1]
    mem, xla_mem, flops, xla_flops = _fidelity(res.partitioning, args)
    _, xla_user, _, xla_user_flops = _fidelity(kept.partitioning, args)
    assert xla_mem < 0.95 * xla_user and xla_flops > 1.1 * xla_user_flops  # the saved dots are recomputed
    assert 0.8 <= mem / xla_mem <= 1.2, (mem, xla_mem)


# (5 s a case: in `make test-slow`. The default run holds a relaxed checkpoint's numerics
# in test_every_checkpoint_of_a_layer_is_relaxed and tests/test_remat_roles.py, and a user
# checkpoint's cost against XLA's in test_kept_user_checkpoint_is_costed_as_xla_runs_it.)
@pytest.mark.parametrize("user,policy", [pytest.param(None, "none", marks=pytest.mark.slow),
                                         pytest.param(None, "dots", marks=pytest.mark.slow),
                                         pytest.param("dots", "none", marks=pytest.mark.slow)])
def test_remat_relaxes_a_stricter_user_checkpoint(user, policy):
    # The backward region reads the forward values instead of recomputing them: XLA runs
    # the work of the looser policy (no checkpoint at all for `none`) and holds the memory
    # the model says.
    prog, args = _user(True, user)
    res = T.apply_schedule(prog, MESH, DP_TP + [T.Remat(policy)])
    assert _actions(res) == {"reuse"} and not res.partitioning.rematerialized
    assert "relaxed" in res.history[-1].notes[-1]
    mem, xla_mem, flops, xla_flops = _fidelity(res.partitioning, args)
    if policy == "none":
        plain, _ = _user(True, None, remat=False)
        target = T.apply_schedule(plain, MESH, DP_TP).partitioning
    else:
        target = T.apply_schedule(_user(True, policy)[0], MESH, DP_TP).partitioning
    _, _, _, xla_target_flops = _fidelity(target, args)
    assert abs(xla_flops / xla_target_flops - 1) < 0.01
    assert 0.9 <= mem / xla_mem <= 1.1, (mem, xla_mem)
    assert 0.97 <= flops / xla_flops <= 1.03, (flops, xla_flops)


# In `make test-all` (3 s a case and more unrolled, the slowest to compile). The default run
# holds each change's numerics in tests/test_remat_roles.py's
# test_a_named_policy_changes_a_users_checkpoint_and_computes_what_jit_computes (tightened and
# relaxed at once, under shard_map), a relaxed checkpoint's in both lowerings
# in test_every_checkpoint_of_a_layer_is_relaxed, and unrolled recomputation in
# tests/test_remat_roles.py::test_an_unrolled_plan_keeping_some_matmuls_computes_what_jit_computes[qkv].
SLOW_CHANGES = {("relax", "jit"), ("relax", "shard_map"), ("tighten", "shard_map"), ("tighten", "jit")}
CHANGED = [(change, backend, form) for change in ("tighten", "relax") for backend in ("jit", "shard_map")
           for form in ("unrolled", "scan")]


@pytest.mark.parametrize("user,policy,backend,scan", [
    pytest.param(*{"tighten": ("dots", "full"), "relax": (None, "none")}[c], b, f == "scan",
                 marks=pytest.mark.slow if f == "unrolled" or (c, b) in SLOW_CHANGES else ())
    for c, b, f in CHANGED], ids=["-".join(c) for c in CHANGED])
def test_changed_user_checkpoint_matches_jit(scan, backend, user, policy):
    step, args = gpt.make_train_step(gpt.GPTConfig(scan_layers=scan, remat_policy=user, **SMALL))
    res = T.apply_schedule(partir.lift(step, *args), MESH, DP_TP + [T.Remat(policy)])
    assert res.partitioning.rematerialized or res.partitioning.reused
    partir.check_equivalence(step, args, res.partitioning, rtol=2e-5, atol=2e-6, backend=backend)


def test_reuse_takes_only_what_a_user_checkpoint_recomputes():
    prog, _ = _user(True, None)
    part = partir.Partitioning(prog, MESH)
    (ckpt,) = partir.user_checkpoints(prog)
    with pytest.raises(partir.PartitioningError, match="no jax.checkpoint region of the backward pass recomputes it"):
        part.reuse(prog.inputs[0])
    w = ckpt.reruns[-1][0]
    part.reuse(w)
    again = partir.Partitioning(prog, MESH)
    for d in part.decisions:  # a plan file's decisions replay
        again.redo(partir.Decision.from_json(d.to_json(prog), prog))
    assert again.reused == part.reused == {w}


def test_the_search_can_change_a_user_checkpoint():
    prog, _ = _user(True, None)
    assert not partir.residual_layers(prog)  # a layer only through the user's checkpoint: no residuals
    auto = search.AutomaticPartition(budget_s=600, max_episodes=1, device="h100")
    _, macros = auto.search_space(partir.Partitioning(prog, MESH), T.Context())
    assert {m.policy for m in macros if isinstance(m, T.Remat)} == {"dots", "full"}


def _two_checkpoints_per_layer():
    """A train step whose layers each hold two `jax.checkpoint`s, on arrays."""

    def layer(p, x):
        h = jax.checkpoint(lambda p, x: x + jnp.tanh(x @ p["a"]))(p, x)
        return jax.checkpoint(lambda p, h: h + jnp.sin(h @ p["b"]))(p, h)

    def loss(params, x):
        x = jnp.tanh(x)
        for p in params:
            x = layer(p, x)
        return (x ** 2).mean()

    def step(params, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        return jax.tree.map(lambda a, g: a - 0.1 * g, params, grads), value

    keys = jax.random.split(jax.random.key(0), 5)
    params = [{"a": jax.random.normal(keys[2 * i], (16, 16)) / 4, "b": jax.random.normal(keys[2 * i + 1], (16, 16)) / 4}
              for i in range(2)]
    return step, (params, jax.random.normal(keys[4], (8, 16)))


def test_every_checkpoint_of_a_layer_is_relaxed():
    step, args = _two_checkpoints_per_layer()
    prog = partir.lift(step, *args)
    layers = partir.remat_layers(prog)
    assert len(layers) == 2 and all(len(partir.checkpoints_of(prog, b)) == 2 for b in layers)
    res = T.apply_schedule(prog, MESH, [T.DataParallel("data"), T.Remat("none")])
    ckpts = [c for b in layers for c in partir.checkpoints_of(prog, b)]
    assert all(set(res.partitioning.reused) & {w for w, _ in c.reruns} for c in ckpts)
    for backend in ("jit", "shard_map"):
        partir.check_equivalence(step, args, res.partitioning, backend=backend)
