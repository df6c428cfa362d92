"""Uneven pipeline stages: L layers over S stages when S does not divide L. Each stage
runs ceil(L/S) layer slots, the last stages one layer fewer (a padding slot that
passes its carry on); the stacked values keep the user's [L, ...] layout. The step
computes what plain `jax.jit` computes (loss, updated parameters, Adam moments)."""

import collections
import dataclasses
import functools
import io

import jax
import numpy as np
import pytest

import partir
import search
import tactics as T
from automap._explain import stage_table
from examples import gpt, llama
from partir import MeshSpec
from rich.console import Console

EPS = 1e-3  # Adam eps large enough that near-zero gradients cannot flip updates
#: A GPT of 3 layers: 2 stages of 2 slots, the second holding one layer and a padding slot.
THREE = gpt.GPTConfig(n_layers=3, d_model=16, n_heads=2, d_ff=32, vocab=32, seq_len=8, batch=16, scan_layers=True,
                      adam_eps=EPS)
#: A Llama of 5 layers: 4 stages of 2 slots run 2, 1, 1 and 1 layers.
FIVE = llama.LlamaConfig(n_layers=5, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, vocab=32, seq_len=8, batch=16,
                         scan_layers=True, adam_eps=EPS)

#: A GPT whose residuals dominate its peak (long sequence, small vocabulary).
LONG = gpt.GPTConfig(n_layers=8, d_model=64, n_heads=4, d_ff=128, vocab=64, seq_len=256, batch=16, scan_layers=True)


@functools.cache
def _lifted(config):
    step, args = (llama if isinstance(config, llama.LlamaConfig) else gpt).make_train_step(config)
    return step, args, partir.lift(step, *args)


def _plan(config, mesh, others, microbatches=2, repeats=1):
    _, _, prog = _lifted(config)
    pipeline = T.Pipeline("stage", microbatches=microbatches, repeats=repeats)
    return T.apply_schedule(prog, mesh, others + [pipeline]).partitioning


@functools.cache
def _three_compiled(remat: bool):
    """(the plan, its compiled shard_map step) of THREE over data=4 x stage=2 with
    DataParallel, and Remat('full') when `remat` (compiled once for the tests reading it)."""
    _, args, _ = _lifted(THREE)
    part = _plan(THREE, MeshSpec.of(data=4, stage=2), [T.DataParallel("data")] + ([T.Remat("full")] if remat else []))
    return part, partir.lower(part, backend="shard_map").lower(*args).compile()


def _same_step(part, config, backend):
    step, args, prog = _lifted(config)
    ours = partir.lower(part, backend=backend)(*args)
    theirs = jax.jit(step)(*args)
    for name, a, b in zip(prog.output_names, jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        assert np.shape(a) == np.shape(b), name
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6, err_msg=name)


# Uneven stages compute what jit computes by default in
# test_uneven_stages_rematerializing_their_layers_compute_what_jit_computes_in_less_memory.
@pytest.mark.slow
def test_three_layers_over_two_stages_compute_what_jit_computes():
    part = _plan(THREE, MeshSpec.of(data=4, stage=2), [T.DataParallel("data")])
    _same_step(part, THREE, "shard_map")


#: Llama of 5 layers over 4 stages with tactics on the other axes: (tactics, mesh).
LLAMA_CASES = {
    "dp": ([T.DataParallel("data")], MeshSpec.of(data=2, stage=4)),
    "megatron": ([T.Megatron("model")], MeshSpec.of(model=2, stage=4)),
}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jit", "shard_map"])
@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_five_llama_layers_over_four_stages_compute_what_jit_computes(case, backend):
    others, mesh = LLAMA_CASES[case]
    _same_step(_plan(FIVE, mesh, others), FIVE, backend)


@pytest.mark.slow
def test_three_layers_over_two_stages_under_the_jit_lowering():
    part = _plan(THREE, MeshSpec.of(data=4, stage=2), [T.DataParallel("data")])
    _same_step(part, THREE, "jit")


