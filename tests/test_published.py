"""The cost model's time against published training runs (`benchmarks/published.py`):
the data file's schema, the ±15% band on the `check` rows (never used to fit), the
configurations of one model ranked as measured, the published configurations fitting
the GPUs they ran on, a step of several micro-batches, and the mechanisms
that moved them: the fused attention kernel and XLA:GPU's fusion of casts (GPU presets
only), the `cpu` preset left the roofline of XLA:CPU."""

import dataclasses
import importlib.util
import os
import sys

import jax.numpy as jnp
import pytest

import partir
import search
import tactics
from examples import llama

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "published.py")
_spec = importlib.util.spec_from_file_location("published_bench", _PATH)
published = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = published  # dataclasses look their module up
_spec.loader.exec_module(published)

ROWS = published.load()
CHECK = [r for r in ROWS if r.split == "check" and r.expressible]
#: Expressible rows that are configurations of a run with another expressible row.
_RUNS = [published.run_of(r) for r in ROWS if r.expressible]
RANKED = [r for r in ROWS if r.expressible and _RUNS.count(published.run_of(r)) > 1]
EXPRESSIBLE = [r for r in ROWS if r.expressible]
_MODELED: dict = {}


def _modeled(row, episodes: int = 0) -> dict:
    """The row's published configuration, modeled, and with `episodes` its searched plan,
    once per session."""
    if (row.id, episodes) not in _MODELED:
        _MODELED[row.id, episodes] = published.model_row(row, episodes=episodes)
    return _MODELED[row.id, episodes]


def test_data_file_has_the_rows_the_benchmark_needs():
    assert len(ROWS) >= 12
    expressible = [r for r in ROWS if r.expressible]
    assert len(expressible) >= 6
    assert {r.split for r in expressible} == {"fit", "check"}
    assert {r.device for r in ROWS} >= {"h100", "a100-efa", "tpu-v5e", "tpu-v5p"}
    assert any(r.experts > 1 for r in ROWS)  # MoE among them
    assert all(r.source for r in ROWS)


def _load_edited(tmp_path, old: str, new: str):
    """`published.load` of the data file with the first `old` replaced by `new`."""
    with open(published.RUNS, encoding="utf-8") as f:
        text = f.read().replace(old, new, 1)
    bad = tmp_path / "runs.toml"
    bad.write_text(text)
    return published.load(str(bad))


def test_a_bad_row_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"maxtext-llama3-70b-h100-128.*split 'train' not in \('fit', 'check'\)"):
        _load_edited(tmp_path, 'split = "fit"', 'split = "train"')


def test_an_fp8_scaling_that_is_no_recipe_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"bridge-llama3-8b-h100-8-fp8.*fp8_scaling 'late' not in \('delayed', "):
        _load_edited(tmp_path, 'fp8_scaling = "current"', 'fp8_scaling = "late"')


def test_a_switch_that_is_not_true_or_false_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"nemo-llama31-8b-h100-8-cp2.*fused_kernels must be true or false"):
        _load_edited(tmp_path, "fused_kernels = true", 'fused_kernels = "yes"')


