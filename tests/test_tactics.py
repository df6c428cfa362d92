"""Tactics and schedules: each tactic's plan is equivalent to the original program and
compiles to its textbook collectives; compositions too."""

import json

import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

import partir
import search
import tactics as T
from examples import gpt, mlp, moe
from examples.plans import STRATEGIES
from partir import MeshSpec

EPS = 1e-3  # Adam eps large enough that near-zero gradients cannot flip updates
GPT = gpt.GPTConfig(n_layers=3, fused_qkv=True, adam_eps=EPS)


def _plan(step, args, mesh, schedule, **kw):
    return T.apply_schedule(partir.lift(step, *args), mesh, schedule, **kw)


def _buffers(cols, kind, axes):
    """(shape, op name) of every buffer of the collectives of `kind` over `axes`: XLA
    combines several all-reduces into one tuple instruction whose op_name joins theirs
    with ':'."""
    out = []
    for c in cols:
        if c.kind != kind or c.axes != axes:
            continue
        name = c.op_name.removeprefix("jit(run)/")
        names = name.strip("()").split(":") if len(c.shapes) > 1 else [name]
        names += [names[-1]] * (len(c.shapes) - len(names))
        out += [(shape, n) for (_, shape), n in zip(c.shapes, names)]
    return out


def _check(res, step, args, **kw):
    partir.check_equivalence(step, args, res.partitioning, rtol=2e-5, atol=2e-6, **kw)
    return partir.collectives_of(res.lower(), *args, mesh=res.mesh.jax_mesh())


# -- Megatron ----------------------------------------------------------------------------
# (7 s: in `make test-slow`. The default run holds Megatron's per-block collectives in
# tests/test_megatron_corpus.py::test_plan_matches_jit_with_the_blocks_collectives and its
# numerics on this GPT in test_dp_and_megatron_reduce_gradients_over_data_only.)
@pytest.mark.slow
def test_megatron_gpt_one_all_reduce_per_block_each_way():
    step, args = gpt.make_train_step(GPT)
    res = _plan(step, args, MeshSpec.of(model=4, rest=2), [T.Megatron("model")])
    cols = _check(res, step, args)
    act = (GPT.batch, GPT.seq_len, GPT.d_model)
    bufs = [n for shape, n in _buffers(cols, "all-reduce", ("model",)) if shape == act]
    forward_dots = [n for n in bufs if "transpose" not in n and n.endswith("dot_general")]
    backward_dots = [n for n in bufs if "transpose" in n and n.endswith("dot_general")]
    # Per layer: one after the attention block, one after the MLP block, each way;
    # plus the vocab-parallel embedding (forward) and the LM head's input gradient.
    assert len(forward_dots) == 2 * GPT.n_layers
    assert len(backward_dots) == 2 * GPT.n_layers + 1
    assert len([n for n in bufs if n.endswith("gather")]) == 1
    assert {c.kind for c in cols} == {"all-reduce"}


@pytest.mark.slow
def test_megatron_matches_the_expert_plan_under_scan():
    cfg = gpt.GPTConfig(scan_layers=True, adam_eps=EPS)
    step, args = gpt.make_train_step(cfg)
    prog = partir.lift(step, *args)
    mesh = MeshSpec.of(data=2, model=4)
    res = T.apply_schedule(prog, mesh, [T.DataParallel("data"), T.Megatron("model")])
    hand = partir.Partitioning(prog, mesh)
    STRATEGIES["dp+megatron"](hand, "gpt", "data", "model")
    assert [res.partitioning.tiling(v) for v in prog.inputs] == [hand.tiling(v) for v in prog.inputs]
    assert res.partitioning.tiling("params['layers']['mlp']['w1']") == partir.Tiling(((), (), ("model",)))
    _check(res, step, args)


def _renamed(cfg):
    """The GPT train step over parameters (and so optimizer state) renamed to
    meaningless keys, in the same leaf order."""
    _, (params, _, batch) = gpt.make_train_step(cfg)
    tree = jax.tree_util.tree_structure(params)
    n = iter(range(10_000))

    def rename(x):
        if isinstance(x, dict):
            return {f"k{next(n):03d}": rename(v) for _, v in sorted(x.items())}
        if isinstance(x, list):
            return [rename(v) for v in x]
        return x

    new_params = rename(params)
    opt = optax.adam(cfg.learning_rate, eps=cfg.adam_eps)

    def renamed_step(p, s, b):
        def loss(p):
            return gpt.loss_fn(jax.tree_util.tree_unflatten(tree, jax.tree_util.tree_leaves(p)), b, cfg)

        value, grads = jax.value_and_grad(loss)(p)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    return renamed_step, (new_params, opt.init(new_params), batch)


