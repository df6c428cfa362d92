"""The pipeline schedule as a timeline per stage: which stage runs which microbatch
when (`search.gpipe_timeline`, from the tick times the cost model prices), and the
plot of it that a plan draws, from its plan file alone."""

import json

import pytest

import automap
import search
import tactics as T
from automap._plot import figure
from tests.test_pipeline import _gpt, _plan


def _idle(slots, stages: int) -> float:
    end = max(s.end for s in slots)
    return 1 - sum(s.end - s.start for s in slots) / (stages * end)


def test_gpipe_runs_microbatch_m_on_stage_s_at_tick_m_plus_s_then_backward_from_the_last_stage():
    """S=3, M=2, forward ticks of 1 s and backward ticks of 2 s: the forward loop is 4
    ticks; the backward loop starts after it, on the last stage first."""
    slots = search.gpipe_timeline(3, 2, search.TickTimes(1.0, 2.0))
    starts = {(s.stage, s.microbatch, s.backward): (s.start, s.end) for s in slots}
    assert starts == {
        (0, 0, False): (0.0, 1.0), (0, 1, False): (1.0, 2.0),
        (1, 0, False): (1.0, 2.0), (1, 1, False): (2.0, 3.0),
        (2, 0, False): (2.0, 3.0), (2, 1, False): (3.0, 4.0),
        (2, 0, True): (4.0, 6.0), (2, 1, True): (6.0, 8.0),
        (1, 0, True): (6.0, 8.0), (1, 1, True): (8.0, 10.0),
        (0, 0, True): (8.0, 10.0), (0, 1, True): (10.0, 12.0),
    }


@pytest.mark.parametrize("stages,microbatches", [(2, 1), (2, 2), (4, 4), (3, 5), (8, 2)])
def test_a_stage_runs_a_microbatch_after_its_neighbour_made_it_and_one_at_a_time(stages, microbatches):
    slots = search.gpipe_timeline(stages, microbatches, search.TickTimes(1.5, 2.5))
    at = {(s.stage, s.microbatch, s.backward): s for s in slots}
    for s in slots:
        before = s.stage + (1 if s.backward else -1)  # the stage the carry comes from
        if (before, s.microbatch, s.backward) in at:
            assert at[(before, s.microbatch, s.backward)].end <= s.start
        if s.backward:
            assert at[(s.stage, s.microbatch, False)].end <= s.start
    for stage in range(stages):
        runs = sorted((s.start, s.end) for s in slots if s.stage == stage)
        assert all(a[1] <= b[0] for a, b in zip(runs, runs[1:]))


def test_the_idle_share_of_the_modeled_timeline_is_the_modeled_bubble():
    """On a pipelined GPT (S=4, M=4): the timeline drawn from the cost model's tick
    times leaves each stage idle (S-1)/(M+S-1) of the time, `pipeline_cost`'s bubble,
    and its ticks are part of the modeled step."""
    part = _plan(4, 4)
    cost = search.CostModel(part, "cpu").cost()
    (ticks,) = cost.pipeline_ticks
    assert ticks.forward > 0 and ticks.backward > 0
    slots = search.gpipe_timeline(4, 4, ticks)
    assert _idle(slots, 4) == pytest.approx(search.pipeline_cost(part, part.pipelines[0], "cpu").bubble) == 3 / 7
    assert max(s.end for s in slots) < cost.step_time


@pytest.mark.parametrize("stages,microbatches,forward,backward", [(2, 2, 1.0, 2.0), (8, 3, 0.5, 0.5), (4, 1, 1.0, 0.0)])
def test_the_idle_share_of_any_gpipe_timeline_is_the_bubble(stages, microbatches, forward, backward):
    slots = search.gpipe_timeline(stages, microbatches, search.TickTimes(forward, backward))
    assert _idle(slots, stages) == pytest.approx((stages - 1) / (microbatches + stages - 1))


def test_a_saved_pipelined_plan_plots_its_schedule_per_stage(tmp_path):
    """From the plan file alone: a timeline panel with a row per stage and a box per
    microbatch and pass where the schedule puts it; and the picture is written."""
    step, args, _ = _gpt()
    plan = automap.partition(step, mesh={"data": 2, "stage": 4}, lowering="shard_map", device="cpu",
                             schedule=[T.DataParallel("data"), T.Pipeline("stage", microbatches=4)])(*args)
    plan.save(tmp_path / "plan.json")
    data = automap.load_plan(tmp_path / "plan.json").data
    fig = figure(json.loads(json.dumps(data)))
    (panel,) = [ax for ax in fig.axes if "pipeline over 'stage'" in ax.get_title()]
    assert "4 stages, 4 microbatches" in panel.get_title() and "idle 43%" in panel.get_title()
    boxes = sorted((round(p.get_x(), 9), round(p.get_y() + p.get_height() / 2)) for p in panel.patches)
    want = sorted((round(1e3 * s.start, 9), s.stage)
                  for s in search.gpipe_timeline(4, 4, plan.cost.pipeline_ticks[0]))
    assert boxes == want and len(want) == 2 * 4 * 4
    plan.plot(tmp_path / "plan.png")
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