#: Check rows whose modeled published configuration falls outside the band, and why.
#:
#: MaxText's Llama 2 70B in FP8 on 256 to 2048 H100s, +19.1% to +22.4%: the model says
#: they run faster than they did (on 64 and 128, +5.1% and +10.4%, within the band).
#: Each of these steps takes about 1 s longer than modeled, where their BF16 twins are
#: modeled within 0.2 s and the Llama 3 FP8 runs within 0.1-0.3 s on twice the tokens a
#: device, so no FP8 cost a step shares with those tables explains it. Not for want of
#: overlap either: the model hides these runs' FSDP moves with room to spare, and
#: charging hidden collectives twice their time moves them by 2-4 points while it takes
#: torchtitan's A100 rows out of the band. The table ran on the recipe's older image
#: (maxtext-2024-12-09; the Llama 3 tables on maxtext-25.01). Two mechanisms brought the
#: other FP8 rows in: a fusion reads the buffers its fused producers are re-derived from
#: (`CostModel._moved`: before, a chain of cheap ops fused into a reader read nothing,
#: and quantizing casts, norms and residual adds moved only what they wrote; the
#: constants fit again), which took the Llama 2 FP8 rows from +11.2..+29.4% and
#: Megatron-Bridge's Llama 3 8B in FP8 from +16.6% to +7.2%; and that row's current
#: scaling (its table's "FP8-CS", `Row.fp8_scaling`): each tensor's maximum is read
#: before its cast and a sharded weight's all-reduced, +2.5%.
#:
#: Before the FP8 rows, none. Llama 3 405B on 8192 H100s (TP8 PP16 FSDP64), the last to
#: leave this set, runs the run's interleaved 1F1B over chunks of unequal lengths (16
#: stages x 2 repeats, 32 chunks of 4 layer slots, the last 2 of 3 layers): a chunk's
#: forward and backward in each of 79 ticks that run one, bubble 15/79. It models 14.09 s a step against the
#: 12.56 s its 430 TFLOP/s give (-10.8%); as the circular schedule in GPipe's order it
#: modeled 14.11 s on 3 December (13.85 s, -9.3%, when it left this set). That was from
#: 16.46 s (-23.7%) by two
#: changes: XLA:GPU's reassociation of the tensor-parallel input gradients' sums (five
#: all-reduces a layer's backward become two, `DeviceSpec.reassociate`: 15.21 s, -17.4%);
#: and its row's sequence parallelism (the Llama 3 paper's tensor parallelism cites
#: Korthikanti et al. 2023): each all-reduce a reduce-scatter and an all-gather, the
#: carries a stage sends and the last stage's final carries an eighth as large. Before,
#: as GPipe over uneven stages, it modeled 18.6 s (-33%), and with its weights gathered
#: at every tick 32.0 s. (NeMo's Llama 3.1 70B on 64 H100s, TP4 PP4 CP2 DP2 with 64
#: microbatches, left this set by two mechanisms: its row says its run overlaps the
#: tensor-parallel collectives with the matmuls, `tp_comm_overlap`, as its recipe sets
#: `ub_tp_comm_overlap`, -17.1% -> -2.5%; and its ZeRO-1 gradients are reduce-scattered
#: once a step: +1.1% with both, +4.3% with its recipe's sequence parallelism.)
OUT_OF_BAND = {f"maxtext-llama2-70b-h100-{n}-fp8" for n in (256, 512, 1024, 2048)}


def _row_param(row, *marks):
    """`row` as a test parameter in its row's xdist group: under `make test`'s
    `--dist loadgroup` one worker runs every test of a row, and models it once
    (`_modeled`), where two workers modeled it twice."""
    return pytest.param(row, marks=(pytest.mark.xdist_group(row.id), *marks), id=row.id)


@pytest.mark.parametrize("row", [_row_param(r) for r in CHECK])
def test_check_row_within_band(row):
    out = _modeled(row)
    within = abs(out["error"]) <= published.BAND
    assert within == (row.id not in OUT_OF_BAND), (row.id, out["published"]["mfu"], out["published_mfu"])


