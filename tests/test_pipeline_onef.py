"""The 1F1B schedule (`Pipeline(axis, microbatches=M, schedule="1f1b")`): the forward
layers, the head between the layer scans and the backward layers as one tick loop per
stage. The step computes what plain `jax.jit` computes (loss, updated parameters, Adam
moments) in both lowerings, XLA's collectives are the modeled ones, the residuals a
stage keeps are those of the microbatches in flight (fewer than GPipe's M), and the
settings it cannot run are refused before any work."""

import collections
import dataclasses
import functools
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
from examples import gpt
from partir import MeshSpec
from rich.console import Console
from test_pipeline import COMPOSED, TINY, TINY_LLAMA, _gpt, _mesh, peaks

#: A longer sequence and more examples, so that the residuals dominate the peak and 8
#: microbatches are whole on 4 data-parallel devices.
LONG = dataclasses.replace(TINY, seq_len=32, d_ff=64, batch=32)


def _plan(stages: int, microbatches: int, config=TINY, others=None, mesh=None, schedule="1f1b", repeats=1):
    """`others` (default: DataParallel over 'data'), then a 1F1B Pipeline over 'stage' (the
    layers rolled first where the config writes them unrolled)."""
    _, _, prog = _gpt(config)
    prog = prog if getattr(config, "scan_layers", True) else partir.roll_layers(prog)
    others = [T.DataParallel("data")] if others is None else others
    pipe = T.Pipeline("stage", microbatches=microbatches, schedule=schedule, repeats=repeats)
    return T.apply_schedule(prog, mesh or _mesh(stages), others + [pipe]).partitioning


def _same_step_and_collectives(part, config, backend):
    """The step equals plain jax.jit's, and XLA's collectives are the modeled ones."""
    step, args, prog = _gpt(config)
    lowered = partir.lower(part, backend=backend)
    ours, theirs = lowered(*args), jax.jit(step)(*args)
    for name, a, b in zip(prog.output_names, jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6, err_msg=name)
    text = lowered.lower(*args).compile().as_text()
    compiled = partir.collective_buffers(partir.collectives(text, part.mesh.jax_mesh()), reduce_scatter=False)
    cost = search.CostModel(part, "cpu").cost()
    modeled = collections.Counter((c.kind, c.axes, int(c.bytes)) for c in cost.collectives)
    assert compiled == modeled
    permutes = [k for k in compiled if k[0] == partir.Kind.COLLECTIVE_PERMUTE]
    assert permutes and all(axes == ("stage",) for _, axes, _ in permutes)


def test_1f1b_gpt_computes_what_jit_computes_with_the_modeled_collectives():
    """GPT, data=4 x stage=2, M=4: one collective-permute each way of one microbatch's
    activation (512 B), the head's sums all-reduced over data and stage once."""
    _same_step_and_collectives(_plan(2, 4), TINY, "shard_map")


@pytest.mark.slow
@pytest.mark.parametrize("stages,microbatches,config,case,backend", [
    (4, 8, LONG, None, "shard_map"),
    (2, 4, TINY, None, "jit"),
    (4, 4, TINY_LLAMA, None, "shard_map"),
    (2, 4, TINY_LLAMA, "llama-dp-megatron", "shard_map"),
    (2, 4, TINY_LLAMA, "llama-dp-megatron", "jit"),
    (4, 2, TINY, "gpt-fsdp", "shard_map"),
])
def test_1f1b_computes_what_jit_computes_more(stages, microbatches, config, case, backend):
    others, mesh = (COMPOSED[case][1], COMPOSED[case][2]) if case else (None, None)
    _same_step_and_collectives(_plan(stages, microbatches, config, others, mesh), config, backend)


# The default run holds the in-flight ring's size through test_1f1b_has_gpipes_bubble_and_one_tick_loop's
# sibling below; the peaks against XLA's compile two plans.
@pytest.mark.slow
def test_the_modeled_peak_of_1f1b_is_below_gpipes_as_xlas_is():
    """With more microbatches than the 2S-1 a stage keeps in flight (S=2, M=8: a ring of
    3), the stage's residuals fall to 3/8 of GPipe's: XLA's peak falls (1855 -> 1115 KB;
    1423 KB while it copied the ring every tick) and the modeled one does (1803 -> 932
    KB), the modeled in-flight bytes by 3/8, both peaks XLA's within 20%."""
    _, args, _ = _gpt(LONG)
    both, flight = {}, {}
    for schedule in ("gpipe", "1f1b"):
        part = _plan(2, 8, LONG, schedule=schedule)
        both[schedule] = peaks(part, args)
        flight[schedule] = search.pipeline_cost(part, part.pipelines[0], "cpu").in_flight_bytes
    assert both["1f1b"][0] < both["gpipe"][0] and both["1f1b"][1] < both["gpipe"][1]
    assert all(0.8 < model / xla < 1.2 for model, xla in both.values())
    assert flight["1f1b"] == pytest.approx(flight["gpipe"] * 3 / 8)


