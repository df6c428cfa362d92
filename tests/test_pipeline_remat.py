"""Rematerialization inside pipeline stages: a stage's layers recompute in the backward
ticks what the `Remat` policy does not keep, under both lowerings, computing what plain
`jax.jit` computes; the cost model's residuals in flight shrink to what the policy
keeps, and its peak falls as XLA's does."""

import collections
import dataclasses

import jax
import numpy as np
import pytest

import partir
import search
import tactics as T
from partir import MeshSpec
from partir._hlo import reachable
from tests.test_pipeline import TINY, TINY_LLAMA, _gpt, _mesh, _moves_once


def _plan(stages: int, microbatches: int, policy: str | None, config=TINY, others=None, mesh=None, first=True):
    """`others` (default DataParallel over 'data'), then `Remat(policy)` (none when None)
    before or after (`first`) a Pipeline over 'stage'."""
    _, _, prog = _gpt(config)
    remat = [T.Remat(policy)] if policy else []
    pipeline = [T.Pipeline("stage", microbatches=microbatches)]
    others = [T.DataParallel("data")] if others is None else others
    schedule = others + (remat + pipeline if first else pipeline + remat)
    return T.apply_schedule(prog, mesh or _mesh(stages), schedule).partitioning


def _same_step(part, config=TINY, backend="shard_map"):
    """The lowered step equals plain jax.jit's on every output (loss, parameters, Adam
    moments: the gradients); returns the lowered step."""
    step, args, prog = _gpt(config)
    lowered = partir.lower(part, backend=backend)
    ours, theirs = lowered(*args), jax.jit(step)(*args)
    for name, a, b in zip(prog.output_names, jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6, err_msg=name)
    return lowered


def _xla_collectives(lowered, part, config=TINY):
    _, args, _ = _gpt(config)
    text = lowered.lower(*args).compile().as_text()
    return partir.collective_buffers(partir.collectives(text, part.mesh.jax_mesh()), reduce_scatter=False)


def _modeled_collectives(part):
    return collections.Counter((c.kind, c.axes, int(c.bytes)) for c in search.CostModel(part, "cpu").cost().collectives)


# In `make test-slow` (2 s each): the default run holds GPipe stages recomputing their
# layers to jax.jit in tests/test_pipeline_uneven.py's
# test_uneven_stages_rematerializing_their_layers_compute_what_jit_computes_in_less_memory
# (shard_map) and 1F1B's in tests/test_pipeline_onef_remat.py (with XLA's collectives the
# modeled ones), and a pipeline under the jit lowering in tests/test_pipeline.py's
# test_the_jit_lowering_computes_what_jit_computes_with_the_modeled_collectives.
@pytest.mark.parametrize("backend", [pytest.param("shard_map", marks=pytest.mark.slow),
                                     pytest.param("jit", marks=pytest.mark.slow)])
def test_a_pipelined_gpt_rematerializing_its_stages_computes_what_jit_computes(backend):
    """S=2, M=2, Remat('full'): each stage keeps only its layers' inputs per
    microbatch and runs its layers again in the backward ticks."""
    part = _plan(2, 2, "full")
    assert part.rematerialized and part.pipelines
    _same_step(part, backend=backend)


def test_remat_and_a_pipeline_make_the_same_plan_in_either_order():
    before, after = _plan(2, 2, "full", first=True), _plan(2, 2, "full", first=False)
    assert before.rematerialized == after.rematerialized and before.pipelines == after.pipelines
    assert all(before.tiling(v) == after.tiling(v) for v in range(len(before.program.values)))