#: The pairs of configurations the model ranks against the measurement (the benchmark
#: prints every pair): MaxText's Llama 3 70B on 256 H100s (FSDP 256) against 1024 and
#: 2048 (FSDP 128, data parallel 8 and 16), measured 1.0% and 2.9% slower per token per
#: device at scale (each the recipe's last step), modeled 0.2% faster (0.7% before a
#: ring's steps within a node paid NVLink's latency rather than InfiniBand's, as NCCL's
#: tuning model prices them): nothing in the model slows a step as data-parallel groups
#: grow beyond the gradient reductions they hide, and the hidden all-gathers over 32
#: nodes slow FSDP 256's compute more than over 16. The same recipe's Llama 2 70B table
#: (its six columns are rows too) measured the same configurations in the model's order:
#: FSDP 256 1.2% slower a token than FSDP 128 with data parallelism 16, 0.9-1.0% than 4
#: and 8 (ties), and the model ranks all 15 of that table's pairs as measured; the
#: recipe's Llama 3 70B FP8 table (its five columns are rows too: `examples/_fp8.py`)
#: has FSDP 256 the slowest of its columns, 1.6-2.6% slower a token than FSDP 128 with
#: data parallelism 4 and 16, as the model ranks it. Within that table the model ranks
#: 9 of 10 pairs as measured; the tenth is data parallelism 8 against 16, measured 1.5%
#: apart (16 faster) and modeled 0.02% apart, the other way: the model puts the same
#: FSDP 128 group's step within 0.1% whatever the data-parallel degree, where the
#: FP8 table's measured columns zigzag by 1.0-2.6% between neighbours (and its BF16
#: twin's rise by 0.5-1.9%). MaxText's Llama 2 70B FP8 table, out of the band
#: (`OUT_OF_BAND`), adds four: FSDP 256 measured 1.7% and 2.1% faster a token than FSDP
#: 128 with data parallelism 4 and 8 (modeled 0.7% slower), and data parallelism 16
#: measured 2.2% and 2.6% faster than 4 and 8 (modeled 0.1% slower): the unexplained
#: second a step that the table adds from 64 GPUs to 256 is not in the model, so
#: neither is its 2.1-2.6% wobble above that. Not met: kept here so that a change to
#: the ranking, either way, shows.
#: NeMo's Llama 3.1 70B on 64 H100s, measured 5-8% faster per token per device than
#: MaxText's 70B runs on 128 to 2048 H100s, is ranked so (modeled 8-9% faster) since its
#: row says its run overlaps the tensor-parallel collectives (`tp_comm_overlap`; it was
#: modeled 11-12% slower with them exposed and its ZeRO-1 reduce-scatters per tick).
#: torchtitan's Llama 2 70B on 64 A100s at one sequence a GPU with selective op
#: checkpointing (`Remat('every_other_dot')`) against two with full checkpointing, a tie
#: as measured (355 and 353 tokens/s), left this set when its rows moved to the machine
#: they ran on, AWS's A100 nodes joined by 400 Gb/s of EFA (`a100-efa`): modeled 4.2%
#: apart (-8.6% and -4.2% off), where on a DGX A100's InfiniBand, 8x the bandwidth, the
#: model hid the FSDP moves at one sequence as at two and put them 8.5% apart. Since
#: fusions read what their fused producers read (`CostModel._moved`), modeled 5.1%
#: apart (-8.5% and -3.3% off), a tie broken by 0.1 points of `TIE`: with the constants
#: fit again the matmuls run faster, the two-sequence step falls 1% (24.23 -> 24.01 s)
#: and the one-sequence step leaves more of its FSDP moves over EFA exposed (2.26 ->
#: 2.33 s), its step the same (12.62 s).
MISRANKED = {("torchtitan-llama2-70b-a100-64", "torchtitan-llama2-70b-a100-64-b1-op"),
             ("maxtext-llama3-70b-h100-256", "maxtext-llama3-70b-h100-1024"),
             ("maxtext-llama3-70b-h100-256", "maxtext-llama3-70b-h100-2048"),
             ("maxtext-llama3-70b-h100-1024-fp8", "maxtext-llama3-70b-h100-2048-fp8"),
             ("maxtext-llama2-70b-h100-256-fp8", "maxtext-llama2-70b-h100-512-fp8"),
             ("maxtext-llama2-70b-h100-256-fp8", "maxtext-llama2-70b-h100-1024-fp8"),
             ("maxtext-llama2-70b-h100-512-fp8", "maxtext-llama2-70b-h100-2048-fp8"),
             ("maxtext-llama2-70b-h100-1024-fp8", "maxtext-llama2-70b-h100-2048-fp8")}


# Models every row's published configuration (9 s): `make bench-published` prints the
# same rankings, and `make test-slow` holds them.
@pytest.mark.slow
def test_configurations_of_one_model_rank_as_measured():
    # torchtitan's Llama 2 13B with and without checkpointing on 64 A100s, MaxText's
    # Llama 2 70B on 64 to 2048 H100s and its Llama 3 70B on 128 to 2048, MaxText's 32B
    # on one and four v5e-256 slices:
    # the model orders them as measured, a tie (a gap within one run's noise) kept a
    # tie, but for the pairs `MISRANKED` names.
    assert {published.run_of(r) for r in RANKED} >= {("llama2-13b", "a100-efa"), ("llama3-70b", "h100"),
                                                       ("llama2-70b", "h100")}
    pairs = published.rankings(RANKED, {r.id: _modeled(r) for r in RANKED})
    assert any(p["tie"] for p in pairs) and not all(p["tie"] for p in pairs)
    assert {(p["first"], p["second"]) for p in pairs if not p["ok"]} == MISRANKED