# (4 s: in `make test-slow`; the default run holds the all-to-alls exchanging a stage's
# layer chunks in tests/test_pipeline_circular.py::test_compiled_collectives_are_exactly_the_modeled_ones,
# uneven stages' numerics and peak in
# test_uneven_stages_rematerializing_their_layers_compute_what_jit_computes_in_less_memory.)
@pytest.mark.slow
def test_compiled_collectives_are_the_modeled_ones():
    """Per (kind, axes, bytes), counted once per loop body: the tick loops' permutes of
    one microbatch's activation, the all-to-alls exchanging each stage's layers of the
    parameters in and of their gradients out, the data axis's gradient reductions."""
    part = _plan(THREE, MeshSpec.of(data=4, stage=2), [T.DataParallel("data")])
    _, args, prog = _lifted(THREE)
    free = search.materialization(prog).from_scalars
    text = partir.lower(part, backend="shard_map", free=free).lower(*args).compile().as_text()
    compiled = partir.collective_buffers(partir.collectives(text, part.mesh.jax_mesh()), reduce_scatter=False)
    modeled = collections.Counter((c.kind, c.axes, int(c.bytes)) for c in search.CostModel(part, "cpu").cost().collectives)
    activation = THREE.batch // 4 // 2 * THREE.seq_len * THREE.d_model * 4  # f32, a microbatch of a data block
    assert compiled[(partir.Kind.COLLECTIVE_PERMUTE, ("stage",), activation)] == 2  # forward and backward loop
    assert compiled == modeled


def test_each_stage_stores_its_share_of_the_layer_stack():
    """The layers' parameters and Adam moments are split over the stage axis along
    another dim (a dim of 3 layers cannot be split over 2): per device 1/S of them, as
    XLA's arguments hold them."""
    part, compiled = _three_compiled(False)
    _, args, prog = _lifted(THREE)
    cost = search.pipeline_cost(part, part.pipelines[0], "cpu")
    layers = [v for v in prog.inputs if "['layers']" in prog.name(v)]
    assert cost.stage_bytes == sum(prog.values[v].nbytes for v in layers) / 2
    rest = sum(float(np.prod(part.tiling(v).shard_shape(prog.values[v].shape, part.mesh))) * prog.values[v].nbytes
               / max(1, int(np.prod(prog.values[v].shape))) for v in prog.inputs if v not in layers)
    assert compiled.memory_analysis().argument_size_in_bytes == cost.stage_bytes + rest


def test_a_tick_lasts_as_long_as_the_busiest_stage():
    """3 layers over 2 stages tick as long as 4 over 2: each stage runs 2 layer slots."""
    ticks = []
    for layers in (3, 4):
        config = dataclasses.replace(THREE, n_layers=layers)
        part = _plan(config, MeshSpec.of(data=4, stage=2), [T.DataParallel("data")])
        ticks.append(search.CostModel(part, "cpu").cost().pipeline_ticks)
    assert ticks[0] == pytest.approx(ticks[1])


def test_the_last_stages_run_one_layer_fewer():
    split = partir.StageSplit(126, 16)
    assert [len(r) for r in split.layers()] == [8] * 14 + [7] * 2
    assert [list(r) for r in partir.StageSplit(5, 4).layers()] == [[0, 1], [2], [3], [4]]


def _stage_rows(layers, repeats, names, sizes):
    out = Console(file=io.StringIO(), width=200)
    out.print(stage_table("stage", layers, repeats, names, sizes))
    text = out.file.getvalue()
    assert "uneven" in text
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]


def test_the_stage_table_says_which_layers_each_stage_runs():
    assert _stage_rows(5, 1, ["data", "stage"], [2, 4]) == [
        ["0", "0..1", "0, 4"], ["1", "2..2 + 1 padding slot", "1, 5"],
        ["2", "3..3 + 1 padding slot", "2, 6"], ["3", "4..4 + 1 padding slot", "3, 7"]]


@pytest.mark.slow
def test_the_stage_table_lists_circular_chunks_of_unequal_lengths():
    """5 layers in 4 chunks of 2 slots (2, 1, 1, 1 layers): stage 0 runs chunks 0 and 2,
    stage 1 chunks 1 and 3, their padding slots counted."""
    assert _stage_rows(5, 2, ["data", "stage"], [4, 2]) == [
        ["0", "0..1, 3..3 + 1 padding slot", "0, 2, 4, 6"], ["1", "2..2, 4..4 + 2 padding slots", "1, 3, 5, 7"]]


def test_a_circular_schedule_of_more_chunks_than_layers_is_refused_naming_the_fix():
    _, _, prog = _lifted(THREE)
    with pytest.raises(T.TacticError, match="2 stages x 2 repeats make more chunks than the 3 layers.*at most 1"):
        T.apply_schedule(prog, MeshSpec.of(data=4, stage=2), [T.Pipeline("stage", microbatches=2, repeats=2)])


