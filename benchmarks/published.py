"""Published training runs as ground truth for the cost model's time.

For each run of `benchmarks/published/runs.toml` (transformer LMs of 8B-405B parameters
on H100, A100 and TPU v5e/v5p, each cited by document and table): the published figure;
where today's tactics express the run, the modeled figure of the published
configuration (its schedule of tactics on `examples/llama.py` set to the run's shape,
on the run's device preset, from abstract shapes; unrolled where only some layers are
checkpointed), its relative error and its peak memory; and the plan
`AutomaticPartition` finds for the same model, devices and global batch, with its
modeled step divided by the published configuration's. A row with a `pipeline` runs
it over its mesh's `stage` axis (`schedule`), the pipeline's microbatches being the
run's gradient accumulation (`pipelined`); a row of `dtype` float8 runs its layers'
projections in FP8 (`examples/_fp8.py`). Rows needing a pipeline schedule tactics
cannot express, a MoE Llama or a remat policy no tactic has say so. Then the
configurations of one model, ranked by time per token per device as measured and as
modeled (`rankings`: a measured gap under `NOISE` is a tie, kept under `TIE`).

A row with `master_weights` (Megatron's mixed precision: bfloat16 weights, a float32
master copy and the adam moments in the optimizer state) is modeled on
`examples/llama.py`'s `master_weights` train step. Every row's parameters and optimizer
state are donated (`DONATED_ARGS`), as every run's framework updates them in place. A row with
`tp_comm_overlap` (its run overlaps the tensor-parallel collectives with the matmuls,
Transformer Engine's userbuffers) is modeled on its device with activation collectives
run behind independent compute (`row_device`), its searched plan too.

Figures are compared like with like: each source's model-flops formula (`FORMULAS`)
turns its published figure into a step time and the modeled step into the same MFU.
Gradient accumulation: a run of GA 1 (`grad_accum`) is modeled as the train step of
the global batch with one optimizer update. A run of GA micro-batches a step runs the
forward and backward GA times and reduces the gradients and updates once: every term of
its modeled step is affine in the micro-batches, parts(1) + (GA - 1) (parts(2) -
parts(1) + again(1)), where parts(k) are the compute and communication terms of the
modeled train step of k micro-batches' sequences and again(1) the collectives of one
that every micro-batch runs again (FSDP's parameter gathers and gradient
reduce-scatters), with overlap applied to the result
(`search.accumulated_step`, `summary`; on the step times themselves it would count a
collective hidden on two micro-batches but not on one as hidden GA - 1 times). The search is given the
train step of one micro-batch and the row's GA (`AutomaticPartition(grad_accum=...)`):
it chooses its plan by the same accumulated step, from the step on one and on two
micro-batches (`search._accum`); that plan, taken again on two (`replayed`), is
accumulated the same way for the table. With GA above 1 the search offers ZeRO-1
(Megatron's distributed optimizer: parameters whole, gathered once a step) beside FSDP
(gathered every micro-batch), and chooses between them by that step. A row of GA > 1 is
also searched on the train step of its whole batch, offering pipelines of GA/2, GA and
2 GA microbatches (`pipeline_counts`: the pipeline's microbatches are then the
accumulation, as in the published pipelined runs) and ZeRO-1; the row keeps the faster
plan that fits (`_search`), and says which form it is (`Searched.form`).

Run: `make bench-published` or `python benchmarks/published.py [--rows ID ...]
[--episodes N] [--json out.json] [--jobs N] [--fit] [--ablate]`. `--jobs` models rows
in that many worker processes (`model_rows`; default one a CPU), the figures the same.
`--fit` re-derives the time model's fitted constants (`search.cost._device`) on the
`fit` rows only, by least squares on log step time; `--ablate` prints each row's
modeled error with each mechanism of the time model switched off in turn
(`published_ablate`), what moved which row.
"""

from __future__ import annotations

import os
import sys

sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
# The examples are not installed: import them from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.published_rows import (  # noqa: E402  (the rows and the sources' formulas)
    RUNS, EPISODES, BAND, NOISE, TIE, Row, STAGE_AXIS, load, FORMULAS, published_step)
from benchmarks.published_tables import print_rankings, print_rows  # noqa: E402


# -- modeling -----------------------------------------------------------------------------

#: torchtitan's selective layer checkpointing with option 2 wraps layers 2, 4, 6, ...
#: (counting from 1): the odd indices of the unrolled program's layers.
ODD_LAYERS = r"re:^params\['layers'\]\[\d*[13579]\]"


def llama_config(r: Row, *, scan: bool | None = None, micro_batches: int = 1):
    """`examples/llama.py`'s config of the row's train step: its shape, loss, state,
    kernels and matmul precision, on the sequences of `micro_batches` of the row's
    `grad_accum` micro-batches (all of the global batch for a run of GA 1); its layers
    under `scan`, unrolled where the row checkpoints some layers only (`scan` overrides)."""
    import jax.numpy as jnp

    from examples import llama

    scan = r.remat != "full/2" if scan is None else scan
    return llama.LlamaConfig(n_layers=r.layers, d_model=r.d_model, n_heads=r.heads, n_kv_heads=r.kv_heads,
                             d_ff=r.d_ff, vocab=r.vocab, seq_len=r.seq,
                             batch=r.global_batch // r.grad_accum * micro_batches,
                             dtype=jnp.bfloat16, scan_layers=scan, remat=False, master_weights=r.master_weights,
                             loss=r.loss, fused_kernels=r.fused_kernels, fp8=r.dtype == "float8",
                             fp8_scaling=r.fp8_scaling)


def program(r: Row, *, scan: bool | None = None, micro_batches: int = 1):
    """The lifted train step (abstract) of the row's `llama_config`."""
    import partir
    from examples import llama

    step, args = llama.make_train_step(llama_config(r, scan=scan, micro_batches=micro_batches), abstract=True)
    return partir.lift(step, *args)


def schedule(r: Row) -> list:
    """The published configuration as the project's tactics: context parallelism first
    (it holds its axis on the attention's path), in Megatron-LM's token order for a
    causal sequence ('zigzag': each device two chunks from opposite ends); the batch
    over `data`; Megatron over `model`, with Megatron's sequence parallelism where the
    row's run has it (`Row.sequence_parallel`); FSDP over `fsdp`, or where the mesh has
    none, the optimizer state sharded over the data-parallel and context ranks
    (Megatron's distributed optimizer, ZeRO-1); then the row's `pipeline` over
    `STAGE_AXIS` (its microbatches are the run's gradient accumulation: `pipelined`)."""
    import tactics

    axes = dict(r.mesh_axes)
    out = [tactics.ContextParallel("context", balance="zigzag")] if "context" in axes else []
    out += [tactics.DataParallel("data")] if "data" in axes else []
    zero1 = [tactics.ZeRO(a, stage=1) for a in ("data", "context") if a in axes]
    if "model" in axes:
        out += [tactics.Megatron("model")] + ([tactics.SequenceParallel("model")] if r.sequence_parallel else [])
        out += [tactics.FSDP("fsdp")] if "fsdp" in axes else zero1
    elif "fsdp" in axes:
        out += [tactics.FSDP("fsdp", leave_room=False)]
    else:
        out += zero1
    out += [tactics.Pipeline(STAGE_AXIS, **r.pipeline)] if r.pipeline else []
    if r.remat == "full/2":
        return out + [tactics.Remat("full", pattern=ODD_LAYERS)]
    return out + ([tactics.Remat(r.remat)] if r.remat != "none" else [])


def pipelined(r: Row) -> bool:
    """Whether the row's published configuration runs a pipeline: its program is then
    the train step of the whole global batch, the pipeline's microbatches doing the
    run's gradient accumulation (Megatron's GA is its pipeline's microbatches), not the
    step of one micro-batch accumulated (`summary`)."""
    return bool(r.pipeline)