def test_rankings_compare_throughput_across_batch_sizes():
    # Llama 2 70B ran at 1 sequence a GPU (355 tokens/s, selective op checkpointing) and
    # at 2 (353): per token, a tie.
    one, two = (next(r for r in ROWS if r.id == i) for i in ("torchtitan-llama2-70b-a100-64-b1-op",
                                                              "torchtitan-llama2-70b-a100-64"))
    fake = {r.id: {"published_step_s": published.published_step(r), "published": {"step_s": published.published_step(r)}}
            for r in (one, two)}
    (pair,) = published.rankings([one, two], fake)
    assert pair["tie"] and abs(pair["measured"]) < published.NOISE and pair["ok"]



def test_the_runs_table_prints_each_rows_step_gap_in_seconds_and_whole_ids(capsys):
    # The benchmark's table: the measured step less the modeled one, in seconds (what
    # shows a cost the model lacks as the same seconds on rows of different steps), and
    # every run id whole, the longest among them, beside a row that is not expressible.
    longest = max(EXPRESSIBLE, key=lambda r: len(r.id))
    other = next(r for r in ROWS if not r.expressible and r.split == longest.split)
    step = published.published_step(longest)
    modeled = {"mfu": 0.5, "step_s": step - 0.42, "peak_gib": 40.0, "fits": True}
    published.print_rows([longest, other], {longest.id: {"published": modeled, "published_mfu": 0.48,
                                                         "published_step_s": step, "error": 0.5 / 0.48 - 1}})
    out = capsys.readouterr().out
    assert "+0.42 s" in out and longest.id in out and other.id in out and "…" not in out

#: Published configurations the model finds too big for the chips they ran on, each
#: with why. Every run updates its state in place (`published.DONATED_ARGS`): judged with
#: a second copy of the state, MaxText's 32B on 64 v5p chips was 101 GiB, 95.0 now, under
#: the 95.74 GiB XLA:TPU lets a v5p program use (`TPU_USABLE_GIB`; 97.3 GiB with XLA:CPU's
#: fusion of the float32 copies its norms and loss reduce, `priority_fusion`).
#: NeMo's Llama 3.1 8B with data and context parallelism (8 and 128 H100s) were 98 and
#: 84 GiB with float32 parameters whole and not donated; as Megatron runs them
#: (`master_weights`: bfloat16 weights, the float32 master copy and adam moments sharded
#: by the distributed optimizer, the state donated) they modeled 52 and 42 GiB when they
#: joined, and 67 and 57 today (the recipe's columns, 8 to 128 GPUs: 67, 61, 59, 57, 57).
#: Llama 3 405B (interleaved 1F1B, 2 chunks a stage) keeps 47 chunks' residuals in
#: flight on its first stage, 23.5 microbatches' of its stage's layers, as Megatron's
#: interleaved schedule does: the model puts its peak at 227 GiB (303 GiB as the
#: circular schedule in GPipe's order, all 32 microbatches in flight; 295 GiB then
#: before the constants' refits; 992 GiB
#: without sequence parallelism; 331 GiB before its stage kept its weights gathered
#: across the tick loops and its gradients accumulated unscattered, and before the tick
#: loops' own buffers were modeled: the loops keep the residuals XLA would otherwise
#: re-derive, among them the float32 RMSNorm values the example's layers save). NeMo's
#: Llama 3.1 70B on 64 H100s fits since its row runs the recipe's interleaved 1F1B (5
#: virtual stages: 23 chunks' residuals in flight, 4.6 microbatches' of the stage, as
#: Megatron's first stage keeps): 59.3 GiB; as 1F1B of one chunk a stage it kept 2S-1 = 7
#: microbatches' and modeled 76.3 GiB (202 GiB while XLA:CPU copied the 1F1B ring every
#: tick, 376 GiB without sequence parallelism, 125 GiB before its row said its norms and
#: SwiGLU are fused kernels, `fused_kernels`, which keep their inputs where JAX's
#: derivatives keep the float32 norms and the gate's activation).
#: MaxText's Llama 3 70B runs (the recipe's save_qkv_proj, `Remat('qkv')`) fit since
#: their rows say MaxText's train step sums the log-probabilities against one-hot
#: targets (`loss = "one_hot"`): 65.4 GiB on 128 GPUs, 62.3 on 256 (70.8 and 64.7 with
#: their state held twice), under the 72 GiB the model allows an H100 (0.9 of 80). With
#: the gathered form's backward scattering into zeros the size of the float32 logits
#: (7.8 GiB a device) they were 78.6 and 72.2.
NO_FIT: set[str] = {"llama3-405b-h100-8192"}


