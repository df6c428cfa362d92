"""Pipeline parallelism: the layers of a layer scan as stages over a mesh axis, the
batch in microbatches. A pipelined plan computes what plain `jax.jit` computes (loss,
updated parameters and Adam moments, i.e. the gradients), composed with data
parallelism on the other axis; plans the pipeline cannot run are refused with the
reason before anything is lowered."""

import collections
import io
import json
import dataclasses
import functools

import jax
import numpy as np
import pytest

import automap
import partir
import search
import tactics as T
from examples import gpt, llama
from partir import MeshSpec
from partir._hlo import reachable
from automap._explain import explain_saved
from rich.console import Console

EPS = 1e-3  # Adam eps large enough that near-zero gradients cannot flip updates
#: A GPT small enough to compile quickly, deep enough for 4 stages.
TINY = gpt.GPTConfig(n_layers=4, d_model=16, n_heads=2, d_ff=32, vocab=32, seq_len=8, batch=16, scan_layers=True,
                     adam_eps=EPS)


#: The Llama example as small, in scan form.
TINY_LLAMA = llama.LlamaConfig(n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, vocab=32, seq_len=8,
                               batch=16, scan_layers=True, adam_eps=EPS)


@functools.cache
def _gpt(config=TINY):
    step, args = (llama if isinstance(config, llama.LlamaConfig) else gpt).make_train_step(config)
    return step, args, partir.lift(step, *args)


def _mesh(stages: int) -> MeshSpec:
    return MeshSpec.of(data=8 // stages, stage=stages)


def _plan(stages: int, microbatches: int, config=TINY, others=None, mesh=None):
    """`others` (default: DataParallel over 'data'), then a Pipeline over 'stage'."""
    _, _, prog = _gpt(config)
    others = [T.DataParallel("data")] if others is None else others
    schedule = others + [T.Pipeline("stage", microbatches=microbatches)]
    return T.apply_schedule(prog, mesh or _mesh(stages), schedule).partitioning


def _same_step(part, config=TINY):
    """One step of the shard_map lowering of `part` and of `jax.jit(step)` agree on every
    output (parameters, optimizer state, loss)."""
    step, args, prog = _gpt(config)
    ours = partir.lower(part, backend="shard_map")(*args)
    theirs = jax.jit(step)(*args)
    for name, a, b in zip(prog.output_names, jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6, err_msg=name)


# In `make test-slow` (5 s): the default run holds the plan of 4 stages and 4 microbatches
# to jax.jit under the shard_map lowering in test_a_saved_pipelined_plan_loads_and_runs_as_it_was_made,
# and under the jit lowering in test_the_jit_lowering_computes_what_jit_computes_with_the_modeled_collectives.
@pytest.mark.parametrize("stages,microbatches", [pytest.param(2, 2, marks=pytest.mark.slow),
                                                 pytest.param(4, 4, marks=pytest.mark.slow)])
def test_pipelined_gpt_computes_what_jit_computes(stages, microbatches):
    _same_step(_plan(stages, microbatches))


@pytest.mark.slow
@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 2), (4, 8), (4, 1)])
def test_pipelined_gpt_computes_what_jit_computes_more(stages, microbatches):
    _same_step(_plan(stages, microbatches))


@pytest.mark.slow
@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8)])
def test_pipelined_llama_computes_what_jit_computes(stages, microbatches):
    _same_step(_plan(stages, microbatches, TINY_LLAMA), TINY_LLAMA)


#: Pipelines composed with other tactics on the other axes: (config, tactics, mesh).
COMPOSED = {
    "llama-dp-megatron": (TINY_LLAMA, [T.DataParallel("data"), T.Megatron("model")], MeshSpec.of(data=2, model=2, stage=2)),
    "llama-megatron": (TINY_LLAMA, [T.Megatron("data")], _mesh(4)),
    "gpt-fsdp": (TINY, [T.FSDP("data")], _mesh(4)),
    "gpt-user-remat": (dataclasses.replace(TINY, remat=True), None, _mesh(4)),
}