def test_uneven_stages_rematerializing_their_layers_compute_what_jit_computes_in_less_memory():
    """Remat('full') over 3 layers in 2 stages (a padding slot on the second): each stage
    keeps its slots' layer inputs per microbatch and runs its layers again in the
    backward ticks; the step equals jax.jit's, the residuals in flight are the stage's 2
    slots' layer inputs (a device's 4 sequences x 8 tokens x 16 wide, f32), and the
    modeled peak falls as XLA's does: 298 -> 144 KB against 311 -> 161 KB (0.96 and 0.89
    of XLA's; 0.91 and 0.82 while the model packed the tick loops' buffers into the
    step's output allocations, 0.59 and 0.65 before the tick loops' own buffers and the
    stage's padded rows, exchanged in and accumulated out, were modeled)."""
    step, args, prog = _lifted(THREE)
    peaks = {}
    for remat in (False, True):
        part, compiled = _three_compiled(remat)
        ma = compiled.memory_analysis()
        xla = ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
        peaks[remat] = (search.CostModel(part, "cpu").cost().memory_peak, xla)
    assert part.rematerialized
    flight = search.pipeline_cost(part, part.pipelines[0], "cpu").in_flight_bytes
    assert flight == 2 * (THREE.batch // 4) * THREE.seq_len * THREE.d_model * 4
    ours, theirs = compiled(*args), jax.jit(step)(*args)
    for name, a, b in zip(prog.output_names, jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6, err_msg=name)
    (model_plain, xla_plain), (model_full, xla_full) = peaks[False], peaks[True]
    assert xla_full < xla_plain and model_full < model_plain
    assert all(0.8 < model / xla < 1.2 for model, xla in peaks.values())



def test_uneven_stages_hold_their_slots_residuals_not_every_layers():
    # The plan holds the residuals between the scans whole along the stage axis, and the
    # stages keep their slots' of them: 7 layers over 4 stages keep what 8 do (2 slots a
    # stage), where sizing them as all 7 layers had put the 405B-shaped pipeline at
    # 4006 GiB a device.
    def peak(layers):
        config = dataclasses.replace(LONG, n_layers=layers)
        step, args = gpt.make_train_step(config, abstract=True)
        part = T.apply_schedule(partir.lift(step, *args), MeshSpec.of(data=2, stage=4),
                                [T.DataParallel("data"), T.Pipeline("stage", microbatches=4)]).partitioning
        return search.CostModel(part, "h100").cost().memory_peak

    # (Within 1%: uneven stages hold their padded rows of the exchanged parameters too.)
    assert peak(7) <= 1.01 * peak(8)


#: Uneven stages rematerializing their layers (slow): (config, mesh, policy, backend).
REMAT_CASES = {
    "gpt-full-jit": (THREE, MeshSpec.of(data=4, stage=2), "full", "jit"),
    "llama-dots-shard_map": (FIVE, MeshSpec.of(data=2, stage=4), "dots", "shard_map"),
    "llama-dots-jit": (FIVE, MeshSpec.of(data=2, stage=4), "dots", "jit"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(REMAT_CASES))
def test_uneven_stages_rematerializing_their_layers_compile_the_modeled_collectives(case):
    """With DataParallel, both lowerings: the step equals jax.jit's, and XLA's
    collectives are exactly the modeled ones (the recomputation adds none here); under
    the shard_map lowering the modeled peak is XLA's within 20% (Llama 'dots': 217
    against 247 KB; 0.65 before the tick loops' buffers and the padded rows)."""
    config, mesh, policy, backend = REMAT_CASES[case]
    part = _plan(config, mesh, [T.DataParallel("data"), T.Remat(policy)])
    _same_step(part, config, backend)
    _compiled_as_modeled(part, config, backend)


def _compiled_as_modeled(part, config, backend, **lowering):
    """XLA's collectives of `part`'s step (lowered with `lowering`) are exactly the
    modeled ones, and under the shard_map lowering its peak (temp + arguments + outputs
    - alias) is the modeled one within 20%."""
    _, args, _ = _lifted(config)
    program = partir.lower(part, backend=backend, **lowering).lower(*args).compile()
    compiled = partir.collective_buffers(partir.collectives(program.as_text(), part.mesh.jax_mesh()),
                                         reduce_scatter=False)
    cost = search.CostModel(part, "cpu").cost()
    assert compiled == collections.Counter((c.kind, c.axes, int(c.bytes)) for c in cost.collectives)
    if backend == "shard_map":
        ma = program.memory_analysis()
        xla = ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
        assert 0.8 < cost.memory_peak / xla < 1.2


@pytest.mark.slow
@pytest.mark.parametrize("policy", [None, "dots"])
def test_a_stage_of_uneven_stages_keeps_its_slots_residuals(policy):
    """3 layers over 2 stages keep in flight what 4 over 2 keep: each stage 2 layer
    slots' residuals of every microbatch (the plan holds them whole along the stage
    axis, all 3 layers; the stage keeps its own slots only), and the memory model sizes
    each residual kept between the scans so: 2/3 of its block at rest."""
    flight = []
    for layers in (3, 4):
        config = dataclasses.replace(THREE, n_layers=layers)
        remat = [T.Remat(policy)] if policy else []
        part = _plan(config, MeshSpec.of(data=4, stage=2), [T.DataParallel("data")] + remat)
        flight.append(search.pipeline_cost(part, part.pipelines[0], "cpu").in_flight_bytes)
    assert flight[0] == pytest.approx(flight[1])
    part = _plan(THREE, MeshSpec.of(data=4, stage=2), [T.DataParallel("data")] + remat)
    prog, model = part.program, search.CostModel(part, "cpu")
    kept = partir.kept_in_slots(part, part.pipelines[0])
    modeled = model._value_bytes()

    def at_rest(v):
        shape = prog.values[v].shape
        return prog.values[v].nbytes / np.prod(shape) * np.prod(part.tiling(v).shard_shape(shape, part.mesh))

    assert kept and all(modeled[v] == pytest.approx(at_rest(v) * 2 / 3) for v in kept)


# -- the circular schedule over chunks of unequal lengths ----------------------------------
#: Circular schedules of S*R chunks not dividing the layers (slow): (config, mesh, tactics
#: on the other axes, microbatches, backend). 5 layers in 4 chunks: 2, 1, 1, 1 (stage 0
#: runs layers 0-1 and 3, stage 1 layer 2 and 4, each chunk padded to 2 slots); Llama's 6:
#: 2, 2, 1, 1.
CIRCULAR_CASES = {
    "gpt5-dp-shard_map": (dataclasses.replace(THREE, n_layers=5), MeshSpec.of(data=4, stage=2),
                          lambda: [T.DataParallel("data")], 2, "shard_map"),
    "gpt5-remat-jit": (dataclasses.replace(THREE, n_layers=5), MeshSpec.of(data=4, stage=2),
                       lambda: [T.DataParallel("data"), T.Remat("full")], 2, "jit"),
    "llama6-megatron-m4-jit": (dataclasses.replace(FIVE, n_layers=6), MeshSpec.of(data=2, model=2, stage=2),
                               lambda: [T.DataParallel("data"), T.Megatron("model")], 4, "jit"),
    "llama6-megatron-m4-shard_map": (dataclasses.replace(FIVE, n_layers=6), MeshSpec.of(data=2, model=2, stage=2),
                                     lambda: [T.DataParallel("data"), T.Megatron("model")], 4, "shard_map"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CIRCULAR_CASES))
def test_the_circular_schedule_runs_chunks_of_unequal_lengths(case):
    """Two stages of two repeats over 5 or 6 layers: the shorter chunks padded to the
    longest, a padding slot passing its carry on. The step equals `jax.jit`'s, XLA's
    collectives are exactly the modeled ones (the exchange out of the [L, ...] layout
    delivers each stage's rows in chunk order: one all-to-all each way, the ring's
    permutes), and under the shard_map lowering the modeled peak is XLA's within 20%."""
    config, mesh, make, microbatches, backend = CIRCULAR_CASES[case]
    part = _plan(config, mesh, make(), microbatches, repeats=2)
    split = part.pipelines[0].split(2)
    assert split.layers() == (((0, 1, 3), (2, 4)) if config.n_layers == 5 else ((0, 1, 4), (2, 3, 5)))
    _same_step(part, config, backend)
    _, _, prog = _lifted(config)
    free = {"free": search.materialization(prog).from_scalars} if backend == "shard_map" else {}
    _compiled_as_modeled(part, config, backend, **free)