# (The unrolled rows, torchtitan's every-second-layer checkpointing, 4 s each to model:
# in the slow run; their check row's band runs by default.)
@pytest.mark.parametrize("row", [_row_param(r, pytest.mark.slow) if r.remat == "full/2" else _row_param(r)
                                 for r in EXPRESSIBLE])
def test_a_published_configuration_fits_the_chip_it_ran_on(row):
    out = _modeled(row)
    assert out["published"]["fits"] == (row.id not in NO_FIT), (row.id, out["published"]["peak_gib"])


def test_a_pipeline_the_project_does_not_run_is_refused_naming_the_row(tmp_path):
    with pytest.raises(ValueError, match=r"nemo-llama31-70b-h100-64.*pipeline schedule 'interleaved-1f1b' not in "
                                         r"\('gpipe', '1f1b'\)"):
        _load_edited(tmp_path, 'schedule = "1f1b"', 'schedule = "interleaved-1f1b"')


def test_a_row_whose_gradient_accumulation_does_not_divide_its_batch_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"nemo-llama31-8b-h100-8-cp2.*grad_accum must be a whole number >= 1 "
                                         r"dividing global_batch, got 48"):
        _load_edited(tmp_path, "grad_accum = 32", "grad_accum = 48")


def test_gradient_accumulation_reduces_and_updates_once_a_step():
    # NeMo's Llama 3.1 8B on 8 H100s runs 32 micro-batches a step: the modeled step pays
    # the forward and backward 32 times and the gradient reduction, the update and
    # ZeRO's all-gather of the parameters once, so it is under 32 train steps of one
    # micro-batch (each paying them all).
    row = next(r for r in ROWS if r.id == "nemo-llama31-8b-h100-8-cp2")
    out = _modeled(row)["published"]
    assert row.grad_accum == 32
    assert out["step_s"] < row.grad_accum * out["micro_step_s"]


def test_the_search_chooses_its_plan_by_the_accumulated_step():
    # NeMo's Llama 3.1 8B on 128 H100s runs 32 micro-batches a step: the search weighs
    # its plans by the step of 32 (the benchmark's, `search.accumulated_step`), not of one
    # micro-batch, which overweights the once-a-step gradient reduction 32 times (with
    # the ring latencies of before, it chose Megatron over the context axis, 1.09x the
    # published configuration's step after accumulation); and its plan is no slower than
    # the published configuration.
    row = next(r for r in ROWS if r.id == "nemo-llama31-8b-h100-128-cp2")
    auto = search.AutomaticPartition(budget_s=600, max_episodes=published.EPISODES, device=row.device,
                                     best_effort=True, grad_accum=row.grad_accum)
    found = tactics.apply_schedule(published.program(row, scan=True), partir.MeshSpec(row.mesh_axes), [auto])
    two = published.replayed(found.partitioning, published.program(row, scan=True, micro_batches=2))
    searched = published.summary(found.partitioning, row, row.device, two)
    assert found.context.search[0].step_time == pytest.approx(searched["step_s"], rel=1e-6)
    assert searched["fits"] and searched["step_s"] <= _modeled(row)["published"]["step_s"]


#: Expressible rows whose searched plan is slower than the published configuration, or
#: does not fit, and why: none. NeMo's Llama 3.1 70B on 256 H100s (TP4 PP4 CP2 DP8) was
#: 1.008x while its published configuration did not fit the model (113.5 GiB, its norms
#: and SwiGLU kept as JAX differentiates them): the plans that fit recomputed them. As
#: the fused kernels its run has (`fused_kernels`) it fits (66.2 GiB), and the search
#: returns 1F1B over the two-device axis with the sequence split over the stage axis,
#: 0.97x. MaxText's 32B on 64 v5p chips was 1.12x while its published configuration (FSDP 16 x
#: tensor 4, Remat('dots')) modeled at 101 GiB, over the 88.5 GiB then allowed a v5p:
#: the search kept fewer matmuls. With the state updated in place and the chip's usable
#: memory, that configuration fits, and the search finds FSDP over both axes with
#: Remat('dots'), 0.98x. (NeMo's Llama 3.1 70B on 64 H100s has its own tests below.)
SEARCH_SLOWER: set[str] = set()
#: Rows whose search runs by default (2 s each): a plan keeping the q, k, v projections
#: (`search._refine.refine_remat`), one keeping all matmuls but the MLP's first, and one
#: whose published configuration fits its chip by 0.7 GiB.
_SEARCHED_BY_DEFAULT = ("maxtext-llama3-70b-h100-128", "maxtext-llama2-70b-h100-64", "maxtext-32b-v5p-64")
_SEARCHED = [r for r in ROWS if r.expressible and r.id != "nemo-llama31-70b-h100-64"]  # (its own test, below)