#: Slow cases: (config, policy, stages, microbatches, tactics on the other axes, mesh).
SLOW = {
    "gpt-dots-4x4": (TINY, "dots", 4, 4, None, None),
    "llama-full": (TINY_LLAMA, "full", 2, 4, None, None),
    "llama-dots": (TINY_LLAMA, "dots", 2, 2, None, None),
    "llama-megatron-full": (TINY_LLAMA, "full", 2, 2, [T.DataParallel("data"), T.Megatron("model")],
                            MeshSpec.of(data=2, model=2, stage=2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["shard_map", "jit"])
@pytest.mark.parametrize("case", list(SLOW))
def test_pipelines_rematerializing_their_stages_compute_what_jit_computes(case, backend):
    """And, as for every pipelined plan, XLA's collectives are exactly the modeled ones
    (the recomputation's included: under Megatron 'full' repeats the layers'
    all-reduces in the backward ticks)."""
    config, policy, stages, m, others, mesh = SLOW[case]
    part = _plan(stages, m, policy, config, others, mesh)
    lowered = _same_step(part, config, backend)
    assert _xla_collectives(lowered, part, config) == _modeled_collectives(part)


# (3 s: in `make test-slow`; the default run holds a recomputing pipeline's collectives in
# tests/test_pipeline_onef_remat.py and a pipeline's under the jit lowering in tests/test_pipeline.py,
# both named above.)
@pytest.mark.slow
def test_the_compiled_collectives_of_a_rematerializing_pipeline_are_the_modeled_ones():
    part = _plan(2, 2, "full")
    assert _xla_collectives(partir.lower(part, backend="jit"), part) == _modeled_collectives(part)


def test_a_policy_relaxing_the_users_checkpoint_is_refused_in_pipelined_layers():
    """The user's jax.checkpoint keeps only each layer's input; 'dots' would keep more
    (read from the forward pass), which the stages do not do yet."""
    config = dataclasses.replace(TINY, remat=True)
    with pytest.raises(T.TacticError, match="relaxes the user's jax.checkpoint"):
        _plan(2, 2, "dots", config, first=False)
    with pytest.raises(T.TacticError, match="relaxes the user's jax.checkpoint"):
        _plan(2, 2, "dots", config, first=True)


# -- the cost model ------------------------------------------------------------------------
def test_the_residuals_in_flight_are_what_the_policy_keeps():
    """'full' keeps each layer's input: the stage's L/S layers' inputs, of every
    microbatch (here 2 layers x a device's 4 sequences x 8 tokens x 16 wide, f32);
    'dots' also the matmul outputs; without Remat, every residual."""
    flight = {p: search.pipeline_cost(part, part.pipelines[0], "cpu").in_flight_bytes
              for p, part in ((p, _plan(2, 2, p)) for p in (None, "dots", "full"))}
    assert flight["full"] == 2 * (TINY.batch // 4) * TINY.seq_len * TINY.d_model * 4
    assert flight["full"] < flight["dots"] < flight[None]


def test_the_backward_ticks_run_the_layers_again():
    """The recomputation runs in the backward ticks: they take longer, the forward
    ones do not."""
    (plain,) = search.CostModel(_plan(2, 2, None), "cpu").cost().pipeline_ticks
    (full,) = search.CostModel(_plan(2, 2, "full"), "cpu").cost().pipeline_ticks
    assert full.forward == pytest.approx(plain.forward) and full.backward > plain.backward


@pytest.mark.slow  # (the default run holds the band in tests/test_pipeline_uneven.py's remat case)
def test_remat_lowers_the_modeled_peak_as_it_lowers_xlas():
    """With a sequence long enough that the layers' residuals dominate, rematerializing
    the stages lowers the modeled peak and the compiled program's (S=2, M=2: 1319 -> 349
    KB modeled, 1400 -> 404 KB compiled), the model within 20% of XLA (0.55 and 0.79
    before the tick loop's own buffers were modeled)."""
    config = dataclasses.replace(TINY, seq_len=32, d_ff=64)
    _, args, _ = _gpt(config)
    peaks = []
    for policy in (None, "full"):
        part = _plan(2, 2, policy, config)
        ma = partir.lower(part, backend="shard_map").lower(*args).compile().memory_analysis()
        xla = ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
        peaks.append((search.CostModel(part, "cpu").cost().memory_peak, xla))
    (model_plain, xla_plain), (model_full, xla_full) = peaks
    assert xla_full < xla_plain and model_full < model_plain
    assert all(0.8 < model / xla < 1.2 for model, xla in peaks)


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 1)])
def test_the_peak_counts_the_layer_inputs_a_stage_stacks_for_recomputing_as_in_flight(stages, microbatches):
    """The memory model's stacks of the layer inputs (kept for recomputing) are the
    stage's L/S layers' of every microbatch, the residuals in flight `pipeline_cost`
    gives (not the L layers' of one microbatch a scan of the whole stack keeps)."""
    from search.cost._pipeline import _recomputing

    part = _plan(stages, microbatches, "full")
    model = search.CostModel(part, "cpu")
    model.cost()
    inputs = set(_recomputing(part, part.pipelines[0])[1])
    *_, (_, _, sizes, keys) = model._memory(model._value_bytes(), exact=True)
    stacks = [size for size, key in zip(sizes, keys) if key[0] == "remat" and key[1] in inputs]
    assert stacks and sum(stacks) == pytest.approx(search.pipeline_cost(part, part.pipelines[0], "cpu").in_flight_bytes)