def test_megatron_ignores_parameter_names():
    step, args = gpt.make_train_step(gpt.GPTConfig(adam_eps=EPS))
    mesh = MeshSpec.of(data=2, model=4)
    schedule = [T.DataParallel("data"), T.Megatron("model")]
    plain = _plan(step, args, mesh, schedule)
    rstep, rargs = _renamed(gpt.GPTConfig(adam_eps=EPS))
    renamed = _plan(rstep, rargs, mesh, schedule)
    assert all("attn" not in n and "mlp" not in n for n in renamed.program.input_names)
    p0 = [plain.partitioning.tiling(v) for v in plain.program.inputs]
    p1 = [renamed.partitioning.tiling(v) for v in renamed.program.inputs]
    assert p0 == p1 and sum(not t.is_replicated for t in p1) > 20


def test_dp_and_megatron_reduce_gradients_over_data_only():
    step, args = gpt.make_train_step(gpt.GPTConfig(adam_eps=EPS))
    res = _plan(step, args, MeshSpec.of(data=2, model=4), [T.DataParallel("data"), T.Megatron("model")])
    cols = _check(res, step, args)
    d, f = 64, 256
    grads = _buffers(cols, "all-reduce", ("data",))
    shapes = {s for s, _ in grads}
    # The tensor-parallel weights' gradients are reduced over 'data' as their model shards.
    assert {(d, f // 4), (f // 4, d), (d, d // 4)} <= shapes
    assert not {(d, f), (f, d)} & shapes
    assert not [c for c in cols if c.axes == ("data", "model")]


# -- data parallel and ZeRO --------------------------------------------------------------
def test_data_parallel_infers_the_batch_and_all_reduces_gradients():
    step, args = mlp.make_train_step(mlp.MLPConfig(adam_eps=EPS))
    res = _plan(step, args, MeshSpec.of(data=8), [T.DataParallel("data")])
    prog, part = res.program, res.partitioning
    found, _ = T.batch_inputs(partir.Partitioning(prog, part.mesh))
    assert [prog.name(v) for v in found] == ["batch['x']", "batch['y']"]
    assert all(part.tiling(v).dims[0] == ("data",) for v in found)
    cols = _check(res, step, args, steps=2)
    assert {(c.kind, c.axes) for c in cols} == {("all-reduce", ("data",))}
    assert T.batch_inputs(part, batch_argnums=2)[0] == found
    given = _plan(step, args, MeshSpec.of(data=8), [T.DataParallel("data", batch_argnums=2)])
    assert given.partitioning.key() == part.key()


# (3 is FSDP, which many default tests hold; 1 and 3 alike in the slow run)
@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])  # (2: between 1 and 3)
def test_zero_stages(stage):
    step, args = gpt.make_train_step(gpt.GPTConfig(adam_eps=EPS))
    res = _plan(step, args, MeshSpec.of(data=8), [T.DataParallel("data"), T.ZeRO("data", stage)])
    part = res.partitioning
    w1 = "params['layers'][0]['mlp']['w1']"
    mu = "opt_state[0].mu['layers'][0]['mlp']['w1']"
    assert ("data" in part.tiling(w1).axes()) == (stage == 3)
    assert "data" in part.tiling(mu).axes()
    cols = _check(res, step, args)
    cost = search.CostModel(part, "h100").cost()
    kinds = {c.kind for c in cost.collectives if c.axes == ("data",)}
    if stage == 1:
        assert "all-reduce" in kinds and "all-gather" in kinds  # full gradients, gathered params
    else:
        assert "reduce-scatter" in kinds and "all-gather" in kinds
    gathers = {s for s, _ in _buffers(cols, "all-gather", ("data",))}
    assert (64, 256) in gathers  # w1 gathered whole: after its update (1, 2) or before its use (3)


def test_zero_needs_data_parallel_first():
    step, args = gpt.make_train_step(gpt.GPTConfig())
    with pytest.raises(T.TacticError, match=r"put DataParallel\('data'\) earlier"):
        _plan(step, args, MeshSpec.of(data=8), [T.ZeRO("data", 3)])