#: The train step's arguments every run updates in place, its parameters and optimizer
#: state: no run holds a second copy of its state through a step. MaxText jits its train
#: step with the state donated (`maxtext_utils.get_functional_train_with_signature`:
#: `donate_argnums = 0`, "we allow the compiler to make use of this memory"); torchtitan's
#: and Megatron's optimizers write into the parameters and their state (PyTorch's
#: `optimizer.step()`). Judged without it, a configuration carries its state twice at
#: its peak (MaxText's 32B on 64 v5p: 5.5 GiB, the margin between fitting and not).
DONATED_ARGS = (0, 1)


def row_device(r: Row, device=None):
    """The device the row is modeled on (`device`, else the row's), as its software runs
    it: with the tensor-parallel collectives overlapped where the row says its run did
    (`Row.tp_comm_overlap`: the data file's header)."""
    import search

    spec = search.get_device(device or r.device)
    return dataclasses.replace(spec, overlap_activations=True) if r.tp_comm_overlap else spec


def summary(part, r: Row, device, two=None, *, whole: bool = False) -> dict:
    """Modeled step, peak, fit and MFU (the source's formula) of a partitioning of
    `program(r)`, the train step of one micro-batch (`micro_step_s`). The step: for
    GA 1, that train step; for GA > 1, `two` being the same plan on two micro-batches,
    the accumulated step, the search's (`search.accumulated_step`: the module docstring).
    With `whole`, `part` is the train step of the whole global batch (a pipelined
    configuration, `pipelined`), which is the step."""
    import search

    accumulated = r.grad_accum > 1 and not whole
    if (two is not None) != accumulated:
        raise ValueError(f"{r.id}: the step of {r.grad_accum} micro-batches needs the plan on two (`two`) "
                         "exactly when there is more than one, and a pipelined step (`whole`) none")
    donated = DONATED_ARGS
    model = search.CostModel(part.copy(), device, donate_argnums=donated, grad_accum=r.grad_accum if accumulated else 1)
    cost = model.cost()
    one = step = cost.step_time
    if two is not None:
        other = search.CostModel(two.copy(), device, donate_argnums=donated)
        parts, again, _ = model.accumulation_parts()
        step = search.accumulated_step(parts, other.evaluate_parts()[0], r.grad_accum, model.device, again)
    peak = search.get_device(device).flops_for("bfloat16")
    return {"step_s": step, "micro_step_s": one, "peak_gib": cost.memory_peak / 2**30, "fits": bool(cost.fits),
            "mfu": FORMULAS[r.flops](r) / (peak * step)}


def model_row(r: Row, episodes: int, device=None, searches: dict | None = None) -> dict:
    """The row's published and modeled figures and the searched plan's. `searches`
    caches the search by what it sees (shape, devices, global batch, device): the
    configurations of one run share it."""
    import partir
    import search

    device = row_device(r, device)
    mesh = partir.MeshSpec(r.mesh_axes)
    part, two, whole = published_plan(r)
    out = {"id": r.id, "split": r.split, "published_step_s": published_step(r),
           "published": summary(part, r, device, two, whole=whole)}
    peak = search.get_device(device).flops_for("bfloat16")
    out["published_mfu"] = FORMULAS[r.flops](r) / (peak * out["published_step_s"])
    out["error"] = out["published"]["mfu"] / out["published_mfu"] - 1
    if episodes > 0:
        searches = {} if searches is None else searches
        key = search_key(r, episodes, device)
        if key not in searches:
            searches[key] = _search(r, mesh, device, episodes)
        found = searches[key]
        out["plan"], out["searched_form"], out["searched"] = found.plan, found.form, found.summary(r, device)
        out["searched_over_published"] = out["searched"]["step_s"] / out["published"]["step_s"]
    return out


def search_key(r: Row, episodes: int, device) -> tuple:
    """What the row's search sees (the program of one micro-batch, `llama_config`; the
    accumulation, mesh, `device` as `row_device` gives it, episodes): rows with one key
    share one search (`model_row`'s `searches`)."""
    return llama_config(r, scan=True), r.grad_accum, r.mesh_axes, device, episodes