# -- weights gathered and gradients reduce-scattered once a step ---------------------------
_ZERO1 = [T.DataParallel("data"), T.ZeRO("data", stage=1)]
#: (tactics on `data`, Remat policy, schedule, config) of stages over data=4 x stage=2,
#: M=4, whose layers recompute and whose FSDP or ZeRO weights and gradients move once a
#: step (`tests.test_pipeline._moves_once`). "circular": GPipe with repeats=2, here over
#: 4 chunks of unequal lengths (6 layers), whose rows are exchanged before the moves;
#: "uneven": 3 layers over the 2 stages.
REMAT_ONCE = {
    "gpt-fsdp-full": ([T.FSDP("data")], "full", "gpipe", TINY),
    "gpt-fsdp-collectives": ([T.FSDP("data")], "collectives", "gpipe", TINY),
    "gpt-uneven-fsdp-full": ([T.FSDP("data")], "full", "gpipe", dataclasses.replace(TINY, n_layers=3)),
    "gpt-circular-fsdp-full": ([T.FSDP("data")], "full", "circular", dataclasses.replace(TINY, n_layers=6)),
    "gpt-fsdp-dots-1f1b": ([T.FSDP("data")], "dots", "1f1b", TINY),
    "gpt-zero1-dots-1f1b": (_ZERO1, "dots", "1f1b", TINY),
    "llama-fsdp-full": ([T.FSDP("data")], "full", "gpipe", TINY_LLAMA),
    "llama-fsdp-dots-1f1b": ([T.FSDP("data")], "dots", "1f1b", TINY_LLAMA),
    "llama-zero1-dots-1f1b": (_ZERO1, "dots", "1f1b", TINY_LLAMA),
}


def _remat_once(case: str, policy="case"):
    """`REMAT_ONCE[case]`'s plan (with `policy` instead of the case's when given: None,
    no Remat)."""
    others, own, schedule, config = REMAT_ONCE[case]
    _, _, prog = _gpt(config)
    remat = own if policy == "case" else policy
    pipeline = T.Pipeline("stage", microbatches=4, schedule="gpipe" if schedule == "circular" else schedule,
                          repeats=2 if schedule == "circular" else 1)
    return T.apply_schedule(prog, _mesh(2), others + ([T.Remat(remat)] if remat else []) + [pipeline]).partitioning


