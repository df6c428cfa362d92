"""The cost model beside XLA, on hand-written plans and on the plans the search returns.

For each example, mesh and plan (the hand-written strategies of `examples.plans`, the
plan the automatic search returns, and a few random valid plans), the collectives the
model predicts and those in the compiled HLO (count and bytes per device, per kind),
per-device flops, and the peak memory beside XLA's (`memory_analysis()`: temp +
arguments + outputs - aliased).

Counts differ where XLA combines gradient all-reduces into one tuple all-reduce; bytes
are what must agree (within 10%), and memory within 20% (`tests/test_cost.py` asserts
both). On XLA:CPU a reduce-scatter is an all-reduce and a slice, which the `cpu` device
costs as such.

Footnotes, where XLA:CPU does what GPU XLA would not:
  [1] XLA:CPU has no native select-and-scatter: it expands a max pool's gradient into
      index iotas, a variadic reduce-window and a scatter. The fidelity convnet pools by
      averaging in its second pool; `--max-pool` adds max-pool rows, marked [1], which the
      bands do not cover.
  [2] XLA:CPU ignores `jax.checkpoint` in unrolled code (it merges the recomputation
      back); `--remat` adds rows of the GPT with remat per layer (JAX's default policy and
      `dots`), marked [2], compared with the same model under `scan` (which XLA:CPU
      honours), as GPU XLA would run both.
  [3] `--llama` adds the Llama (`LLAMA`: float32, scanned and unrolled) under tactics'
      plans, the searched plan and random ones. XLA keeps more of it than the model
      says, not all of it XLA:CPU's own doing: its peak falls in the backward of the
      last MLP, where SwiGLU's backward temporaries (two of them XLA:CPU's copies of a
      gradient's product, by their names for its dots' layouts) are live beside the
      first layer's residuals, of which it keeps x * sigmoid(x) too; a layer scan
      stacks six d_ff-sized residuals a layer where the model counts four
      (`search/cost/_stacks.py`, as GPU XLA would stack them too). Bytes moved are the
      model's; memory is outside the 20% band, which does not cover these rows.

`--pipelines` adds the GPT under `scan` pipelined over data=4 x stage=2 (`PIPELINED`:
GPipe and 1F1B, of one chunk a stage or two (the circular schedule, interleaved 1F1B),
beside data parallelism, ZeRO-1 or FSDP, with and without `Remat`),
lowered by `shard_map`, as `tests/test_pipeline*.py` hold them.

Run: `make bench` or `python benchmarks/cost_fidelity.py [--models gpt mlp] [--meshes 2x4]
[--plans hand searched random] [--max-pool] [--remat] [--llama] [--pipelines] [--json out.json]`.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder comes first on sys.path, where benchmarks/search.py
# would shadow the `search` package.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
# The examples are not installed: import them from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import partir  # noqa: E402
import search  # noqa: E402
from examples import REGISTRY, gpt, llama  # noqa: E402
from examples.plans import FIDELITY_CONFIGS, STRATEGIES, random_plan, searched_plan  # noqa: E402

#: Random valid plans per example and mesh.
RANDOM_PLANS = 3
#: `--pipelines`: (the plan's role on `data`, Remat policy or None, schedule, repeats) of the GPT
#: of 4 layers pipelined over data=4 x stage=2 in 2 microbatches (the fidelity GPT's batch of
#: 8); two repeats: the circular schedule (gpipe) or interleaved 1F1B, chunks of one layer.
PIPELINED = (("dp", None, "gpipe", 1), ("zero1", "dots", "gpipe", 1), ("fsdp", "full", "gpipe", 1),
             ("dp", None, "1f1b", 1), ("zero1", "dots", "1f1b", 1), ("fsdp", "dots", "1f1b", 1),
             ("fsdp", None, "gpipe", 2), ("dp", None, "1f1b", 2), ("fsdp", None, "1f1b", 2))


#: `--llama` [3]: a Llama small enough to compile in seconds whose activations set its peak.
LLAMA = llama.LlamaConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=256, vocab=128, seq_len=32, batch=8,
                          dtype=jax.numpy.float32)


def plans(name, program, mesh, kinds):
    """(label, partitioning) for the hand strategies (the Llama's [3]: data parallelism
    over `data` with Megatron or FSDP over `model`, by tactics, as it has no `STRATEGIES`
    entry), the searched plan and random plans."""
    if "hand" in kinds and name == "llama":
        import tactics

        for label, axis in (("data parallel + megatron", tactics.Megatron), ("data parallel + fsdp", tactics.FSDP)):
            yield label, tactics.apply_schedule(program, mesh, [tactics.DataParallel("data"), axis("model")]).partitioning
    elif "hand" in kinds:
        for strategy, apply in STRATEGIES.items():
            part = partir.Partitioning(program, mesh)
            apply(part, name, "data", "model")
            yield strategy, part
    if "searched" in kinds:
        yield "searched", searched_plan(program, mesh)
    if "random" in kinds:
        for seed in range(RANDOM_PLANS):
            yield f"random {seed}", random_plan(program, mesh, seed=seed)


def cases(args):
    """(model label, footnote, step, example args, strategy filter) to compare; with
    `--llama`, the Llama's two forms last."""
    for name in args.models:
        step, ex = REGISTRY[name](FIDELITY_CONFIGS[name], abstract=True)
        yield name, "", step, ex, name
        if name == "convnet" and args.max_pool:
            cfg = dataclasses.replace(FIDELITY_CONFIGS[name], second_pool="max")
            yield "convnet max-pool", "[1]", *REGISTRY[name](cfg, abstract=True), name
        if name == "gpt" and args.remat:
            for policy, scan in ((p, s) for p in (None, "dots") for s in (False, True)):
                cfg = dataclasses.replace(FIDELITY_CONFIGS[name], remat=True, remat_policy=policy, scan_layers=scan)
                label = "gpt remat" + (f"-{policy}" if policy else "")
                label, note = (label + " scan", "") if scan else (label, "[2]")
                yield label, note, *gpt.make_train_step(cfg, abstract=True), name
    for scan in (True, False) if args.llama else ():
        cfg = dataclasses.replace(LLAMA, scan_layers=scan)
        yield "llama" + (" scan" if scan else ""), "[3]", *llama.make_train_step(cfg, abstract=True), "llama"