# Llama with DP + Megatron runs in the default run through test_compiled_collectives_are_exactly_the_modeled_ones
# below (compiled, its collectives the modeled ones), with FSDP through
# test_a_stage_moves_its_weights_and_gradients_once_a_step_through_the_users_checkpoint
# (numerics too), GPT with FSDP through tests/test_pipeline_remat.py's test of its stage's
# weights gathered once a step.
@pytest.mark.slow
@pytest.mark.parametrize("case", list(COMPOSED))
def test_pipelines_compose_with_other_tactics(case):
    config, others, mesh = COMPOSED[case]
    _same_step(_plan(mesh.size("stage"), 2, config, others, mesh), config)


def test_each_stage_holds_its_layers_parameters_and_optimizer_state():
    part = _plan(4, 2)
    prog = part.program
    for v in prog.inputs + prog.outputs:
        name = prog.name(v)
        if "['layers']" in name:
            assert part.tiling(v).dims[0] == ("stage",), name


def test_more_stages_than_layers_are_refused():
    _, _, prog = _gpt()
    with pytest.raises(T.TacticError, match="8 stages over 'stage' are more than the 4 layers"):
        T.apply_schedule(prog, MeshSpec.of(data=1, stage=8), [T.Pipeline("stage", microbatches=1)])


def test_microbatches_that_do_not_divide_a_devices_batch_are_refused():
    _, _, prog = _gpt()
    with pytest.raises(T.TacticError, match="microbatches"):
        T.apply_schedule(prog, _mesh(2), [T.DataParallel("data"), T.Pipeline("stage", microbatches=8)])


def test_an_unknown_schedule_is_refused_listing_the_known_ones():
    with pytest.raises(T.TacticError, match="gpipe"):
        T.Pipeline("stage", microbatches=2, schedule="zigzag")


def test_a_program_without_a_layer_scan_is_refused():
    config = dataclasses.replace(TINY, scan_layers=False)
    _, _, prog = _gpt(config)
    with pytest.raises(T.TacticError, match="no layer scan"):
        T.apply_schedule(prog, _mesh(2), [T.Pipeline("stage", microbatches=2)])


def test_a_plan_splitting_the_layers_work_over_the_stage_axis_is_refused():
    _, _, prog = _gpt()
    with pytest.raises(T.TacticError, match="cannot pipeline the layer scan"):
        T.apply_schedule(prog, _mesh(2), [T.DataParallel("stage"), T.Pipeline("stage", microbatches=2)])


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == "dp" else pytest.mark.slow)
                                  for c in ["dp", *COMPOSED]])
def test_the_jit_lowering_computes_what_jit_computes_with_the_modeled_collectives(case):
    """Under the jit lowering the pipelined scans run as shard_map regions: the step
    equals plain jax.jit's and XLA's collectives are exactly the modeled ones."""
    config, others, mesh = COMPOSED.get(case, (TINY, None, _mesh(4)))
    part = _plan(mesh.size("stage"), 4 if case == "dp" else 2, config, others, mesh)
    step, args, prog = _gpt(config)
    lowered = partir.lower(part)
    ours, theirs = lowered(*args), jax.jit(step)(*args)
    for name, a, b in zip(prog.output_names, jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6, err_msg=name)
    text = lowered.lower(*args).compile().as_text()
    compiled = partir.collective_buffers(partir.collectives(text, mesh.jax_mesh()), reduce_scatter=False)
    modeled = collections.Counter((c.kind, c.axes, int(c.bytes)) for c in search.CostModel(part, "cpu").cost().collectives)
    assert compiled == modeled


def test_a_tactic_leaving_a_pipeline_no_whole_microbatches_is_refused():
    _, _, prog = _gpt()
    schedule = [T.DataParallel("data"), T.Pipeline("stage", microbatches=4), T.DataParallel("stage")]
    with pytest.raises(T.TacticError, match="DataParallel\\('stage'\\).*microbatch"):
        T.apply_schedule(prog, _mesh(4), schedule)


# -- the search ------------------------------------------------------------------------
#: Deep and wide for its batch, its stage axis across nodes (the mesh's major axis on
#: H100s): data parallelism over it all-reduces every gradient over the slow links.
DEEP = gpt.GPTConfig(n_layers=16, d_model=2048, n_heads=16, d_ff=8192, vocab=1024, seq_len=512, batch=64,
                     scan_layers=True)