def _data_moves_in_ticks(text, mesh) -> int:
    """The gathers and reduce-scatters over `data` a compiled pipelined program runs in
    a tick loop (a loop sending carries over `stage`, with what it calls)."""
    cols = partir.collectives(text, mesh.jax_mesh())
    ticks = reachable(text, {c.computation for c in cols if c.kind == partir.Kind.COLLECTIVE_PERMUTE})
    kinds = (partir.Kind.ALL_GATHER, partir.Kind.REDUCE_SCATTER)
    return sum(c.axes == ("data",) and c.kind in kinds and c.computation in ticks for c in cols)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["shard_map", "jit"])
@pytest.mark.parametrize("case", list(REMAT_ONCE))
def test_rematerializing_stages_move_their_weights_and_gradients_once_a_step(case, backend):
    """The stage gathers its weights before each tick loop and reduce-scatters their
    accumulated gradients after it though its layers recompute: the recomputation in
    the backward ticks reads the weights the stage gathered for them (the norm scales
    broadcast and gathered once, the residuals standing for them remade so). The step
    equals jax.jit's, XLA's collectives are exactly the modeled ones, each move of the
    layers' weights and gradients over `data` charged once (`_moves_once`: under GPipe,
    none in a tick loop). Under 1F1B, whose tick loop runs the head and moves its
    weights per microbatch, the tick loop moves over `data` no more than without Remat
    (under FSDP less: without Remat the backward unit gathers the norm scales'
    broadcasts from the ring per tick, with it remakes them from the gathered scales)."""
    config, mesh = REMAT_ONCE[case][3], _mesh(2)
    part = _remat_once(case)
    assert part.rematerialized
    _moves_once(part, config, mesh, backend)
    if REMAT_ONCE[case][2] == "1f1b":
        _, args, _ = _gpt(config)
        ticks = [_data_moves_in_ticks(partir.lower(p, backend=backend).lower(*args).compile().as_text(), mesh)
                 for p in (part, _remat_once(case, None))]
        assert ticks[0] <= ticks[1]


def test_rematerializing_stages_are_charged_their_weights_and_gradients_moves_once_a_step():
    """The cost model (H100) charges a stage whose layers recompute ('dots', 1F1B, FSDP
    on the tiny Llama) the gradients' reduce-scatters over `data` it charges the same
    stage without Remat, each once a step, and no gather it does not charge there, none
    more often (the backward unit remakes the norm scales' broadcasts from the scales
    gathered before the loop, where without Remat it gathers them from the ring per
    tick). Before, the layers' were charged per tick (10 times a step here)."""
    def moves(part, kind):
        return collections.Counter((int(c.bytes), c.count) for c in search.CostModel(part, "h100").cost().collectives
                                   if c.axes == ("data",) and c.kind == kind)

    remat, plain = _remat_once("llama-fsdp-dots-1f1b"), _remat_once("llama-fsdp-dots-1f1b", None)
    scatters = moves(remat, partir.Kind.REDUCE_SCATTER)
    assert scatters and scatters == moves(plain, partir.Kind.REDUCE_SCATTER)
    assert any(count == 1 for _, count in scatters)  # (the layers'; the head's run per microbatch)
    gathers = moves(remat, partir.Kind.ALL_GATHER)
    assert gathers and not gathers - moves(plain, partir.Kind.ALL_GATHER)


# By default GPipe with FSDP; ZeRO-1 with 'dots' under 1F1B (3 s) in `make test-slow`, where the
# default run holds 1F1B's peak to XLA's in tests/test_pipeline_onef.py and the model's whole
# accumulators under 1F1B in test_the_peak_names_the_weights_and_gradients_a_stage_holds_across_its_tick_loops.
@pytest.mark.parametrize("case,remat", [("gpt-fsdp-full", "full"),
                                         pytest.param("gpt-zero1-dots-1f1b", "dots", marks=pytest.mark.slow),
                                         pytest.param("gpt-fsdp-dots-1f1b", "dots", marks=pytest.mark.slow),
                                         pytest.param("llama-zero1-dots-1f1b", "dots", marks=pytest.mark.slow),
                                         pytest.param("gpt-fsdp-full", None, marks=pytest.mark.slow),
                                         pytest.param("llama-fsdp-full", "full", marks=pytest.mark.slow),
                                         pytest.param("gpt-circular-fsdp-full", "full", marks=pytest.mark.slow),
                                         pytest.param("gpt-uneven-fsdp-full", "full", marks=pytest.mark.slow)])