@pytest.mark.parametrize("row", [_row_param(r) if r.id in _SEARCHED_BY_DEFAULT else _row_param(r, pytest.mark.slow)
                                 for r in _SEARCHED])
def test_the_searched_plan_fits_and_is_no_slower_than_the_published_configuration(row):
    out = _modeled(row, row.episodes)
    beats = out["searched"]["fits"] and out["searched_over_published"] <= 1 + 1e-9
    assert beats == (row.id not in SEARCH_SLOWER), (row.id, out["plan"], out["searched_over_published"])


@pytest.mark.slow
def test_the_nemo_70b_search_pipelines_the_whole_batch_and_beats_its_published_configuration():
    # NeMo's Llama 3.1 70B runs 64 micro-batches a step as its pipeline's microbatches.
    # The search of one micro-batch accumulated 64 times finds nothing fast that fits
    # (3.14x: FSDP's gathers every micro-batch, or ZeRO-1 with a 33 GiB accumulator, 90
    # GiB); the search of the whole batch's step, offering pipelines of 32, 64 and 128
    # microbatches and ZeRO-1, returns a pipelined plan that fits at 0.98x: interleaved
    # 1F1B over two stages of two chunks, 64 microbatches (bubble 1/129 where the
    # published four stages of five chunks have 3/323), tensor and sequence parallel over
    # model, the sequence over the other four-device axis, ZeRO-1 (64.3 GiB; 1F1B of one
    # chunk over two stages, 0.96x of the published layout run as 1F1B of one chunk, before
    # interleaved 1F1B ran; 0.97x with Remat('dots_with_context') before its row's norms
    # and SwiGLU were fused kernels). It was 1.12x (the whole batch's step under FSDP and full Remat) while every
    # composition with both context and sequence parallelism was a dead end
    # (`search._seeds.ORDER`) and 4000 episodes in primary-first order reached no fitting
    # pipelined plan. By role assignment (`search._seeds.skeletons`) they score a variant
    # of each of the 491 assignments that use all four axes and of 477 of the 703 others.
    row = next(r for r in ROWS if r.id == "nemo-llama31-70b-h100-64")
    out = _modeled(row, row.episodes)
    assert out["searched"]["fits"] and out["searched_over_published"] <= 1.0, (out["plan"], out["searched"])
    assert out["searched_form"] == "pipelined", out["plan"]


def test_nemo_70bs_virtual_stages_make_its_published_layout_fit_and_run_faster():
    # NeMo's Llama 3.1 70B layout (TP4 with SP, CP2, DP2, ZeRO-1, 4 stages of 64
    # microbatches) with the recipe's 5 virtual stages a device (interleaved 1F1B) keeps
    # 23 chunks' residuals in flight on its first stage, 4.6 microbatches' of the stage,
    # and fits (59.3 GiB of 72); 1F1B of one chunk a stage keeps 7 microbatches' and does
    # not (76.3 GiB). The bubble falls from 3/67 to 3/323: 2.2% less a step, though the
    # loop sends five times as many carries and exchanges the chunks at rest.
    row = next(r for r in ROWS if r.id == "nemo-llama31-70b-h100-64")
    assert row.pipeline["repeats"] == 5
    interleaved = _modeled(row)["published"]
    one = published.model_row(dataclasses.replace(row, pipeline={**row.pipeline, "repeats": 1}), episodes=0)
    assert interleaved["fits"] and not one["published"]["fits"]
    assert interleaved["step_s"] < 0.99 * one["published"]["step_s"]


def test_the_ablation_says_which_mechanism_moves_a_row():
    # `published.py --ablate`: torchtitan's Llama 3 70B (FSDP over 64 A100s) runs its
    # attention as the fused kernel, slower without it; it has no tensor parallelism, so
    # XLA:GPU's reassociation of reductions moves nothing.
    from benchmarks.published_ablate import ablate

    row = next(r for r in ROWS if r.id == "torchtitan-llama3-70b-a100-64")
    (errors,) = ablate(published, [row], names=("fused attention", "reassociation")).values()
    assert errors["all"] == pytest.approx(_modeled(row)["error"])
    assert errors["fused attention"] < errors["all"] - 0.1 and errors["reassociation"] == errors["all"]
    with pytest.raises(ValueError, match=r"unknown mechanisms \['GPU fusion'\]; allowed: \['matmul rate'"):
        ablate(published, [row], names=("GPU fusion",))