def test_the_modeled_peak_of_1f1b_is_xlas_within_a_fifth():
    """The tick loop's own buffers are in the modeled peak (`search/cost/_tick_buffers`):
    GPT, data=4 x stage=2, M=4, two layers a stage: the ring of kept residuals held once,
    updated in place (a microbatch is one sequence a device: before the backward unit
    wrote back the slot it reads, XLA:CPU copied the ring every tick, 292 KB), a tick's
    stacks of one microbatch, the mask made once before the loop, the forward's initial
    carry through the backward ticks. Modeled 213 KB against XLA's 243 KB (temp +
    arguments + outputs - alias): a copied ring would put XLA's at 0.73 of the model's."""
    _, args, _ = _gpt(TINY)
    model, xla = peaks(_plan(2, 4), args)
    assert 0.8 < model / xla < 1.2


def test_a_fused_attention_kernel_keeps_no_scores_in_the_tick_loops():
    """On a device whose attention is a fused kernel (H100: cuDNN's), the scores, their
    softmax and its mask never exist, so no tick loop holds them either (the ring once
    held the softmax's weights of 7 microbatches: 601 GB a device on NeMo's 70B row):
    Llama, two stages of two layers, M=4, on H100."""
    model = search.CostModel(_plan(2, 4, TINY_LLAMA), "h100")
    model.cost()
    from search.cost._tick_buffers import kernel_values

    attention = model.materialization.attention
    kernel = kernel_values(model.part.program, attention)
    everything = model._pipeline.ticks.entries(model.liveness.virtual, model._value_div)
    held = model._pipeline.ticks.entries(model.liveness.virtual, model._value_div, attention)
    assert any(kernel[v] for _, _, v, _ in everything)  # the program's softmax is in the ticks
    assert held and not any(kernel[v] for _, _, v, _ in held)


@pytest.mark.slow
def test_the_1f1b_ring_is_held_once_where_a_microbatch_has_two_rows():
    """With two rows a microbatch along its split dim (GPT of 8 layers, data=2 x stage=4,
    M=8: two sequences a microbatch and device, a ring of 7) XLA:CPU holds the ring once
    with the backward unit reading its slot after the forward unit's write, so the
    lowering keeps that order there (taking the slots before the write, as for one row,
    XLA held them beside the ring: 3472 KB), and so does the model: 3128 KB against
    XLA's 3204 KB."""
    config = dataclasses.replace(LONG, n_layers=8)
    _, args, _ = _gpt(config)
    model, xla = peaks(_plan(4, 8, config), args)
    assert 0.8 < model / xla < 1.2


def test_1f1b_has_gpipes_bubble_and_one_tick_loop():
    part = _plan(4, 4)
    cost = search.pipeline_cost(part, part.pipelines[0], "cpu")
    assert cost.bubble == pytest.approx(3 / 7) and cost.ticks == 4 + 2 * 4 - 2


@pytest.mark.parametrize("tactics,match,config", [
    # (Remat runs under 1F1B, tests/test_pipeline_onef_remat.py, but for a policy keeping
    # more than the user's jax.checkpoint, which no pipeline runs yet.)
    ([T.Remat("dots"), T.Pipeline("stage", microbatches=4, schedule="1f1b")],
     "relaxes the user's jax.checkpoint.*keeps no more than the user's", dataclasses.replace(TINY, remat=True)),
])
def test_what_1f1b_cannot_run_is_refused_naming_it(tactics, match, config):
    _, _, prog = _gpt(config)
    with pytest.raises(T.TacticError, match=match):
        T.apply_schedule(prog, _mesh(2), [T.DataParallel("data")] + tactics)