def test_the_weights_a_stage_gathers_once_a_step_live_across_its_tick_loops(case, remat):
    """FSDP stages with their weights four times wider than the tiny configs' (weights
    set the peak): XLA gathers the stage's weights for its forward and its backward
    layers, and zeroes their gradient accumulators, before the first tick loop and frees
    them after the last, so the model keeps them live across all the loops
    (`_pipeline_once.loops_span`). The modeled peak is XLA's within 20% (GPipe with
    'full': 1.08, 0.75 while each lived across its own layers' loop only; ZeRO-1 and
    FSDP with 'dots' under 1F1B: 1.04 and 0.98, 0.79 while the gradients a tick makes
    were sized as split over `data`, where the stage holds them whole to reduce-scatter
    once, `PipelinePricing.value_div`)."""
    others, _, schedule, config = REMAT_ONCE[case]
    config = dataclasses.replace(config, d_model=4 * config.d_model, d_ff=4 * config.d_ff)
    _, args, prog = _gpt(config)
    pipeline = T.Pipeline("stage", microbatches=4, schedule="gpipe" if schedule == "circular" else schedule,
                          repeats=2 if schedule == "circular" else 1)
    part = T.apply_schedule(prog, _mesh(2), others + ([T.Remat(remat)] if remat else []) + [pipeline]).partitioning
    ma = partir.lower(part, backend="shard_map").lower(*args).compile().memory_analysis()
    xla = ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
    assert 0.8 < search.CostModel(part, "cpu").cost().memory_peak / xla < 1.2


@pytest.mark.parametrize("schedule", ["gpipe", pytest.param("1f1b", marks=pytest.mark.slow)])
def test_a_stage_adds_each_layers_weight_gradients_into_its_accumulator_in_place(schedule):
    """ZeRO-1 stages with weights four times the tiny config's (their gradients set the
    peak): a tick adds each layer's weight gradients into the stage's accumulator as the
    layer makes them, rather than stacking all the stage's layers' gradients and adding
    the stack, which XLA held beside the accumulator. XLA's temporaries are under 1.5x
    the stage's gradients (1.27 under GPipe, 1.19 under 1F1B; 1.77 and 1.69 with the
    stack), and the step equals jax.jit's."""
    config = dataclasses.replace(TINY, d_model=4 * TINY.d_model, d_ff=4 * TINY.d_ff)
    _, _, prog = _gpt(config)
    part = T.apply_schedule(prog, _mesh(2), _ZERO1 + [T.Remat("dots"), T.Pipeline("stage", microbatches=4,
                                                                                   schedule=schedule)]).partitioning
    stage = sum(prog.values[v].nbytes for v in prog.inputs if prog.name(v).startswith("params['layers']")) / 2
    temp = _same_step(part, config).lower(*_gpt(config)[1]).compile().memory_analysis().temp_size_in_bytes
    assert temp < 1.5 * stage