def _model_group(group: list[tuple[Row, int]]) -> list[dict]:
    """`model_row` of each (row, episodes) of `group`, sharing their searches."""
    searches: dict = {}
    return [model_row(r, episodes, searches=searches) for r, episodes in group]


def model_rows(rows: list[Row], episodes: int | None, jobs: int) -> dict[str, dict]:
    """`model_row` of every expressible row (each with its own episodes unless
    `episodes` is given), by id in row order, in `jobs` worker processes: rows that share
    a search (`search_key`) go to one worker, so each search runs once, and every row's
    figures are what one process computing them all gives (the workers are spawned, no
    state carried over)."""
    groups: dict = {}
    for r in rows:
        if r.expressible:
            n = r.episodes if episodes is None else episodes
            groups.setdefault(search_key(r, n, row_device(r)) if n > 0 else r.id, []).append((r, n))
    if jobs <= 1:
        done = [_model_group(g) for g in groups.values()]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # By its importable name: this file also runs as a script and loads under others.
        from benchmarks.published import _model_group as work

        # Largest searches first, so that one does not start last and run alone.
        order = sorted(groups.values(), key=lambda g: -max(n for _, n in g))
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = list(pool.map(work, order))
    results = {out["id"]: out for outs in done for out in outs}
    return {r.id: results[r.id] for r in rows if r.id in results}


def published_plan(r: Row) -> tuple:
    """(the published configuration's partitioning, the same on two micro-batches or
    None, whether it is the whole batch's pipelined step): what `summary` takes."""
    import partir

    mesh, whole = partir.MeshSpec(r.mesh_axes), pipelined(r)
    part = _apply(program(r, micro_batches=r.grad_accum if whole else 1), mesh, schedule(r))
    two = _apply(program(r, micro_batches=2), mesh, schedule(r)) if r.grad_accum > 1 and not whole else None
    return part, two, whole


def replayed(part, prog):
    """`part`'s decisions taken again on `prog`, a program of the same structure (its
    train step on another batch); a `ValueError` when an input comes out otherwise."""
    import partir

    other = partir.Partitioning(prog, part.mesh, detached=part.detached)
    for d in part.decisions:
        other.redo(d)
    moved = [prog.name(v) for v, u in zip(prog.inputs, part.program.inputs) if other.tiling(v) != part.tiling(u)]
    if moved:
        raise ValueError(f"the plan's decisions lay out {', '.join(moved[:3])} otherwise on the other program: "
                         "it is not of the structure the plan was made for")
    return other


def _apply(prog, mesh, tactic_list):
    import tactics

    return tactics.apply_schedule(prog, mesh, tactic_list).partitioning


#: The microbatch counts a pipelined search offers, as multiples of the row's GA: the
#: run's own count (its accumulation as the pipeline's microbatches, as Megatron runs it)
#: and its neighbours by a factor of two, as a practitioner tunes M around it.
PIPELINE_FACTORS = (0.5, 1, 2)


#: The pipelined search's episodes, as a multiple of the row's: its pipelines add up to
#: three schedules of each microbatch count on each axis to the macros (36 on NeMo's
#: Llama 3.1 70B's four axes, 66 macros in all with ZeRO-1: 1194 assignments of roles to
#: axes, `search._seeds.skeletons`). At the row's 1000 episodes that search returns FSDP
#: over three axes with ZeRO-1 and full Remat (16.16 s a step, 1.12x the published
#: configuration's); at 2000 a 1F1B pipeline over two stages with CP, Megatron and SP,
#: ZeRO-1 and Remat('dots_with_context') (14.13 s, 0.98x); at 4000 the same over other
#: axes (14.04 s, 0.97x, 63 GiB).
PIPELINED_EPISODES = 4