@pytest.mark.parametrize("memory_limit,pipelined", [(16e9, True), (80e9, False)])
def test_the_search_pipelines_where_the_model_says_it_wins(memory_limit, pipelined):
    """With 16 GB, data parallelism over the stage axis does not fit (19.5 GB) and FSDP
    or Megatron over the slow links cost 4x the pipeline's step: the search pipelines.
    With 80 GB, data parallelism is faster than the pipeline's bubble: it does not."""
    step, args = gpt.make_train_step(DEEP, abstract=True)
    prog = partir.lift(step, *args)
    auto = search.AutomaticPartition(axes=("stage",), pipelines=(8,), memory_limit=memory_limit, max_episodes=30,
                                     device="h100")
    part = T.apply_schedule(prog, MeshSpec.of(stage=4, data=8), [T.DataParallel("data"), auto]).partitioning
    assert bool(part.pipelines) == pipelined


# -- the cost model ------------------------------------------------------------------------
@pytest.mark.parametrize("stages,microbatches", [pytest.param(2, 2, marks=pytest.mark.slow), (4, 4)])
def test_modeled_stage_collectives_are_the_compiled_ones(stages, microbatches):
    """Collectives over the stage axis in the compiled program, per (kind, axes, bytes)
    and counted once per loop body as HLO holds them, equal the modeled ones."""
    part = _plan(stages, microbatches)
    _, args, prog = _gpt()
    text = partir.lower(part, backend="shard_map").lower(*args).compile().as_text()
    compiled = partir.collective_buffers(partir.collectives(text, part.mesh.jax_mesh()), reduce_scatter=False)
    cost = search.pipeline_cost(part, part.pipelines[0], "cpu")
    modeled = collections.Counter((c.kind, c.axes, int(c.bytes)) for c in cost.collectives)
    assert modeled == collections.Counter({k: n for k, n in compiled.items() if k[1] == ("stage",)})
    assert cost.bubble == (stages - 1) / (microbatches + stages - 1)
    batch, seq, width = TINY.batch // (8 // stages) // microbatches, TINY.seq_len, TINY.d_model
    assert cost.p2p_bytes == (batch * seq * width * 4,) * 2  # one f32 activation (cotangent) per boundary


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in ("dp", "llama-dp-megatron") else pytest.mark.slow)
                                  for c in ["dp", *COMPOSED]])
def test_compiled_collectives_are_exactly_the_modeled_ones(case):
    """Every collective of the compiled pipelined program, per (kind, axes, bytes),
    counted once per loop body as HLO holds them, is one the cost model lists: the
    stage permutes, the layers' moves on microbatches, the deferred reductions."""
    config, others, mesh = COMPOSED.get(case, (TINY, None, _mesh(4)))
    part = _plan(mesh.size("stage"), 4 if case == "dp" else 2, config, others, mesh)
    _, args, prog = _gpt(config)
    free = search.materialization(prog).from_scalars
    text = partir.lower(part, backend="shard_map", free=free).lower(*args).compile().as_text()
    compiled = partir.collective_buffers(partir.collectives(text, mesh.jax_mesh()), reduce_scatter=False)
    modeled = collections.Counter((c.kind, c.axes, int(c.bytes)) for c in search.CostModel(part, "cpu").cost().collectives)
    assert compiled and compiled == modeled


def test_weight_gradients_are_reduced_over_the_data_axis_once_per_step():
    """The microbatches' weight gradients are summed on each device first, then
    all-reduced over the data axis once, outside the tick loops (not once per
    microbatch, layer and tick)."""
    part = _plan(4, 4)
    _, args, _ = _gpt()
    text = partir.lower(part, backend="shard_map").lower(*args).compile().as_text()
    data = [c for c in partir.collectives(text, part.mesh.jax_mesh()) if c.axes == ("data",)]
    assert data and not [c for c in data if c.in_loop]