# (The data-parallel case, 2 s, in `make test-slow`: the pipelined case holds a Remat's
# recomputation in a loop body to XLA's flops, tests/test_remat.py's kept user checkpoint a
# scan body's recomputation.)
@pytest.mark.parametrize("plan", [pytest.param("dp", marks=pytest.mark.slow), "pipelined"])
def test_the_flops_of_a_loop_body_count_what_remat_recomputes_as_xla_does(plan):
    """XLA's cost analysis counts each loop body once, the recomputation a Remat tactic
    adds to the backward body included, and so does `Cost.flops_loops_once`: with
    Remat('full') on the scanned GPT (weights four times the tiny config's), 1.02 of
    XLA's under data parallelism and 0.96 pipelined with FSDP (0.81 and 0.76 before it
    counted the recomputation)."""
    config = dataclasses.replace(TINY, d_model=4 * TINY.d_model, d_ff=4 * TINY.d_ff)
    _, args, prog = _gpt(config)
    others = [T.DataParallel("data")] if plan == "dp" else [T.FSDP("data")]
    pipeline = [T.Pipeline("stage", microbatches=4)] if plan == "pipelined" else []
    part = T.apply_schedule(prog, _mesh(2), others + [T.Remat("full")] + pipeline).partitioning
    f = search.compare_with_xla(part, args, backend="shard_map" if pipeline else "jit")
    assert f.flops_model == pytest.approx(f.flops_xla, rel=0.06)


def test_the_peak_names_the_weights_and_gradients_a_stage_holds_across_its_tick_loops():
    """What a stage gathers and accumulates once a step is listed at the peak by the value
    and what the stage does with it (it was listed under an unrelated op's name): FSDP
    stages with 'dots' under 1F1B, weights four times the tiny config's, whose MLP
    gradients the stage accumulates whole, 2 layers x 64 x 128 float32 each."""
    config = dataclasses.replace(TINY, d_model=4 * TINY.d_model, d_ff=4 * TINY.d_ff)
    _, _, prog = _gpt(config)
    part = T.apply_schedule(prog, _mesh(2), [T.FSDP("data"), T.Remat("dots"),
                                             T.Pipeline("stage", microbatches=4, schedule="1f1b")]).partitioning
    held = dict(search.CostModel(part, "cpu").cost().memory_at_peak)
    summed = [b for n, b in held.items() if n.endswith(" accumulated over the microbatches")]
    assert sorted(summed)[-2:] == [2 * 64 * 128 * 4] * 2
    assert any(n.endswith(" gathered for the ticks") for n in held)
    assert not any(n.endswith(" as computed") and b >= 2 * 64 * 128 * 4 for n, b in held.items())


@pytest.mark.slow
def test_the_peak_of_rematerializing_stages_moving_once_a_step_is_xlas():
    """ZeRO-1 with 'dots' under 1F1B: the stage's whole gradient accumulator lives
    across the tick loop; the modeled peak within 20% of XLA's (temp + arguments +
    outputs - alias)."""
    part = _remat_once("gpt-zero1-dots-1f1b")
    _, args, _ = _gpt(TINY)
    ma = partir.lower(part, backend="shard_map").lower(*args).compile().memory_analysis()
    xla = ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
    assert 0.8 < search.CostModel(part, "cpu").cost().memory_peak / xla < 1.2


@pytest.mark.slow
@pytest.mark.parametrize("config,policy,schedule,backend", [
    (TINY, "full", "gpipe", "shard_map"), (TINY, "full", "1f1b", "jit"),
    (TINY_LLAMA, "full", "1f1b", "shard_map"), (TINY_LLAMA, "qkv", "gpipe", "jit")],
    ids=["gpt-full-gpipe-shard_map", "gpt-full-1f1b-jit", "llama-full-1f1b-shard_map", "llama-qkv-gpipe-jit"])
def test_a_policy_tightening_the_users_checkpoint_in_pipelined_layers_computes_what_jit_computes(
        config, policy, schedule, backend):
    """The user's jax.checkpoint saves the matmuls ('dots'); the policy keeps less, so
    the stage recomputes in its backward ticks what the user's policy saved too."""
    config = dataclasses.replace(config, remat=True, remat_policy="dots")
    _, _, prog = _gpt(config)
    part = T.apply_schedule(prog, _mesh(2), [T.DataParallel("data"), T.Remat(policy),
                                             T.Pipeline("stage", microbatches=4, schedule=schedule)]).partitioning
    assert part.rematerialized and part.pipelines
    _same_step(part, config, backend)
