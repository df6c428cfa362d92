"""Interleaved 1F1B (`Pipeline(axis, microbatches=M, schedule="1f1b", repeats=R)`,
Megatron's virtual stages): each stage runs R chunks of the layers as the circular
schedule does, one chunk's forward and one chunk's backward a tick
(`partir.OnefSchedule`). The step computes what plain `jax.jit` computes in both
lowerings, XLA's collectives are the modeled ones, a stage keeps fewer residuals than
with one repeat in XLA's peak and the model's alike, and what it cannot run is refused
before any work."""

import collections
import dataclasses
import io
import itertools
import json

import pytest

import automap
import partir
import search
import tactics as T
from automap._explain import explain_saved
from partir import MeshSpec
from rich.console import Console
from test_pipeline import COMPOSED, TINY, TINY_LLAMA, _gpt, _mesh, _moves_once, peaks
from test_pipeline_onef import LONG, _same_step_and_collectives
from test_pipeline_onef import _plan as onef_plan


#: Remat in the stages, beside a role on `data`.
REMAT = {"gpt-dp-full": [T.DataParallel("data"), T.Remat("full")],
         "gpt-dp-dots": [T.DataParallel("data"), T.Remat("dots")],
         "llama-fsdp-full": [T.FSDP("data"), T.Remat("full")]}


def _plan(stages: int, microbatches: int, repeats: int, config=TINY, others=None, mesh=None):
    """`others` (default: DataParallel over 'data'), then an interleaved 1F1B Pipeline over 'stage'."""
    return onef_plan(stages, microbatches, config, others, mesh, repeats=repeats)


# The default run holds interleaved 1F1B's numerics and collectives under FSDP
# (test_chunks_move_their_fsdp_weights_and_gradients_once_a_step, below).
@pytest.mark.slow
@pytest.mark.parametrize("stages,microbatches,repeats,config,case,backend", [
    (2, 4, 2, TINY, None, "shard_map"),  # chunks of one layer, the carries sent round, the chunks exchanged
    (4, 8, 2, dataclasses.replace(LONG, n_layers=8), None, "shard_map"),
    (2, 4, 2, TINY, None, "jit"),
    (2, 4, 3, dataclasses.replace(TINY_LLAMA, n_layers=6), None, "shard_map"),
    (2, 4, 2, TINY_LLAMA, "llama-dp-megatron", "shard_map"),
    (2, 4, 2, TINY_LLAMA, "llama-dp-megatron", "jit"),
    (4, 4, 2, dataclasses.replace(TINY, n_layers=8), "gpt-fsdp", "shard_map"),
    (2, 2, 2, dataclasses.replace(TINY, remat=True), None, "shard_map"),  # the user's jax.checkpoint
    # Remat in the stages: the ring keeps what recomputing needs, chunk by chunk
    (2, 4, 2, TINY, "gpt-dp-full", "shard_map"),
    (2, 4, 2, TINY, "gpt-dp-dots", "shard_map"),
    (2, 4, 2, TINY_LLAMA, "llama-fsdp-full", "shard_map"),
    (2, 4, 2, dataclasses.replace(TINY, n_layers=6), "gpt-dp-full", "jit"),  # uneven chunks
])
def test_interleaved_1f1b_computes_what_jit_computes_more(stages, microbatches, repeats, config, case, backend):
    others, mesh = (COMPOSED[case][1], COMPOSED[case][2]) if case in COMPOSED else (REMAT.get(case), None)
    _same_step_and_collectives(_plan(stages, microbatches, repeats, config, others, mesh), config, backend)


@pytest.mark.parametrize("stages,repeats,microbatches", [
    (s, r, s * g) for s, r, g in itertools.product((1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 3))])
def test_each_unit_runs_once_after_its_input_and_no_two_in_flight_share_a_slot(stages, repeats, microbatches):
    """Per stage one forward and one backward a tick; a chunk's input made the tick
    before (by the stage behind, or by the last stage for the next chunk); the last
    chunk's backward in the tick of its forward on the last stage (the head between);
    the ring's slots apart for the units in flight, (R+1)S-1 of them at most."""
    sched = partir.OnefSchedule(stages, repeats, microbatches)
    fwd = {(m, r, s): sched.forward_tick(m, r, s)
           for m, r, s in itertools.product(range(microbatches), range(repeats), range(stages))}
    bwd = {k: sched.backward_tick(*k) for k in fwd}
    for s in range(stages):
        assert len({t for (_, _, q), t in fwd.items() if q == s}) == sched.units
        assert len({t for (_, _, q), t in bwd.items() if q == s}) == sched.units
    for (m, r, s), t in fwd.items():
        assert t - 1 == (fwd[m, r, s - 1] if s else fwd[m, r - 1, stages - 1] if r else t - 1)
        back = bwd[m, r, s]
        if (r, s) == (repeats - 1, stages - 1):
            assert back == t
        else:
            assert back - 1 == (bwd[m, r, s + 1] if s < stages - 1 else bwd[m, r + 1, 0])
    assert max(bwd.values()) + 1 == sched.ticks == microbatches * repeats + (repeats + 1) * stages - 2
    slots = sched.slots()
    for s, t in itertools.product(range(stages), range(sched.ticks)):
        held = [slots[s, sched.unit(m, r)] for m, r in itertools.product(range(microbatches), range(repeats))
                if fwd[m, r, s] <= t <= bwd[m, r, s]]
        assert len(held) == len(set(held)) and max(held, default=-1) < sched.ring
    assert sched.ring == min(microbatches * repeats, (repeats + 1) * stages - 1 if repeats > 1 else 2 * stages - 1)