def _moves_once(part, config, mesh, backend="shard_map"):
    """`part` lowered by `backend` computes what jax.jit computes and XLA's collectives
    are exactly the modeled ones, among which the moves over `data` of the layers'
    stacked inputs and outputs (weights, their gradients) run once a step. Under GPipe,
    XLA runs no gather or reduce-scatter over `data` in a loop that sends carries over
    `stage` (a tick loop, with what it calls: 1F1B's also runs the head, whose weights
    move per microbatch) and some outside; with several layers a stage too, the layer
    norms' scales broadcast to [1, 1, D] once before the loop and gathered so (with
    one, XLA would hoist a per-tick gather out of the loop itself)."""
    step, args, prog = _gpt(config)
    free = search.materialization(prog).from_scalars
    lowered = partir.lower(part, backend="shard_map", free=free) if backend == "shard_map" else partir.lower(part)
    for name, a, b in zip(prog.output_names, jax.tree_util.tree_leaves(lowered(*args)),
                          jax.tree_util.tree_leaves(jax.jit(step)(*args))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6, err_msg=name)
    text = lowered.lower(*args).compile().as_text()
    cols = partir.collectives(text, mesh.jax_mesh())
    modeled = search.CostModel(part, "cpu").cost().collectives
    assert partir.collective_buffers(cols, reduce_scatter=False) == collections.Counter(
        (c.kind, c.axes, int(c.bytes)) for c in modeled)
    pipe = part.pipelines[0]
    stacked = {v for call in pipe.scans.calls
               for v, outer in zip(prog.regions[call.body].invars[-len(call.xs):], call.xs)
               if outer not in pipe.scans.forward.ys}  # (the weights, not the residuals)
    bodies = {r for call in pipe.scans.calls for r in partir.body_regions(prog, call.body)}
    # (a weight's gather, a gradient's reduction, or any gather charged at an op in the
    # layers: 1F1B's backward reads the broadcast norm scales the forward keeps from the
    # forward's gathered block, `partir.onef_gathered`, not from its ring, gathered per tick)
    layers = [c for c in modeled if c.axes == ("data",) and (c.value in stacked or prog.ops[c.op].region in bodies
                                                           and (c.gradient or c.kind == partir.Kind.ALL_GATHER))]
    assert layers and all(c.count == 1 for c in layers)
    ticks = reachable(text, {c.computation for c in cols if c.kind == partir.Kind.COLLECTIVE_PERMUTE})
    for kind in (partir.Kind.ALL_GATHER, partir.Kind.REDUCE_SCATTER):
        moves = [c for c in cols if c.kind == kind and c.axes == ("data",)]
        assert moves, kind
        if pipe.schedule == "gpipe":  # (1F1B's tick loop runs the head too, whose weights move per microbatch)
            assert not [c for c in moves if c.computation in ticks], kind


# The default run holds the same guarantee on Llama through the user's checkpoint (next test).
@pytest.mark.slow
def test_a_stage_moves_its_fsdp_weights_and_gradients_once_a_step_not_per_microbatch():
    """Under FSDP a stage gathers its layers' weights before its tick loops and
    reduce-scatters their accumulated gradients after, not in every tick (once per
    microbatch); the step equals jax.jit's and XLA's collectives are exactly the
    modeled ones (each charged once, on the stage's layers)."""
    config, others, mesh = COMPOSED["gpt-fsdp"]
    _moves_once(_plan(4, 4, config, others, mesh), config, mesh)


#: Llama with each layer under the user's `jax.checkpoint` (as its LLAMA3 configs): the
#: backward scan's weights are read, and their gradients made, in a nested region.
TINY_LLAMA_REMAT = dataclasses.replace(TINY_LLAMA, remat=True)


def test_a_stage_moves_its_weights_and_gradients_once_a_step_through_the_users_checkpoint():
    """With the layers under the user's `jax.checkpoint`, the stage still gathers its
    weights once before each tick loop (handed into the checkpoint's region as
    gathered, the norm scales broadcast there once too) and reduce-scatters their
    gradients, made inside it, once after, as without the checkpoint (`_moves_once`:
    two layers a stage, so XLA would not hoist a per-tick gather itself)."""
    _moves_once(_plan(2, 4, TINY_LLAMA_REMAT, [T.FSDP("data")]), TINY_LLAMA_REMAT, _mesh(2))