# -- sequence and expert parallel ---------------------------------------------------------
def test_sequence_parallel_gathers_before_and_reduces_after_blocks():
    step, args = gpt.make_train_step(GPT)
    res = _plan(step, args, MeshSpec.of(model=4, rest=2), [T.Megatron("model"), T.SequenceParallel("model")])
    assert res.partitioning.tiling(res.program.outputs[-1]).is_replicated  # the loss
    cols = _check(res, step, args)
    b, s, d = GPT.batch, GPT.seq_len, GPT.d_model
    gathers = [n for shape, n in _buffers(cols, "all-gather", ("model",)) if shape == (b, s, d)]
    assert len(gathers) >= 2 * GPT.n_layers  # the sequence, before each block's first matmul
    # On a GPU the block outputs are reduce-scattered; XLA:CPU all-reduces and slices.
    gpu = search.CostModel(res.partitioning, "h100").cost().by_kind()
    assert gpu["reduce-scatter"][0] >= 2 * GPT.n_layers
    mega = _plan(step, args, MeshSpec.of(model=4, rest=2), [T.Megatron("model")])
    assert "reduce-scatter" not in search.CostModel(mega.partitioning, "h100").cost().by_kind()


def test_sequence_parallel_needs_megatron():
    step, args = gpt.make_train_step(gpt.GPTConfig())
    with pytest.raises(T.TacticError, match=r"needs Megatron\('model'\) earlier"):
        _plan(step, args, MeshSpec.of(model=8), [T.SequenceParallel("model")])


def test_expert_parallel_all_to_all():
    step, args = moe.make_train_step(moe.MoEConfig(adam_eps=EPS))
    res = _plan(step, args, MeshSpec.of(expert=8), [T.ExpertParallel("expert")])
    assert res.partitioning.tiling("params['moe'][0]['experts']['w1']").dims[0] == ("expert",)
    cols = _check(res, step, args)
    # Dispatch and combine, forward and backward.
    assert len(_buffers(cols, "all-to-all", ("expert",))) >= 4
    dense = _plan(step, args, MeshSpec.of(expert=8), [T.Shard("params/moe/*/experts/*", 0, "expert")])
    assert search.CostModel(dense.partitioning, "h100").cost().by_kind().get("all-to-all") is None


def test_expert_parallel_needs_experts():
    step, args = gpt.make_train_step(gpt.GPTConfig())
    with pytest.raises(T.TacticError, match="needs a mixture-of-experts layer"):
        _plan(step, args, MeshSpec.of(expert=8), [T.ExpertParallel("expert")])


# -- compositions on meshes of 2 and 3 axes ------------------------------------------------
COMPOSITIONS = {
    "dp+megatron": (lambda: gpt.make_train_step(gpt.GPTConfig(adam_eps=EPS)),
                    [T.DataParallel("data"), T.Megatron("model")]),
    "dp+zero3+megatron": (lambda: gpt.make_train_step(gpt.GPTConfig(adam_eps=EPS)),
                          [T.DataParallel("data"), T.ZeRO("data", stage=3), T.Megatron("model")]),
    "megatron+sp": (lambda: gpt.make_train_step(gpt.GPTConfig(adam_eps=EPS)),
                    [T.Megatron("model"), T.SequenceParallel("model")]),
    "ep+dp": (lambda: moe.make_train_step(moe.MoEConfig(adam_eps=EPS)),
              [T.ExpertParallel("expert"), T.DataParallel("data")]),
}
MESHES = {
    "dp+megatron": [MeshSpec.of(data=2, model=4), MeshSpec.of(pod=2, data=2, model=2)],
    "dp+zero3+megatron": [MeshSpec.of(data=2, model=4), MeshSpec.of(pod=2, data=2, model=2)],
    "megatron+sp": [MeshSpec.of(data=2, model=4), MeshSpec.of(pod=2, data=2, model=2)],
    "ep+dp": [MeshSpec.of(expert=4, data=2), MeshSpec.of(pod=2, expert=2, data=2)],
}
CASES = [(name, i) for name in COMPOSITIONS for i in range(2)]
#: In `make test-all`: three-axis meshes of the compositions that the others show on three
#: axes, and the two-axis cases whose guarantee another default test holds (DP + Megatron
#: in test_dp_and_megatron_reduce_gradients_over_data_only, Megatron + SP in
#: test_sequence_parallel_gathers_before_and_reduces_after_blocks, EP in
#: test_expert_parallel_all_to_all). EP + DP on three axes too (2 s): EP's numerics and
#: all-to-alls run by default in test_expert_parallel_all_to_all, a plan over three axes
#: in tests/test_llama.py::test_fused_kernels_plan_matches_jit (data x model x stage).
SLOW_CASES = {("dp+megatron", 0), ("dp+megatron", 1), ("megatron+sp", 0), ("megatron+sp", 1),
              ("dp+zero3+megatron", 1), ("dp+zero3+megatron", 0), ("ep+dp", 0), ("ep+dp", 1)}