def pipeline_counts(r: Row) -> tuple[int, ...]:
    """The microbatch counts the row's pipelined search offers (`PIPELINE_FACTORS` of its
    GA), those of at least 2 that divide its global batch."""
    counts = (int(r.grad_accum * f) for f in PIPELINE_FACTORS)
    return tuple(m for m in counts if m >= 2 and r.global_batch % m == 0)


@dataclasses.dataclass(frozen=True)
class Searched:
    """A plan a row's search found: its partitioning (of the scanned train step of one
    micro-batch, or with `whole` of the step's whole global batch), the plan's actions
    as the search describes them, and its `form`."""

    part: Any
    plan: list
    whole: bool

    @property
    def form(self) -> str:
        """What the plan runs a step as, said in the JSON (`searched_form`) and, where not
        'micro-batches', in the table:
        'micro-batches' (the train step of one micro-batch GA times, one update; for GA 1
        the step itself), 'pipelined' (the whole batch's step over pipeline stages, its
        microbatches the accumulation) or 'whole batch' (the whole batch's step in one
        pass: the pipelined search's plan without a pipeline)."""
        if not self.whole:
            return "micro-batches"
        return "pipelined" if self.part.pipelines else "whole batch"

    def summary(self, r: Row, device) -> dict:
        """The plan's `summary` (the step of the row's global batch, its peak and fit)."""
        if self.whole or r.grad_accum == 1:
            return summary(self.part, r, device, whole=self.whole)
        return summary(self.part, r, device, replayed(self.part, program(r, scan=True, micro_batches=2)))


def _search(r: Row, mesh, device, episodes: int) -> Searched:
    """The plan the search finds for the row's model on its devices, on the scanned
    program, whose plans are the unrolled one's (layer by layer alike), its memory with
    the arguments the run donates (`DONATED_ARGS`) donated, as its published
    configuration's is judged. For GA 1, the search of the train step. For GA > 1 two
    searches: of the step of one micro-batch by the accumulated step of GA, and of the
    step of the whole batch offering pipelines of `pipeline_counts` microbatches (the
    pipeline's microbatches then run the accumulation, as the published pipelined
    runs'); of their plans the faster that fits (else the faster), both being the step
    of the same global batch with one optimizer update."""
    found = [_searched(r, mesh, device, episodes, program(r, scan=True), grad_accum=r.grad_accum)]
    if r.grad_accum > 1:
        found.append(_searched(r, mesh, device, PIPELINED_EPISODES * episodes,
                               program(r, scan=True, micro_batches=r.grad_accum), whole=True))
    steps = [f.summary(r, device) for f in found]
    return min(zip(found, steps), key=lambda fs: (not fs[1]["fits"], fs[1]["step_s"]))[0]


def _searched(r: Row, mesh, device, episodes: int, prog, *, grad_accum: int = 1, whole: bool = False) -> Searched:
    """The search of `prog` (`whole`: the whole batch's step, offering `pipeline_counts`
    and, from a partitioning detached for it as `search._zero_root` detaches one for
    `grad_accum`, ZeRO-1: the pipeline's microbatches accumulate the gradients)."""
    import partir
    import search
    import tactics

    auto = search.AutomaticPartition(budget_s=600, max_episodes=episodes, device=device, best_effort=True,
                                     grad_accum=grad_accum, pipelines=pipeline_counts(r) if whole else (),
                                     donate_argnums=DONATED_ARGS)
    start = partir.Partitioning(prog, mesh)
    found = tactics.apply_schedule(prog, mesh, [auto], start=start.detach(tactics.zero_whole(prog, 1)) if whole
                                   else start)
    plan = [a.describe(res.groups) for res in found.context.search for a in res.actions]
    return Searched(found.partitioning, plan, whole=whole)


def run_of(r: Row) -> tuple:
    """What makes rows configurations of one model to rank: the model and the device
    type (the number of devices and the mesh are part of a configuration)."""
    return (r.model, r.device)