def test_1f1b_of_a_forward_pass_alone_is_refused():
    """No backward scan: nothing to interleave the forwards with."""
    params, batch = gpt.init(TINY, jax.random.PRNGKey(0))
    prog = partir.lift(functools.partial(gpt.loss_fn, config=TINY), params, batch)
    with pytest.raises(T.TacticError, match="1f1b.*no backward scan.*schedule='gpipe'"):
        T.apply_schedule(prog, _mesh(2), [T.Pipeline("stage", microbatches=2, schedule="1f1b", batch_argnums=1)])


def test_a_saved_1f1b_plan_loads_as_it_was_made_and_explains_its_schedule(tmp_path):
    step, args, _ = _gpt()
    plan = automap.partition(step, mesh={"data": 4, "stage": 2}, lowering="shard_map", device="cpu",
                             schedule=[T.DataParallel("data"), T.Pipeline("stage", 4, "1f1b")])(*args)
    plan.save(tmp_path / "plan.json")
    loaded = automap.load_plan(tmp_path / "plan.json").bind(step, *args)
    assert loaded.partitioning.pipelines == plan.partitioning.pipelines
    assert loaded.partitioning.pipelines[0].schedule == "1f1b"
    loaded.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == (tmp_path / "plan.json").read_bytes()
    out = Console(file=io.StringIO(), width=250)
    explain_saved(json.loads((tmp_path / "plan.json").read_text()), out)
    assert "in stages over 'stage', 4 microbatches, schedule 1f1b" in out.file.getvalue()


@pytest.mark.parametrize("stages,microbatches,forward,backward", [(2, 4, 1.0, 2.0), (4, 8, 0.5, 1.5), (3, 2, 1.0, 1.0)])
def test_the_1f1b_timeline_has_gpipes_length_and_bubble_with_fewer_in_flight(stages, microbatches, forward,
                                                                               backward):
    """Every microbatch runs forward then backward on each stage, the step lasts
    (M+S-1)(F+B), each stage is idle (S-1)/(M+S-1) of it, and stage s holds at most
    2(S-1-s)+1 microbatches between their forward and backward."""
    slots = search.onef_timeline(stages, microbatches, search.TickTimes(forward, backward))
    end = max(s.end for s in slots)
    assert end == pytest.approx((microbatches + stages - 1) * (forward + backward))
    busy = sum(s.end - s.start for s in slots) / (stages * end)
    assert 1 - busy == pytest.approx((stages - 1) / (microbatches + stages - 1))
    for s in range(stages):
        runs = {(x.microbatch, x.backward): x for x in slots if x.stage == s}
        assert len(runs) == 2 * microbatches
        starts = sorted([(x.start, 1) for x in runs.values() if not x.backward]
                        + [(x.end, -1) for x in runs.values() if x.backward])
        held = max(np.cumsum([d for _, d in starts]))
        assert held <= min(microbatches, 2 * (stages - 1 - s) + 1)


def test_the_search_offers_1f1b_beside_gpipe_where_it_keeps_fewer_residuals():
    """Over a stage axis of 2, 4 microbatches are more than the 3 a 1F1B stage keeps in
    flight: 1F1B is offered beside GPipe; over 4 stages (7 in flight) it is not."""
    from search._seeds import macros

    _, _, prog = _gpt()
    for stages, offered in ((2, True), (4, False)):
        part = T.apply_schedule(prog, _mesh(stages), []).partitioning
        pipes = [m for m in macros(part, ("stage",), (4,)) if isinstance(m, T.Pipeline)]
        assert T.Pipeline("stage", 4) in pipes
        assert (T.Pipeline("stage", 4, "1f1b") in pipes) == offered


def test_a_saved_1f1b_plan_plots_its_schedule(tmp_path):
    """From the plan file alone: a box per microbatch and pass where 1F1B puts it."""
    from automap._plot import figure

    step, args, _ = _gpt()
    plan = automap.partition(step, mesh={"data": 4, "stage": 2}, lowering="shard_map", device="cpu",
                             schedule=[T.DataParallel("data"), T.Pipeline("stage", 4, "1f1b")])(*args)
    plan.save(tmp_path / "plan.json")
    fig = figure(json.loads((tmp_path / "plan.json").read_text()))
    (panel,) = [ax for ax in fig.axes if "1f1b pipeline over 'stage'" in ax.get_title()]
    boxes = sorted((round(p.get_x(), 9), round(p.get_y() + p.get_height() / 2)) for p in panel.patches)
    want = sorted((round(1e3 * s.start, 9), s.stage) for s in search.onef_timeline(2, 4, plan.cost.pipeline_ticks[0]))
    assert boxes == want and len(want) == 2 * 2 * 4