def _tiny_llama():
    config = llama.LlamaConfig(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, d_ff=512, vocab=512, seq_len=512,
                               batch=8, dtype=jnp.bfloat16, scan_layers=True)
    step, args = llama.make_train_step(config, abstract=True)
    part = partir.Partitioning(partir.lift(step, *args), partir.MeshSpec.of(data=8))
    return tactics.apply_schedule(part.program, part.mesh, [tactics.DataParallel("data")]).partitioning


def test_fused_attention_keeps_no_scores_and_prices_the_kernel():
    part = _tiny_llama()
    h100 = search.get_device("h100")
    unfused = dataclasses.replace(h100, fused_attention=False)
    fused_model, plain_model = search.CostModel(part.copy(), h100), search.CostModel(part.copy(), unfused)
    region = fused_model.materialization.attention
    assert region is not None and region.found and plain_model.materialization.attention is None
    scores = [v for v in range(len(part.program.values)) if region.values[v]]
    # The scores [B, groups, K, S, S] and the row statistics over them, all along S = 512.
    assert scores and all(512 in part.program.values[v].shape for v in scores)
    fused, plain = fused_model.cost(), plain_model.cost()
    assert fused.memory_peak < plain.memory_peak
    # A causal kernel computes about half the score tiles: less time than the XLA form.
    assert fused.compute_time < plain.compute_time


def _norm_casts(prog) -> list[int]:
    """The forward pass's float32 copies of bfloat16 activations (the norms' inputs)."""
    out = []
    for op in prog.ops:
        if op.primitive == "convert_element_type" and not op.link and not prog.backward[op.id]:
            src, res = prog.values[op.operands[0]], prog.values[op.results[0]]
            if src.dtype == jnp.bfloat16 and res.dtype == jnp.float32 and res.shape[-1:] == (256,):
                out.append(op.results[0])
    return out


@pytest.mark.parametrize("device", ["h100", "tpu-v5p"])
def test_gpu_fusion_casts_a_norms_input_in_each_reader(device):
    # XLA:GPU's priority fusion fuses the float32 copy of a norm's bfloat16 input into
    # every reader, the mean of squares among them: it is no buffer, and the scan stacks
    # the bfloat16 layer input for the backward loop instead. XLA:CPU makes a buffer of
    # it (a reduction reads it), and the `cpu` preset keeps that. The TPU presets fuse as
    # the GPU's (MaxText's 32B on 64 v5p fits its chips only so: `NO_FIT`).
    part = _tiny_llama()
    fused = search.get_device(device)
    assert fused.priority_fusion and not search.get_device("cpu").priority_fusion
    gpu = search.CostModel(part.copy(), fused)
    cpu_like = search.CostModel(part.copy(), dataclasses.replace(fused, priority_fusion=False))
    casts = _norm_casts(part.program)
    assert casts and all(gpu.materialization.virtual[v] for v in casts)
    assert not any(cpu_like.materialization.virtual[v] for v in casts)
    assert gpu.materialization.carried and not cpu_like.materialization.carried
    assert gpu.cost().memory_peak < cpu_like.cost().memory_peak


def _loss_peaks(loss: str) -> tuple[float, float, float]:
    """(XLA:CPU's peak, the `cpu` preset's, the `h100` preset's) of a data-parallel
    Llama whose float32 logits are its largest values, on 8 devices."""
    config = llama.LlamaConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab=8192, seq_len=128,
                               batch=16, scan_layers=True, dtype=jnp.bfloat16, loss=loss)
    step, args = llama.make_train_step(config, abstract=True)
    part = tactics.apply_schedule(partir.lift(step, *args), partir.MeshSpec.of(data=8),
                                  [tactics.DataParallel("data")]).partitioning
    m = partir.lower(part, part.mesh.jax_mesh()).lower(*args).compile().memory_analysis()
    xla = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return xla, search.CostModel(part.copy(), "cpu").cost().memory_peak, search.CostModel(part, "h100").cost().memory_peak