@pytest.mark.parametrize("name,mesh_index", [pytest.param(*c, marks=pytest.mark.slow if c in SLOW_CASES else ())
                                             for c in CASES], ids=[f"{n}-{i + 2}axes" for n, i in CASES])
def test_compositions(name, mesh_index):
    make, schedule = COMPOSITIONS[name]
    mesh = MESHES[name][mesh_index]
    # Axes the composition does not name carry data parallelism too, so that every axis
    # is used: XLA reshards awkwardly around an axis a value is replicated over.
    named = {t.axis for t in schedule}
    schedule = schedule + [T.DataParallel(a) for a in mesh.names if a not in named]
    step, args = make()
    res = _plan(step, args, mesh, schedule)
    assert [s.skipped for s in res.history] == [None] * len(schedule)
    cols = _check(res, step, args)
    pairs = {(c.kind, c.axes) for c in cols}
    if "megatron" in name:
        assert any(k == "all-reduce" and "model" in a for k, a in pairs) or ("all-gather", ("model",)) in pairs
    if "zero3" in name:
        assert any(k == "all-gather" and "data" in a for k, a in pairs)  # parameters gathered before use
    if name == "megatron+sp":
        assert ("all-gather", ("model",)) in pairs
    if name == "ep+dp":
        assert any(k == "all-to-all" and a == ("expert",) for k, a in pairs)


# -- manual tactics and schedule semantics -------------------------------------------------
def test_shard_by_glob_and_regex_and_specs():
    step, args = gpt.make_train_step(gpt.GPTConfig())
    prog = partir.lift(step, *args)
    mesh = MeshSpec.of(data=2, model=4)
    res = T.apply_schedule(prog, mesh, [T.Shard("params/layers/*/mlp/w1", 1, "model"),
                                        T.Shard(r"re:\['attn'\]\['wq'\]$", 1, "model")])
    assert res.partitioning.tiling("params['layers'][1]['mlp']['w2']") == partir.Tiling((("model",), ()))
    assert [prog.name(d.value) for d in res.history[0].decisions] == [
        "params['layers'][0]['mlp']['w1']", "params['layers'][1]['mlp']['w1']"]
    specs = {"layers": [{"mlp": {"w1": P(None, "model")}}, {"mlp": {"w1": P(None, "model")}}]}
    from_specs = T.apply_schedule(prog, mesh, [T.Specs(specs, arg="params")])
    for v in prog.match_inputs("params/layers/*/mlp/*"):
        assert from_specs.partitioning.tiling(v) == res.partitioning.tiling(v)


def test_pattern_without_match_lists_near_misses():
    step, args = gpt.make_train_step(gpt.GPTConfig())
    with pytest.raises(T.TacticError, match=r"matches no input; near misses: params\['layers'\]\[0\]\['mlp'\]\['w1'\]"):
        _plan(step, args, MeshSpec.of(model=8), [T.Shard("params/layers/0/mlp/W1", 1, "model")])


def test_replicate_pins_against_later_tactics():
    step, args = mlp.make_train_step(mlp.MLPConfig())
    res = _plan(step, args, MeshSpec.of(model=8), [T.Replicate("params/w2"), T.Shard("params/w1", 1, "model")])
    part = res.partitioning
    assert part.tiling("params['w2']").is_replicated and part.tiling("opt_state[0].mu['w2']").is_replicated
    assert part.tiling("params['w1']") == partir.Tiling(((), ("model",)))


def test_history_snapshots_and_best_effort():
    step, args = gpt.make_train_step(gpt.GPTConfig())
    prog = partir.lift(step, *args)
    mesh = MeshSpec.of(data=2, model=4)
    schedule = [T.DataParallel("data"), T.SequenceParallel("model"), T.Megatron("model")]
    with pytest.raises(T.TacticError, match="SequenceParallel"):
        T.apply_schedule(prog, mesh, schedule)
    res = T.apply_schedule(prog, mesh, schedule, best_effort=True)
    assert [s.skipped is not None for s in res.history] == [False, True, False]
    dp, sp, meg = (s.partitioning for s in res.history)
    assert dp.key() == sp.key() != meg.key()  # the skipped step changed nothing
    assert all(d.source == "Megatron('model')" for d in res.history[2].decisions)
    assert "batch inputs" in res.describe() and "skipped" in res.describe()