#: (backend, the tactics on `data`, schedule, config, stages) of the slow cases of
#: `_moves_once`: "uneven-fsdp" and "llama-remat-uneven-fsdp", 3 layers over 2 stages
#: (the 405B-shaped rows' uneven stages); the other Llama cases two layers a stage,
#: their RMSNorm scales broadcast and gathered once before each tick loop (the "remat"
#: ones under the user's `jax.checkpoint`, as the default test's).
MOVED_ONCE = {
    "jit-fsdp": ("jit", [T.FSDP("data")], "gpipe", TINY, 4),
    "zero1-dp": ("shard_map", [T.DataParallel("data"), T.ZeRO("data", stage=1)], "gpipe", TINY, 4),
    "fsdp-1f1b": ("shard_map", [T.FSDP("data")], "1f1b", TINY, 4),
    "uneven-fsdp": ("shard_map", [T.FSDP("data")], "gpipe", dataclasses.replace(TINY, n_layers=3), 2),
    "llama-fsdp": ("shard_map", [T.FSDP("data")], "gpipe", TINY_LLAMA, 2),
    "llama-jit-fsdp": ("jit", [T.FSDP("data")], "gpipe", TINY_LLAMA, 2),
    "llama-remat-jit-fsdp": ("jit", [T.FSDP("data")], "gpipe", TINY_LLAMA_REMAT, 2),
    "llama-remat-fsdp-1f1b": ("shard_map", [T.FSDP("data")], "1f1b", TINY_LLAMA_REMAT, 2),
    "llama-remat-uneven-fsdp": ("shard_map", [T.FSDP("data")], "gpipe",
                                dataclasses.replace(TINY_LLAMA_REMAT, n_layers=3), 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MOVED_ONCE))
def test_stages_move_weights_and_gradients_once_a_step_in_each_lowering_and_schedule(case):
    backend, others, schedule, config, stages = MOVED_ONCE[case]
    mesh = _mesh(stages)
    _, _, prog = _gpt(config)
    part = T.apply_schedule(prog, mesh, others + [T.Pipeline("stage", microbatches=4, schedule=schedule)]).partitioning
    _moves_once(part, config, mesh, backend)


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True])
def test_a_stage_casts_and_gathers_its_weights_once_a_step_where_its_layers_cast_them(remat):
    """Llama computing in bfloat16 casts its float32 weights inside each layer and
    gathers the cast: the stage casts and gathers them once before each tick loop (the
    model charges each gather once), keeps them for the backward pass cut from the
    gathered block, and the step equals jax.jit's to bfloat16's precision; under the
    user's `jax.checkpoint` (`remat`) too, where the backward scan hands the cast weights
    into the checkpoint's region and broadcasts the norm scales inside it. (XLA:CPU
    moves bfloat16 in float32, so its collectives' bytes are not the model's here: the
    float32 cases check those; with one layer a stage XLA would hoist the per-tick
    gathers out of the loop itself, so the model's count is what shows the change.)"""
    config, mesh = dataclasses.replace(TINY_LLAMA, dtype=jax.numpy.bfloat16, remat=remat), _mesh(4)
    step, args, prog = _gpt(config)
    part = _plan(4, 4, config, [T.FSDP("data")], mesh)
    bodies = [prog.regions[call.body] for call in part.pipelines[0].scans.calls]
    casts = {r for body in bodies for v in body.invars for o in prog.users[v]
             if prog.ops[o].primitive == "convert_element_type" for r in prog.ops[o].results}
    gathers = [c for c in search.CostModel(part, "cpu").cost().collectives
               if c.value in casts and c.kind == partir.Kind.ALL_GATHER]
    assert gathers and all(c.count == 1 for c in gathers)  # (not once per microbatch and layer)
    lowered = partir.lower(part, backend="shard_map")
    for name, a, b in zip(prog.output_names, jax.tree_util.tree_leaves(lowered(*args)),
                          jax.tree_util.tree_leaves(jax.jit(step)(*args))):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2, atol=1e-3,
                                   err_msg=name)
    text = lowered.lower(*args).compile().as_text()
    cols = partir.collectives(text, mesh.jax_mesh())
    ticks = reachable(text, {c.computation for c in cols if c.kind == partir.Kind.COLLECTIVE_PERMUTE})
    assert not [c for c in cols if c.kind == partir.Kind.ALL_GATHER and c.computation in ticks]


def test_each_stage_stores_its_share_of_the_layer_stack():
    """Per device, the stage keeps 1/S of the layers' parameters and Adam moments."""
    part = _plan(4, 2)
    prog = part.program
    layers = sum(prog.values[v].nbytes for v in prog.inputs if "['layers']" in prog.name(v))
    assert search.pipeline_cost(part, part.pipelines[0], "cpu").stage_bytes == layers / 4


