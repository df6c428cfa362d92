"""Rematerialization inside the stages of a 1F1B pipeline (`Remat` with
`Pipeline(schedule="1f1b")`): the ring of microbatches in flight keeps what recomputing
needs instead of the residuals the policy drops, and the backward unit recomputes them.
The step computes what plain `jax.jit` computes in both lowerings, XLA's collectives are
the modeled ones, the modeled ring and peak shrink as XLA's peak does, and the search
takes the pair where it is what fits."""

import dataclasses

import pytest

import partir
import search
import tactics as T
from examples import gpt
from partir import MeshSpec
from test_pipeline import DEEP, TINY, TINY_LLAMA, _gpt, _mesh, peaks
from test_pipeline_onef import _same_step_and_collectives  # (the collectives' check: the recomputation's included)


def _plan(stages: int, microbatches: int, policy: str | None, config=TINY, others=None, mesh=None):
    """`others` (default: DataParallel over 'data'), `Remat(policy)` (none when None),
    then a 1F1B Pipeline over 'stage'."""
    _, _, prog = _gpt(config)
    others = [T.DataParallel("data")] if others is None else others
    remat = [T.Remat(policy)] if policy else []
    pipe = T.Pipeline("stage", microbatches=microbatches, schedule="1f1b")
    return T.apply_schedule(prog, mesh or _mesh(stages), others + remat + [pipe]).partitioning


def test_1f1b_rematerializing_its_stages_computes_what_jit_computes():
    """GPT, data=4 x stage=2, M=4 (a ring of 3), Remat('full'): each stage keeps its
    layers' inputs per microbatch in flight and runs its layers again in the backward
    unit."""
    part = _plan(2, 4, "full")
    assert part.rematerialized and part.pipelines[0].schedule == "1f1b"
    _same_step_and_collectives(part, TINY, "shard_map")


#: Slow cases: (config, policy, stages, microbatches, tactics on the other axes, mesh, backend).
SLOW = {
    "gpt-full-jit": (TINY, "full", 2, 4, None, None, "jit"),
    "gpt-dots": (TINY, "dots", 2, 4, None, None, "shard_map"),
    "gpt-dots-jit": (TINY, "dots", 2, 4, None, None, "jit"),
    "gpt-full-4x8": (TINY, "full", 4, 8, None, None, "shard_map"),
    "llama-full": (TINY_LLAMA, "full", 2, 4, None, None, "shard_map"),
    "llama-megatron-full-jit": (TINY_LLAMA, "full", 2, 4, [T.DataParallel("data"), T.Megatron("model")],
                                MeshSpec.of(data=2, model=2, stage=2), "jit"),
    "llama-megatron-dots": (TINY_LLAMA, "dots", 2, 4, [T.DataParallel("data"), T.Megatron("model")],
                            MeshSpec.of(data=2, model=2, stage=2), "shard_map"),
    "gpt-fsdp-full": (TINY, "full", 4, 2, [T.FSDP("data")], None, "shard_map"),
    "llama-megatron-collectives": (TINY_LLAMA, "collectives", 2, 4, [T.DataParallel("data"), T.Megatron("model")],
                                   MeshSpec.of(data=2, model=2, stage=2), "shard_map"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW))
def test_1f1b_rematerializing_its_stages_computes_what_jit_computes_more(case):
    config, policy, stages, m, others, mesh, backend = SLOW[case]
    _same_step_and_collectives(_plan(stages, m, policy, config, others, mesh), config, backend)


def test_remat_and_a_1f1b_pipeline_make_the_same_plan_in_either_order():
    _, _, prog = _gpt()
    pipe = T.Pipeline("stage", microbatches=4, schedule="1f1b")
    before = _plan(2, 4, "full")
    after = T.apply_schedule(prog, _mesh(2), [T.DataParallel("data"), pipe, T.Remat("full")]).partitioning
    assert before.rematerialized == after.rematerialized and before.pipelines == after.pipelines