def test_failed_tactic_does_not_half_apply():
    step, args = gpt.make_train_step(gpt.GPTConfig())
    prog = partir.lift(step, *args)
    mesh = MeshSpec.of(data=2, model=4)
    base = T.apply_schedule(prog, mesh, [T.DataParallel("data")]).partitioning
    # The first pattern applies, the second fails: nothing of the Shard tactics remains.
    bad = T.apply_schedule(prog, mesh, [T.Shard("params/head/w", 1, "model"), T.Shard("params/nope", 0, "model")],
                           start=base, best_effort=True)
    assert bad.history[0].skipped is None and bad.history[1].skipped
    assert bad.history[1].partitioning.key() == bad.history[0].partitioning.key()
    with pytest.raises(T.TacticError):
        T.apply_schedule(prog, mesh, [T.Shard("params/*", 5, "model")], start=base)
    assert base.key() == T.apply_schedule(prog, mesh, [], start=base).partitioning.key()


def test_schedule_rejects_non_tactics():
    step, args = mlp.make_train_step(mlp.MLPConfig())
    with pytest.raises(T.TacticError, match="must be tactics"):
        _plan(step, args, MeshSpec.of(model=8), ["megatron"])


def test_a_steps_decisions_include_those_of_the_tactics_it_delegates_to():
    step, args = mlp.make_train_step(mlp.MLPConfig(n_layers=2), abstract=True)
    res = _plan(step, args, MeshSpec.of(data=8), [T.FSDP("data")])
    sources = {d.source for d in res.history[0].decisions}
    assert sources == {"DataParallel('data')", "ZeRO('data')"}  # FSDP is DataParallel then ZeRO
    assert len(res.history[0].decisions) == len(res.partitioning.decisions)


# -- identity and context ------------------------------------------------------------------
def test_tactic_identity_holds_every_compared_setting():
    auto = search.AutomaticPartition
    assert auto().identity() == auto(progress=print).identity()  # a callback is no setting
    assert auto(memory_limit=1).identity() != auto().identity()
    assert auto(max_episodes=5).identity() != auto().identity()  # str() shows neither
    assert str(auto(max_episodes=5)) == str(auto())
    dev = search.get_device("h100")
    assert auto(device=dev).identity()["fields"]["device"] == {"DeviceSpec": json.loads(json.dumps(dev.to_dict()))}
    specs = T.Specs({"w": P("data", ("x", "y"), None)}, arg="params")
    assert specs.identity() == {"tactic": "Specs", "fields": {
        "specs": {"w": {"PartitionSpec": ["data", ["x", "y"], None]}}, "arg": "params"}}
    assert specs.identity() != T.Specs({"w": P("model")}, arg="params").identity()
    json.dumps(specs.identity(), sort_keys=True)
    with pytest.raises(T.TacticError, match=r"Specs.specs\['w'\] is a object .* tactic's identity cannot hold"):
        T.Specs({"w": object()}, arg="params").identity()


def test_context_rolls_back_what_was_added():
    ctx = T.Context()
    ctx.blocks["model"] = ["a"]
    mark = ctx.mark()
    ctx.blocks["model"].append("b")
    ctx.blocks["data"] = ["c"]
    ctx.search.append("result")
    ctx.rollback(mark)
    assert ctx.blocks == {"model": ["a"]} and ctx.search == []
    assert ctx.child() == T.Context()


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama", "convnet", "nnx_mlp", "linen_mlp", "equinox_mlp"])
def test_fsdp_and_megatron_in_either_order_give_one_plan(name):
    from examples import REGISTRY

    step, args = REGISTRY[name]()
    prog = partir.lift(step, *args)
    mesh = MeshSpec.of(data=2, model=4)
    tp_first = T.apply_schedule(prog, mesh, [T.Megatron("model"), T.FSDP("data")])
    fsdp_first = T.apply_schedule(prog, mesh, [T.FSDP("data"), T.Megatron("model")])
    specs = [[str(r.partitioning.tiling(v)) for v in prog.inputs] for r in (tp_first, fsdp_first)]
    assert specs[0] == specs[1]
    assert [str(s.tactic) for s in fsdp_first.history] == ["Megatron('model')", "FSDP('data')"]
    assert "applied after Megatron('model')" in fsdp_first.history[1].notes[0]
    if name == "mlp":  # and the plan computes what the program computes
        partir.check_equivalence(step, args, fsdp_first.partitioning, rtol=2e-5, atol=2e-6)


def test_tactics_on_one_axis_keep_their_order():
    order = T.applied_order([T.FSDP("model"), T.Megatron("model"), T.ZeRO("data", 1), T.SequenceParallel("model")])
    assert [str(t) for t, _ in order] == ["FSDP('model')", "Megatron('model')", "SequenceParallel('model')",
                                         "ZeRO('data', stage=1)"]