@pytest.mark.parametrize("stages,microbatches,repeats", [(2, 4, 2), (4, 8, 3)])
def test_the_interleaved_timeline_has_the_circular_bubble(stages, microbatches, repeats):
    """The step is (M*R+S-1) ticks of a chunk's forward and backward, each stage idle
    (S-1)/(M*R+S-1) of it, every chunk of every microbatch run once each way a stage."""
    forward, backward = 0.5, 1.5
    slots = search.onef_timeline(stages, microbatches, search.TickTimes(forward, backward), repeats)
    end = max(s.end for s in slots)
    assert end == pytest.approx((microbatches * repeats + stages - 1) * (forward + backward))
    busy = sum(s.end - s.start for s in slots) / (stages * end)
    assert 1 - busy == pytest.approx((stages - 1) / (microbatches * repeats + stages - 1))
    runs = collections.Counter((s.stage, s.microbatch, s.repeat, s.backward) for s in slots)
    assert len(runs) == 2 * stages * microbatches * repeats and set(runs.values()) == {1}


def test_a_stage_keeps_fewer_residuals_with_more_chunks():
    """S=2, M=8, 8 layers: one repeat keeps 3 microbatches' residuals of the stage (the
    ring of 2S-1); 4 repeats keep 9 chunks of a quarter, 2.25 microbatches'."""
    config = dataclasses.replace(LONG, n_layers=8)
    flight = [search.pipeline_cost(p, p.pipelines[0], "cpu").in_flight_bytes
              for p in (_plan(2, 8, 1, config), _plan(2, 8, 4, config))]
    assert flight[1] == pytest.approx(flight[0] * 2.25 / 3)


@pytest.mark.slow
def test_the_modeled_peak_falls_with_more_chunks_as_xlas_does():
    """S=2, M=8, 8 layers of 32 tokens: from one repeat to four XLA's peak falls 2151 ->
    1363 KB and the modeled one 1829 -> 1284 KB, each XLA's within a fifth."""
    config = dataclasses.replace(LONG, n_layers=8)
    _, args, _ = _gpt(config)
    (one, xla_one), (four, xla_four) = both = [peaks(_plan(2, 8, r, config), args) for r in (1, 4)]
    assert four < one and xla_four < xla_one
    assert all(0.8 < model / xla < 1.2 for model, xla in both)


@pytest.mark.parametrize("tactics,config,mesh,match", [
    ([T.Pipeline("stage", 6, "1f1b", repeats=2)], dataclasses.replace(TINY, n_layers=8, batch=12),
     MeshSpec.of(data=2, stage=4), "groups of the 4 stages.*6 microbatches.*multiple of 4"),
    ([T.Pipeline("stage", 4, "1f1b", repeats=3)], dataclasses.replace(TINY, n_layers=5), _mesh(2),
     "2 stages x 3 repeats make more chunks than the 5 layers"),
])
def test_what_interleaved_1f1b_cannot_run_is_refused_naming_it(tactics, config, mesh, match):
    _, _, prog = _gpt(config)
    with pytest.raises(T.TacticError, match=match):
        T.apply_schedule(prog, mesh, [T.DataParallel("data")] + tactics)


def test_a_saved_interleaved_plan_loads_as_it_was_made_and_explains_its_schedule(tmp_path):
    step, args, _ = _gpt()
    plan = automap.partition(step, mesh={"data": 4, "stage": 2}, lowering="shard_map", device="cpu",
                             schedule=[T.DataParallel("data"), T.Pipeline("stage", 4, "1f1b", repeats=2)])(*args)
    plan.save(tmp_path / "plan.json")
    loaded = automap.load_plan(tmp_path / "plan.json").bind(step, *args)
    assert loaded.partitioning.pipelines == plan.partitioning.pipelines
    loaded.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == (tmp_path / "plan.json").read_bytes()
    out = Console(file=io.StringIO(), width=250)
    explain_saved(json.loads((tmp_path / "plan.json").read_text()), out)
    assert "schedule 1f1b, 2 repeats (interleaved: virtual stages), 4 microbatches, modeled bubble 11%" in \
        out.file.getvalue()


def test_the_search_offers_interleaved_1f1b_where_its_chunks_are_even():
    """Over 2 stages of a 4-layer scan, 4 microbatches: 1F1B of 2 chunks a stage is
    offered (4 chunks of a layer); over 4 stages it is not (8 chunks of 4 layers)."""
    from search._seeds import macros

    _, _, prog = _gpt()
    for stages, offered in ((2, True), (4, False)):
        part = T.apply_schedule(prog, _mesh(stages), []).partitioning
        pipes = [m for m in macros(part, ("stage",), (4,)) if isinstance(m, T.Pipeline)]
        assert (T.Pipeline("stage", 4, "1f1b", repeats=2) in pipes) == offered


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("gpipe", marks=pytest.mark.slow)])
def test_chunks_move_their_fsdp_weights_and_gradients_once_a_step(schedule):
    """Interleaved 1F1B and the circular schedule exchange the stage's blocks for its
    chunks at rest: the weights are gathered once before the tick loop and the
    gradients reduce-scattered once after it, not per microbatch (GPT of 8 layers,
    FSDP over data=4, stage=2, R=2: chunks of 2 layers); the step equals jax.jit's and
    XLA's collectives are the modeled ones."""
    config = dataclasses.replace(TINY, n_layers=8)
    _, _, prog = _gpt(config)
    pipe = T.Pipeline("stage", microbatches=4, schedule=schedule, repeats=2)
    part = T.apply_schedule(prog, _mesh(2), [T.FSDP("data"), pipe]).partitioning
    _moves_once(part, config, _mesh(2))