@pytest.mark.slow  # 4 s; MaxText's 70B rows fitting their GPUs (by default) rest on it
def test_a_one_hot_loss_keeps_one_logits_buffer_fewer_on_gpu():
    # MaxText's cross-entropy sums the log-probabilities against one-hot targets: a
    # reduction takes them in, and its backward is one fused pass over the saved
    # softmax. The gathered form's backward scatters into zeros the size of the float32
    # logits, a buffer beside that softmax (and the model keeps the log-probabilities
    # the gather reads in the forward pass, one buffer too). The `h100` preset puts the
    # one-hot form's peak one float32 logits buffer lower; XLA:CPU's, which holds
    # float32 copies of the head's matmul operands as well, half of one (bfloat16); the
    # `cpu` preset, within the fidelity band of both, none.
    logits = 16 // 8 * 128 * 8192 * 4  # a device's float32 logits
    xla_g, cpu_g, gpu_g = _loss_peaks("gather")
    xla_o, cpu_o, gpu_o = _loss_peaks("one_hot")
    assert gpu_g - gpu_o == pytest.approx(logits, rel=0.01)
    assert xla_g - xla_o == pytest.approx(logits / 2, rel=0.01)
    assert all(0.8 <= cpu / xla <= 1.2 for cpu, xla in ((cpu_g, xla_g), (cpu_o, xla_o)))


def test_gpu_reduces_a_sum_of_tensor_parallel_gradients_once():
    # A Megatron layer's backward sums the partial gradients of its input from the
    # query, key and value projections, and from the MLP's gate and up: XLA:GPU's
    # AllReduceReassociate all-reduces each sum once (two a layer, as Megatron's fused
    # projections do), where XLA:CPU reduces all five (one tuple all-reduce of three,
    # one of two). Only the time follows: the memory stays.
    config = llama.LlamaConfig(n_layers=2, d_model=256, n_heads=4, n_kv_heads=4, d_ff=512, vocab=512, seq_len=512,
                               batch=8, dtype=jnp.bfloat16, scan_layers=True)
    step, args = llama.make_train_step(config, abstract=True)
    part = tactics.apply_schedule(partir.lift(step, *args), partir.MeshSpec.of(data=2, model=4),
                                  [tactics.DataParallel("data"), tactics.Megatron("model")]).partitioning
    h100 = search.get_device("h100")
    assert h100.reassociate and not any(search.get_device(d).reassociate for d in ("cpu", "tpu-v5p"))
    activation = 4 * 512 * 256 * 2  # a [batch, seq, d_model] block of bfloat16 on one device

    def reduced(device):
        cost = search.CostModel(part.copy(), device).cost()
        return sum(c.count for c in cost.collectives
                   if c.axes == ("model",) and c.kind == "all-reduce" and c.bytes == activation), cost

    merged, gpu = reduced(h100)
    each, apart = reduced(dataclasses.replace(h100, reassociate=False))
    # Per layer 2 forward and 2 backward, against 2 and 5; and the head's input gradient.
    assert (merged, each) == (2 * 4 + 1, 2 * 7 + 1)
    assert gpu.comm_time < apart.comm_time and gpu.memory_peak == apart.memory_peak


def test_cpu_preset_keeps_the_roofline_of_xla_cpu():
    cpu = search.get_device("cpu")
    assert not (cpu.fused_attention or cpu.overlap or cpu.overlap_activations or cpu.priority_fusion
                or cpu.reassociate)
    assert cpu.matmul_efficiency == cpu.attention_efficiency == cpu.collective_efficiency == 1.0
    assert cpu.matmul_knee == cpu.op_overhead == cpu.overlap_slowdown == 0.0
    cost = search.CostModel(_tiny_llama(), "cpu").cost()
    assert cost.step_time == pytest.approx(cost.compute_time + cost.comm_time)


@pytest.mark.slow  # spawns two workers, each importing JAX (10 s)
def test_rows_modeled_in_worker_processes_give_one_process_figures():
    # `make bench-published` models rows side by side (`--jobs`): each row's figures,
    # its searched plan included, are what one process modeling them all gives.
    rows = [r for r in ROWS if r.id in ("maxtext-llama2-70b-h100-64", "torchtitan-llama3-8b-a100-64")]
    assert published.model_rows(rows, 20, jobs=2) == published.model_rows(rows, 20, jobs=1)