@pytest.mark.slow  # (the modeled share alone: test_each_stage_stores_its_share_of_the_layer_stack)
def test_the_compiled_stage_holds_the_modeled_share_of_the_layer_stack():
    """XLA's per-device arguments: the modeled stage bytes of the layer stack plus the
    blocks of every other input."""
    part = _plan(4, 2)
    _, args, prog = _gpt()
    compiled = partir.lower(part, backend="shard_map").lower(*args).compile()
    cost = search.pipeline_cost(part, part.pipelines[0], "cpu")
    rest = sum(float(np.prod(part.tiling(v).shard_shape(prog.values[v].shape, part.mesh))) * prog.values[v].nbytes
               / max(1, int(np.prod(prog.values[v].shape))) for v in prog.inputs if "['layers']" not in prog.name(v))
    assert compiled.memory_analysis().argument_size_in_bytes == cost.stage_bytes + rest


def test_the_plan_explains_its_stages_schedule_and_bubble():
    step, args, _ = _gpt()
    plan = automap.partition(step, mesh={"data": 2, "stage": 4}, lowering="shard_map", device="cpu",
                             schedule=[T.DataParallel("data"), T.Pipeline("stage", microbatches=4)])(*args)
    out = Console(file=io.StringIO(), width=250)
    plan.explain(out)
    text = out.file.getvalue()
    assert "schedule gpipe, 4 microbatches, modeled bubble 43%;" in text
    assert "│     3 │ 3..3   │ 3, 7" in text  # the last stage: layer 3 on the devices at stage index 3


def test_a_pipeline_is_undone_and_replayed_with_the_actions_around_it():
    """What the search relies on: rollback takes the pipeline back, a delta replays it."""
    _, _, prog = _gpt()
    part = T.apply_schedule(prog, _mesh(2), [T.DataParallel("data")]).partitioning
    before, mark = part.key(), part.mark()
    T.Pipeline("stage", microbatches=2).apply(part, T.Context())
    delta, after = part.delta(mark, before), part.key()
    part.rollback(mark)
    assert not part.pipelines and part.key() == before
    part.replay(delta)
    assert len(part.pipelines) == 1 and part.key() == after


def test_a_cost_model_follows_a_pipeline_added_after_it_was_made():
    _, _, prog = _gpt()
    part = T.apply_schedule(prog, _mesh(4), [T.DataParallel("data")]).partitioning
    model = search.CostModel(part, "cpu")
    model.cost()
    T.Pipeline("stage", microbatches=4).apply(part, T.Context())
    fresh = search.CostModel(part.copy(), "cpu").cost()
    assert model.cost().collectives == fresh.collectives and model.cost().step_time == fresh.step_time


def test_a_forward_pass_alone_is_pipelined():
    """A program without a backward pass (evaluation): only the forward scan runs as
    stages."""
    params, batch = gpt.init(TINY, jax.random.PRNGKey(0))
    fn = functools.partial(gpt.loss_fn, config=TINY)
    prog = partir.lift(fn, params, batch)
    schedule = [T.DataParallel("data", batch_argnums=1), T.Pipeline("stage", microbatches=2, batch_argnums=1)]
    part = T.apply_schedule(prog, _mesh(4), schedule).partitioning
    assert part.pipelines[0].scans.backward is None
    np.testing.assert_allclose(np.asarray(partir.lower(part, backend="shard_map")(params, batch)),
                               np.asarray(jax.jit(fn)(params, batch)), rtol=2e-5)


def peaks(part, args) -> tuple[float, float]:
    """(the modeled peak, XLA's: temp + arguments + outputs - alias) of `part`'s
    shard_map lowering run on `args`."""
    ma = partir.lower(part, backend="shard_map").lower(*args).compile().memory_analysis()
    xla = ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
    return search.CostModel(part, "cpu").cost().memory_peak, xla


@pytest.mark.slow  # (the default run: test_the_head_runs_per_microbatch_so_its_logits_leave_the_peak)
def test_more_microbatches_lower_the_modeled_peak_as_they_lower_xlas():
    """A pipelined layer's temporaries hold one microbatch: the modeled peak falls with
    M as the compiled program's does (the layers' values dominate a longer sequence),
    and is XLA's within 20% (S=4: 1084 -> 920 KB against 1167 -> 975 KB from M=1 to
    M=4; 0.75 of XLA's before the tick loop's own buffers were modeled)."""
    config = dataclasses.replace(TINY, seq_len=32, d_ff=64)
    _, args, prog = _gpt(config)
    (model_1, xla_1), (model_4, xla_4) = both = [peaks(_plan(4, m, config), args) for m in (1, 4)]
    assert xla_4 < xla_1 and model_4 < model_1
    assert all(0.8 < model / xla < 1.2 for model, xla in both)


