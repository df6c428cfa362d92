"""The circular pipeline schedule (`Pipeline(axis, microbatches=M, repeats=R)`): each
stage runs R non-contiguous chunks of the layers and a microbatch goes round the stages
R times. The step computes what plain `jax.jit` computes (loss, updated parameters,
Adam moments) in both lowerings; settings the schedule cannot run are refused before
any work."""

import collections
import dataclasses
import io
import json

import jax
import numpy as np
import pytest

import automap
import partir
import search
import tactics as T
from automap._explain import explain_saved
from automap._plot import figure
from partir import MeshSpec
from rich.console import Console
from test_pipeline import TINY, TINY_LLAMA, _gpt, _mesh

#: Deep enough for 4 stages of 2 repeats (8 chunks of one layer).
DEEP = dataclasses.replace(TINY, n_layers=8)
DEEP_LLAMA = dataclasses.replace(TINY_LLAMA, n_layers=8)


def _plan(stages: int, microbatches: int, repeats: int, config=TINY, others=None, mesh=None):
    """`others` (default: DataParallel over 'data'), then a circular Pipeline over 'stage'."""
    _, _, prog = _gpt(config)
    others = [T.DataParallel("data")] if others is None else others
    schedule = others + [T.Pipeline("stage", microbatches=microbatches, repeats=repeats)]
    return T.apply_schedule(prog, mesh or _mesh(stages), schedule).partitioning