# -- the cost model ------------------------------------------------------------------------
def test_the_1f1b_ring_keeps_what_the_policy_keeps_of_the_microbatches_in_flight():
    """S=2, M=4: a ring of 3 microbatches. 'full' keeps each layer's input: the stage's
    2 layers x 3 microbatches x a microbatch's one sequence of 8 tokens x 16 wide, f32;
    'dots' the matmul outputs too; without Remat every residual. GPipe keeps all 4."""
    flight = {p: search.pipeline_cost(part, part.pipelines[0], "cpu").in_flight_bytes
              for p, part in ((p, _plan(2, 4, p)) for p in (None, "dots", "full"))}
    one = (TINY.batch // 4 // 4) * TINY.seq_len * TINY.d_model * 4
    assert flight["full"] == 2 * 3 * one
    assert flight["full"] < flight["dots"] < flight[None]
    _, _, prog = _gpt()
    gpipe = T.apply_schedule(prog, _mesh(2), [T.DataParallel("data"), T.Remat("full"),
                                              T.Pipeline("stage", microbatches=4)]).partitioning
    assert search.pipeline_cost(gpipe, gpipe.pipelines[0], "cpu").in_flight_bytes == 2 * 4 * one


def test_the_1f1b_peak_counts_the_recomputing_inputs_as_the_ring_holds_them():
    """The memory model's stacks of the layer inputs kept for recomputing are the
    ring's: the stage's layers' of the microbatches in flight (`in_flight_bytes`)."""
    from search.cost._pipeline import _recomputing

    part = _plan(2, 4, "full")
    model = search.CostModel(part, "cpu")
    model.cost()
    inputs = set(_recomputing(part, part.pipelines[0])[1])
    *_, (_, _, sizes, keys) = model._memory(model._value_bytes(), exact=True)
    stacks = [size for size, key in zip(sizes, keys) if key[0] == "remat" and key[1] in inputs]
    assert stacks and sum(stacks) == pytest.approx(search.pipeline_cost(part, part.pipelines[0], "cpu").in_flight_bytes)


def test_the_1f1b_backward_unit_runs_the_layers_again():
    """The recomputation runs in the backward unit of each tick: it takes longer, the
    forward one does not."""
    (plain,) = search.CostModel(_plan(2, 4, None), "cpu").cost().pipeline_ticks
    (full,) = search.CostModel(_plan(2, 4, "full"), "cpu").cost().pipeline_ticks
    assert full.forward == pytest.approx(plain.forward) and full.backward > plain.backward


# (3 s: in `make test-slow`; the default run holds 1F1B's peak to XLA's in
# tests/test_pipeline_onef.py::test_the_modeled_peak_of_1f1b_is_xlas_within_a_fifth, and a
# recomputing GPipe pipeline's in tests/test_pipeline_uneven.py and tests/test_pipeline_remat.py.)
@pytest.mark.slow
def test_remat_lowers_the_modeled_peak_of_1f1b_as_it_lowers_xlas():
    """GPT, data=4 x stage=2, M=4: 'full' lowers XLA's peak (299 -> 145 KB) and the
    modeled one (300 -> 135 KB), both within a fifth of XLA's."""
    _, args, _ = _gpt(TINY)
    (model_plain, xla_plain), (model_full, xla_full) = both = [peaks(_plan(2, 4, p), args) for p in (None, "full")]
    assert xla_full < xla_plain and model_full < model_plain
    assert all(0.8 < model / xla < 1.2 for model, xla in both)


@pytest.mark.slow
def test_remat_under_1f1b_keeps_fewer_layer_inputs_than_under_gpipe_as_xla_does():
    """32 tokens, d_ff 64, data=4 x stage=2, M=8 (a ring of 3): with 'full' the 1F1B
    stage keeps 3 microbatches' layer inputs where GPipe's keeps 8; XLA's peak is lower
    (326 -> 310 KB), so is the modeled one (260 -> 256 KB), 1F1B's within a fifth of
    XLA's (0.82; 0.77 before the forward's initial carry was held through the backward
    ticks). GPipe's with 'full' is modeled at 0.80 (the working set of one layer's
    recomputation: docs/pipeline.md)."""
    config = dataclasses.replace(TINY, seq_len=32, d_ff=64, batch=32)
    _, args, prog = _gpt(config)
    gpipe = T.apply_schedule(prog, _mesh(2), [T.DataParallel("data"), T.Remat("full"),
                                              T.Pipeline("stage", microbatches=8)]).partitioning
    (model_1f1b, xla_1f1b), (model_gpipe, xla_gpipe) = peaks(_plan(2, 8, "full", config), args), peaks(gpipe, args)
    assert xla_1f1b < xla_gpipe and model_1f1b < model_gpipe
    assert 0.8 < model_1f1b / xla_1f1b < 1.2


# -- the search ----------------------------------------------------------------------------
def test_the_search_rematerializes_a_1f1b_pipeline_where_only_that_fits():
    """The deep GPT of tests/test_pipeline.py on data=4 x stage=2 (H100), M=16: with
    10.2 GB the search's best plan without a pipeline does not fit (10.3 GB, Remat
    included), nor does GPipe with Remat (its layer inputs of all 16 microbatches: 10.3
    GB) or 1F1B without it (16.0 GB); 1F1B with Remat does (a ring of 3: 9.9 to 10.0
    GB), and the search takes it (before, the pair was refused: no plan fit)."""
    step, args = gpt.make_train_step(DEEP, abstract=True)
    prog = partir.lift(step, *args)
    auto = search.AutomaticPartition(axes=("stage",), pipelines=(16,), memory_limit=10.2e9, max_episodes=30,
                                     device="h100")
    part = T.apply_schedule(prog, MeshSpec.of(stage=2, data=4), [T.DataParallel("data"), auto]).partitioning
    assert [p.schedule for p in part.pipelines] == ["1f1b"] and part.rematerialized