#: Uneven stages: 3 layers over 2 (tests/test_pipeline_uneven.py).
THREE = dataclasses.replace(TINY, n_layers=3)
#: Unrolled layers, which automap rolls into the scan form (tests/test_pipeline_unrolled.py).
UNROLLED = dataclasses.replace(TINY, scan_layers=False)


@pytest.mark.parametrize("config,data,stages,microbatches", [
    (TINY, 2, 4, 4), pytest.param(THREE, 4, 2, 2, marks=pytest.mark.slow, id="uneven"),
    pytest.param(UNROLLED, 4, 2, 2, marks=pytest.mark.slow, id="unrolled")])
def test_a_saved_pipelined_plan_loads_and_runs_as_it_was_made(tmp_path, config, data, stages, microbatches):
    step, args, prog = _gpt(config)
    plan = automap.partition(step, mesh={"data": data, "stage": stages}, lowering="shard_map", device="cpu",
                             schedule=[T.DataParallel("data"), T.Pipeline("stage", microbatches=microbatches)])(*args)
    plan.save(tmp_path / "plan.json")
    loaded = automap.load_plan(tmp_path / "plan.json").bind(step, *args)
    assert loaded.partitioning.pipelines == plan.partitioning.pipelines
    assert loaded.partitioning.key() == plan.partitioning.key()
    loaded.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == (tmp_path / "plan.json").read_bytes()
    ours, theirs = loaded.jit()(*args), jax.jit(step)(*args)
    for name, a, b in zip(prog.output_names, jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6, err_msg=name)


def test_a_saved_plan_file_shows_its_pipeline(tmp_path):
    step, args, _ = _gpt()
    plan = automap.partition(step, mesh={"data": 2, "stage": 4}, lowering="shard_map", device="cpu",
                             schedule=[T.DataParallel("data"), T.Pipeline("stage", microbatches=4)])(*args)
    plan.save(tmp_path / "plan.json")
    out = Console(file=io.StringIO(), width=250)
    explain_saved(json.loads((tmp_path / "plan.json").read_text()), out)
    assert "in stages over 'stage', 4 microbatches, schedule gpipe" in out.file.getvalue()


@pytest.mark.slow  # 7 s: two compiled pipelines
def test_the_head_runs_per_microbatch_so_its_logits_leave_the_peak():
    """The region between the layer scans (final norm, head, loss and their backward)
    runs one microbatch at a time: with a vocabulary whose logits dominate, XLA's peak
    and the modeled one fall with M (S=2: 824 -> 624 KB and 751 -> 603 KB from M=1 to
    M=4; the head on the whole batch kept both flat), the model within 20% of XLA."""
    config = dataclasses.replace(TINY, vocab=512)
    _, args, _ = _gpt(config)
    (model_1, xla_1), (model_4, xla_4) = both = [peaks(_plan(2, m, config), args) for m in (1, 4)]
    assert xla_4 < 0.85 * xla_1 and model_4 < 0.85 * model_1
    assert all(0.8 < model / xla < 1.2 for model, xla in both)


def _max_loss_step(params, x):
    """A layer scan whose loss is the largest example's: no sum over the batch."""
    def layer(h, w):
        return jax.numpy.tanh(h @ w), None

    def loss(p):
        h, _ = jax.lax.scan(layer, x, p)
        return jax.numpy.max(jax.numpy.sum(h * h, axis=-1))

    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def test_a_loss_that_is_no_sum_over_the_batch_is_refused():
    """The head runs per microbatch, so the loss must be a sum over the batch (a mean's
    division included); a max is refused before anything is lowered, naming it."""
    params, x = np.ones((4, 8, 8), np.float32) / 8, np.ones((16, 8), np.float32)
    prog = partir.lift(_max_loss_step, params, x)
    with pytest.raises(T.TacticError, match=r"head and loss.*max over the batch.*only sums .*sum or mean over the batch"):
        T.apply_schedule(prog, _mesh(2), [T.DataParallel("data", batch_argnums=1),
                                          T.Pipeline("stage", microbatches=2, batch_argnums=1)])