def rankings(rows: list[Row], results: dict) -> list[dict]:
    """Every pair of modeled configurations of one model (`run_of`): the measured and
    modeled gaps in time per token per device (configurations differ in batch and
    devices; second over first, minus 1), and whether the model ranks them as measured
    (a tie: a modeled gap under `TIE`)."""
    groups: dict = {}
    for r in rows:
        if r.id in results:
            groups.setdefault(run_of(r), []).append(r)
    out = []
    for group in groups.values():
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                ra, rb = results[a.id], results[b.id]
                scale = (a.global_batch / a.devices) / (b.global_batch / b.devices)  # tokens a device, a over b
                measured = rb["published_step_s"] / ra["published_step_s"] * scale - 1
                modeled = rb["published"]["step_s"] / ra["published"]["step_s"] * scale - 1
                tie = abs(measured) < NOISE
                ok = abs(modeled) < TIE if tie else (measured > 0) == (modeled > 0)
                out.append({"first": a.id, "second": b.id, "measured": measured, "modeled": modeled, "tie": tie,
                            "ok": ok})
    return out


def fit(rows: list[Row]) -> dict:
    """The time model's fitted constants (`search.cost._device`: GPU and TPU matmul
    efficiency, fused attention efficiency), by least squares on the log of modeled over
    published step time over `rows` (the fit rows: check rows choose nothing)."""
    import numpy as np
    from scipy.optimize import minimize

    import partir
    import search

    models = []
    for r in rows:
        if r.grad_accum > 1:
            raise ValueError(f"{r.id}: a fit row takes one micro-batch a step (grad_accum 1, got {r.grad_accum}): "
                             "the fit prices the train step alone; make the row a check row")
        part = _apply(program(r), partir.MeshSpec(r.mesh_axes), schedule(r))
        models.append((r, search.CostModel(part, row_device(r)), published_step(r)))

    def loss(x):
        gpu, tpu, attention = x
        total = 0.0
        for r, model, step in models:
            base = row_device(r)
            # A TPU preset is the one with an ICI torus; the others are priced by the GPU constant.
            model.device = dataclasses.replace(base, matmul_efficiency=tpu if base.torus_dims else gpu,
                                               attention_efficiency=attention)
            total += float(np.log(model.evaluate()[0] / step)) ** 2
        return total

    dev = search.get_device("h100"), search.get_device("tpu-v5e")
    x0 = [dev[0].matmul_efficiency, dev[1].matmul_efficiency, dev[0].attention_efficiency]
    best = minimize(loss, x0, method="Powell", bounds=[(0.3, 1.0), (0.3, 1.0), (0.2, 1.0)])
    names = ("GPU_MATMUL_EFFICIENCY", "TPU_MATMUL_EFFICIENCY", "ATTENTION_EFFICIENCY")
    return dict(zip(names, best.x.tolist())) | {"rms_log_error": float(np.sqrt(best.fun / len(models)))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=None, help="run ids (default: all)")
    parser.add_argument("--episodes", type=int, default=None,
                        help=f"search episodes per row (0: no search; default: the row's, {EPISODES} unless it says)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--fit", action="store_true", help="re-derive the fitted constants on the fit rows")
    parser.add_argument("--ablate", action="store_true",
                        help="each row's modeled error with each mechanism of the time model off (no search)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="worker processes modeling rows side by side (default: one a CPU; the figures do not "
                             "depend on it)")
    args = parser.parse_args(argv)
    rows = load()
    if args.fit:
        for name, value in fit([r for r in rows if r.split == "fit" and r.expressible]).items():
            print(f"{name} = {value:.3f}")
        return
    chosen = [r for r in rows if args.rows is None or r.id in args.rows]
    if args.ablate:
        from benchmarks.published_ablate import ablate, print_table

        print_table(ablate(sys.modules[__name__], chosen))
        return
    results = model_rows(chosen, args.episodes, args.jobs)
    print_rows(chosen, results)
    pairs = rankings(chosen, results)
    print_rankings(pairs)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": results, "rankings": pairs}, fh, indent=1)


if __name__ == "__main__":
    main()