def _same_step(part, config, backend):
    step, args, prog = _gpt(config)
    ours, theirs = partir.lower(part, backend=backend)(*args), jax.jit(step)(*args)
    for name, a, b in zip(prog.output_names, jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("microbatches,backend", [
    # The circular schedule's numerics run by default in
    # test_a_saved_circular_plan_loads_and_runs_as_it_was_made (2 microbatches, shard_map).
    pytest.param(2, "shard_map", marks=pytest.mark.slow), pytest.param(2, "jit", marks=pytest.mark.slow),
    # more microbatches than stages: they wait at the first stage for their next round
    pytest.param(4, "shard_map", marks=pytest.mark.slow),
])
def test_circular_gpt_computes_what_jit_computes(microbatches, backend):
    _same_step(_plan(2, microbatches, 2), TINY, backend)


@pytest.mark.slow
@pytest.mark.parametrize("stages,microbatches,config,backend", [
    (4, 4, DEEP, "shard_map"),
    (4, 8, DEEP, "jit"),
])
def test_circular_gpt_computes_what_jit_computes_more(stages, microbatches, config, backend):
    _same_step(_plan(stages, microbatches, 2, config), config, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["shard_map", "jit"])
def test_circular_llama_composes_with_data_parallel_and_megatron(backend):
    mesh = MeshSpec.of(data=2, model=2, stage=2)
    part = _plan(2, 2, 2, TINY_LLAMA, [T.DataParallel("data"), T.Megatron("model")], mesh)
    _same_step(part, TINY_LLAMA, backend)


def _megatron_over_the_stages():
    """The plan the search returns for the 405B-shaped Llama on 16384 H100s
    (benchmarks/pipeline_scale.py), small: Megatron + SP over model, FSDP over data, a
    circular pipeline over stage, then Megatron over stage too (the head and the
    embedding, which every stage runs, split over the stages)."""
    mesh = MeshSpec.of(data=2, stage=2, model=2)
    _, _, prog = _gpt(TINY_LLAMA)
    schedule = [T.Megatron("model"), T.SequenceParallel("model"), T.FSDP("data"),
                T.Pipeline("stage", microbatches=4, repeats=2), T.Megatron("stage")]
    return T.apply_schedule(prog, mesh, schedule).partitioning


def test_megatron_over_the_stage_axis_of_a_pipeline_is_costed_on_every_backend():
    # XLA:CPU's gathered copies (`gather_copies`) were sized on the real mesh with the
    # microbatched plan's layouts, whose microbatch axis is none of its axes: a crash.
    part = _megatron_over_the_stages()
    for device in ("cpu", "h100"):
        assert search.CostModel(part.copy(), device).cost().step_time > 0


@pytest.mark.slow
def test_megatron_over_the_stage_axis_of_a_pipeline_computes_what_jit_computes():
    _same_step(_megatron_over_the_stages(), TINY_LLAMA, "shard_map")


@pytest.mark.slow
@pytest.mark.parametrize("config,others", [(TINY, [T.FSDP("data")]), (dataclasses.replace(TINY, remat=True), None)],
                         ids=["fsdp", "user-checkpoint"])
def test_circular_gpt_composes_with_fsdp_and_the_users_checkpoint(config, others):
    """FSDP's parameters are gathered over 'data' before their chunks are exchanged over
    'stage'; the user's jax.checkpoint recomputes inside each chunk."""
    part = _plan(2, 2, 2, config, others)
    _same_step(part, config, "jit")
    compiled, modeled = _collectives(part, config, "jit")
    assert compiled == modeled


@pytest.mark.slow
def test_circular_llama_over_four_stages():
    _same_step(_plan(4, 4, 2, DEEP_LLAMA), DEEP_LLAMA, "shard_map")


# -- rematerialization inside the chunks ----------------------------------------------------
# In `make test-slow` (4 s a case): the default run holds the circular schedule's numerics in
# test_a_saved_circular_plan_loads_and_runs_as_it_was_made and a pipeline's recomputing
# stages in tests/test_pipeline_uneven.py and tests/test_pipeline_onef_remat.py.
@pytest.mark.parametrize("policy,first,backend", [
    pytest.param("full", True, "shard_map", marks=pytest.mark.slow),
    pytest.param("full", False, "jit", marks=pytest.mark.slow),
    pytest.param("dots", True, "jit", marks=pytest.mark.slow),
    pytest.param("dots", False, "shard_map", marks=pytest.mark.slow),
])
def test_circular_stages_rematerializing_their_chunks_compute_what_jit_computes(policy, first, backend):
    """Remat before or after the Pipeline: the forward ticks keep each unit's layer
    inputs in the stage's slot order, and each backward tick recomputes its chunk from
    them."""
    _, _, prog = _gpt()
    remat, pipeline = [T.Remat(policy)], [T.Pipeline("stage", microbatches=2, repeats=2)]
    schedule = [T.DataParallel("data")] + (remat + pipeline if first else pipeline + remat)
    part = T.apply_schedule(prog, _mesh(2), schedule).partitioning
    assert part.rematerialized and part.pipelines[0].repeats == 2
    _same_step(part, TINY, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["shard_map", "jit"])
def test_circular_remat_compiles_to_the_modeled_collectives(backend):
    """What is kept for recomputing is never exchanged: the compiled collectives stay
    the modeled ones."""
    part = _plan(2, 2, 2, TINY, [T.DataParallel("data"), T.Remat("full")])
    compiled, modeled = _collectives(part, TINY, backend)
    assert compiled == modeled


@pytest.mark.slow
@pytest.mark.parametrize("stages,microbatches,config", [(2, 4, TINY), (4, 4, DEEP)])
def test_circular_remat_with_waiting_microbatches_and_four_stages(stages, microbatches, config):
    """More microbatches than stages (they wait at the first stage between rounds), and
    four stages of two chunks each."""
    part = _plan(stages, microbatches, 2, config, [T.DataParallel("data"), T.Remat("full")])
    _same_step(part, config, "shard_map")


@pytest.mark.slow
def test_circular_remat_lowers_the_modeled_peak_as_it_lowers_xlas():
    """The layers' residuals give way to their inputs in flight, in the model and in
    the compiled program alike (GPT, 32 tokens, S=2, M=2, R=2)."""
    config = dataclasses.replace(TINY, seq_len=32, d_ff=64)
    _, args, _ = _gpt(config)
    peaks = []
    for others in ([T.DataParallel("data")], [T.DataParallel("data"), T.Remat("full")]):
        part = _plan(2, 2, 2, config, others)
        ma = partir.lower(part, backend="shard_map").lower(*args).compile().memory_analysis()
        xla = ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
        peaks.append((search.CostModel(part, "cpu").cost().memory_peak, xla))
    (model_plain, xla_plain), (model_full, xla_full) = peaks
    assert xla_full < xla_plain and model_full < model_plain


# -- the cost model ------------------------------------------------------------------------
def _collectives(part, config, backend):
    """(XLA's collectives, the modeled ones), per (kind, axes, bytes), counted once per
    loop body as HLO holds them."""
    _, args, _ = _gpt(config)
    free = search.materialization(part.program).from_scalars
    lowered = partir.lower(part, backend=backend, **({"free": free} if backend == "shard_map" else {}))
    text = lowered.lower(*args).compile().as_text()
    compiled = partir.collective_buffers(partir.collectives(text, part.mesh.jax_mesh()), reduce_scatter=False)
    return compiled, collections.Counter((c.kind, c.axes, int(c.bytes))
                                         for c in search.CostModel(part, "cpu").cost().collectives)


@pytest.mark.parametrize("stages,microbatches,repeats,config,backend", [
    (2, 2, 2, TINY, "shard_map"),
    pytest.param(4, 4, 2, DEEP, "shard_map", marks=pytest.mark.slow),  # each piece padded to S*ceil(R/S) chunks
    pytest.param(2, 2, 4, DEEP, "jit", marks=pytest.mark.slow),  # two chunks to each stage
])
def test_compiled_collectives_are_exactly_the_modeled_ones(stages, microbatches, repeats, config, backend):
    """The ring's collective-permutes (the last stage sends back to the first), the
    all-to-alls exchanging the layers' chunks in and out of the stage program, and
    the plan's other collectives: XLA's are the modeled ones."""
    part = _plan(stages, microbatches, repeats, config)
    compiled, modeled = _collectives(part, config, backend)
    kinds = {k[0] for k in compiled if k[1] == ("stage",)}
    assert {partir.Kind.ALL_TO_ALL, partir.Kind.COLLECTIVE_PERMUTE} <= kinds
    assert compiled == modeled


def test_the_modeled_bubble_falls_with_repeats():
    """(S-1)/(M*R+S-1) over M*R+S-1 ticks of a chunk each; a microbatch's carries cross
    a stage boundary R times as often per pass, the same bytes each time."""
    gpipe, circular = (search.pipeline_cost(p, p.pipelines[0], "cpu") for p in (_plan(2, 2, 1), _plan(2, 2, 2)))
    assert (gpipe.bubble, circular.bubble) == (1 / 3, 1 / 5)
    assert (gpipe.ticks, circular.ticks) == (3, 5)
    assert circular.p2p_bytes == gpipe.p2p_bytes
    permutes = [c for c in circular.collectives if c.kind == partir.Kind.COLLECTIVE_PERMUTE]
    assert permutes and all(c.count == 5 for c in permutes)


def test_residuals_stay_in_the_stages_order_between_the_passes():
    """Only parameters and gradients are exchanged: the residuals the forward pass
    stacks are read by the backward pass alone, in the order the stages hold them."""
    part = _plan(2, 2, 2)
    pipe = part.pipelines[0]
    kept = partir.kept_in_slots(part, pipe)
    assert {v for v in pipe.scans.forward.ys if v >= 0} <= kept
    cost = search.pipeline_cost(part, pipe, "cpu")
    exchanged = {part.program.name(c.value) for c in cost.collectives if c.kind == partir.Kind.ALL_TO_ALL}
    assert exchanged and not exchanged & {part.program.name(v) for v in kept}


# -- refusals ------------------------------------------------------------------------------
@pytest.mark.parametrize("stages,microbatches,repeats,config,others,match", [
    (2, 1, 2, TINY, None, "at least as many microbatches as stages"),
    (4, 4, 2, TINY, None, "4 stages x 2 repeats make more chunks than the 4 layers"),
])
def test_settings_the_circular_schedule_cannot_run_are_refused(stages, microbatches, repeats, config, others, match):
    with pytest.raises(T.TacticError, match=match):
        _plan(stages, microbatches, repeats, config, others)


def test_a_repeat_count_that_is_no_positive_integer_is_refused():
    with pytest.raises(T.TacticError, match="repeats"):
        T.Pipeline("stage", microbatches=2, repeats=0)


# -- the plan: explain, plan files, timeline -----------------------------------------------
def _circular_plan():
    step, args, _ = _gpt()
    return automap.partition(step, mesh={"data": 4, "stage": 2}, lowering="shard_map", device="cpu",
                             schedule=[T.DataParallel("data"),
                                       T.Pipeline("stage", microbatches=2, repeats=2)])(*args)


def test_the_plan_explains_which_layer_chunks_each_stage_holds():
    out = Console(file=io.StringIO(), width=250)
    _circular_plan().explain(out)
    text = out.file.getvalue()
    assert "schedule gpipe, 2 repeats (circular), 2 microbatches, modeled bubble 20%;" in text
    assert "│     0 │ 0..0, 2..2 │ 0, 2, 4, 6" in text and "│     1 │ 1..1, 3..3 │ 1, 3, 5, 7" in text


def test_a_saved_circular_plan_loads_and_runs_as_it_was_made(tmp_path):
    step, args, prog = _gpt()
    plan = _circular_plan()
    plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["pipelines"][0]["repeats"] == 2
    loaded = automap.load_plan(tmp_path / "plan.json").bind(step, *args)
    assert loaded.partitioning.pipelines == plan.partitioning.pipelines
    loaded.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == (tmp_path / "plan.json").read_bytes()
    out = Console(file=io.StringIO(), width=250)
    explain_saved(data, out)
    assert "schedule gpipe, 2 repeats (circular)" in out.file.getvalue()
    ours, theirs = loaded.jit()(*args), jax.jit(step)(*args)
    for name, a, b in zip(prog.output_names, jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("stages,microbatches,repeats", [(2, 2, 2), (4, 4, 2), (3, 5, 3)])
def test_the_circular_timeline_goes_round_the_stages_and_idles_the_bubble(stages, microbatches, repeats):
    """Every stage runs every microbatch once per round and pass, one unit at a time,
    after the stage before it in the ring made its input; each stage idles
    (S-1)/(M*R+S-1) of the time."""
    slots = search.gpipe_timeline(stages, microbatches, search.TickTimes(1.0, 2.0), repeats)
    at = {(s.stage, s.microbatch, s.repeat, s.backward): s for s in slots}
    assert len(at) == len(slots) == 2 * stages * microbatches * repeats
    for s in slots:
        step = 1 if s.backward else -1
        before = (s.stage + step) % stages
        wraps = before == (stages - 1 if not s.backward else 0)  # the ring's wrap: the previous round
        key = (before, s.microbatch, s.repeat - wraps, s.backward)
        if key in at:
            assert at[key].end <= s.start
    for stage in range(stages):
        runs = sorted((s.start, s.end) for s in slots if s.stage == stage)
        assert all(a[1] <= b[0] for a, b in zip(runs, runs[1:]))
    end = max(s.end for s in slots)
    idle = 1 - sum(s.end - s.start for s in slots) / (stages * end)
    assert idle == pytest.approx((stages - 1) / (microbatches * repeats + stages - 1))


def test_a_saved_circular_plan_plots_its_rounds(tmp_path):
    plan = _circular_plan()
    plan.save(tmp_path / "plan.json")
    fig = figure(json.loads((tmp_path / "plan.json").read_text()))
    (panel,) = [ax for ax in fig.axes if "pipeline over 'stage'" in ax.get_title()]
    assert "2 microbatches going round 2 times" in panel.get_title() and "idle 20%" in panel.get_title()
    assert len(panel.patches) == 2 * 2 * 2 * 2


# -- the search ----------------------------------------------------------------------------
@pytest.mark.parametrize("microbatches,layers,offered", [
    (2, 4, (1, 2)), (1, 4, (1,)), (2, 2, (1,)),
    pytest.param(2, 5, (1, 2), marks=pytest.mark.slow),  # chunks of 2, 1, 1, 1 layers
    pytest.param(2, 3, (1,), marks=pytest.mark.slow),  # four chunks, three layers
])
def test_the_search_offers_the_circular_schedule_where_it_can_run(microbatches, layers, offered):
    """Beside GPipe, two repeats: only with a layer in each of the S*R chunks (their
    lengths may differ) and a microbatch per stage."""
    _, _, prog = _gpt(dataclasses.replace(TINY, n_layers=layers))
    part = partir.Partitioning(prog, _mesh(2))
    found = [m.repeats for m in search._seeds.macros(part, ("stage",), (microbatches,)) if isinstance(m, T.Pipeline)]
    assert tuple(found) == offered