def pipelined():
    """(label, partitioning, example args) of the `PIPELINED` plans."""
    import tactics

    config = dataclasses.replace(FIDELITY_CONFIGS["gpt"], scan_layers=True, n_layers=4)
    step, ex = gpt.make_train_step(config, abstract=True)
    program = partir.lift(step, *ex)
    roles = {"dp": [tactics.DataParallel("data")], "fsdp": [tactics.FSDP("data")],
             "zero1": [tactics.DataParallel("data"), tactics.ZeRO("data", stage=1)]}
    for role, policy, schedule, repeats in PIPELINED:
        plan = roles[role] + ([tactics.Remat(policy)] if policy else []) + [
            tactics.Pipeline("stage", microbatches=2, schedule=schedule, repeats=repeats)]
        part = tactics.apply_schedule(program, partir.MeshSpec.of(data=4, stage=2), plan).partitioning
        rounds = f" x{repeats}" if repeats > 1 else ""
        yield f"{role}" + (f" {policy}" if policy else "") + f" {schedule}{rounds}", part, ex


def compared(args):
    """(model label, footnote, plan, mesh, `search.Fidelity`) of every row: the cases'
    plans on each mesh (the `--llama` ones [3] among them), then the `--pipelines` plans."""
    for label, note, step, ex, name in cases(args):
        program = partir.lift(step, *ex)
        for mesh_text in args.meshes:
            d, m = map(int, mesh_text.split("x"))
            for plan, part in plans(name, program, partir.MeshSpec.of(data=d, model=m), args.plans):
                yield label, note, plan, mesh_text, search.compare_with_xla(part, ex)
    for plan, part, ex in pipelined() if args.pipelines else ():
        yield "gpt pipelined", "", plan, "4x2", search.compare_with_xla(part, ex, backend="shard_map")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt", "convnet", "moe"])
    parser.add_argument("--meshes", nargs="+", default=["1x8", "2x4", "4x2"])
    parser.add_argument("--plans", nargs="+", default=["hand", "searched", "random"])
    parser.add_argument("--max-pool", action="store_true", help="add the convnet with max pooling [1]")
    parser.add_argument("--remat", action="store_true", help="add the GPT with remat per layer [2]")
    parser.add_argument("--llama", action="store_true", help="add the Llama, scanned and unrolled [3]")
    parser.add_argument("--pipelines", action="store_true", help="add the GPT pipelined over data=4 x stage=2")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)
    table = Table(title="cost model vs XLA (CPU, per device): collectives by kind, flops, peak memory")
    for col in ("model", "plan", "mesh", "kind", "count model/xla", "bytes model", "bytes xla", "err",
                "flops model/xla", "memory model/xla"):
        table.add_column(col, justify="left" if col in ("model", "plan", "mesh", "kind") else "right")
    rows, worst_bytes, worst_memory = [], 0.0, 1.0
    for label, note, plan, mesh_text, f in compared(args):
        rows.append(_row(label + note, plan, mesh_text, f))
        kinds = f.rows() or [("-", 0, 0.0, 0, 0.0, 0.0)]
        if not note:
            worst_bytes = max([worst_bytes] + [k[-1] for k in kinds])
            worst_memory = max(worst_memory, f.memory_ratio, 1 / f.memory_ratio)
        for i, (kind, mc, mb, xc, xb, err) in enumerate(kinds):
            first = i == 0
            table.add_row(label + note if first else "", plan if first else "", mesh_text if first else "",
                          kind, f"{mc}/{xc}", f"{mb:,.0f}", f"{xb:,.0f}", f"{err:.1%}",
                          f"{f.flops_model / f.flops_xla:.3f}" if first and f.flops_xla else "",
                          f"{f.memory_ratio:.2f}" if first else "")
    console = Console(width=170)
    console.print(table)
    console.print(f"largest bytes error per kind: {worst_bytes:.1%}; memory model/xla within "
                  f"[{1 / worst_memory:.2f}, {worst_memory:.2f}] (rows without a footnote)")
    console.print(__doc__[__doc__.index("Footnotes"):__doc__.index("Run:")].rstrip())
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


def _row(model, plan, mesh, f) -> dict:
    return {"model": model, "plan": plan, "mesh": mesh, "memory_model": f.memory_model, "memory_xla": f.memory_xla,
            "flops_model": f.flops_model, "flops_xla": f.flops_xla,
            "collectives": {k: {"count_model": mc, "bytes_model": mb, "count_xla": xc, "bytes_xla": xb}
                            for k, (mc, mb, xc, xb) in f.kinds.items()}}


if __name__ == "__main__":
    main()
