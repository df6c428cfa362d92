"""Plans at the scale people train: Llama-3 8B/70B and Mixtral-shaped train steps on
64 to 1024 devices, planned from abstract shapes on the H100 cost model with 80 GB.

Per row (a model, its layer form, a mesh): the time to lift the train step, the search's
wall time and the peak RSS of the process that ran it (each row runs in a process of its
own), and for the searched plan and the best expert schedule (the example's own
`SCHEDULES`, written with the project's tactics as a practitioner would, each also with
`Remat("dots")` and `Remat("full")`; the fastest that fits, else the smallest): modeled step time, peak memory per device, whether it fits, and
the modeled MFU

    MFU = model flops / (devices x peak bf16 flops x step time)

(model flops: the unpartitioned program's, as XLA counts them), the distance to the
physical limit; and searched / expert step time.

Run: `make bench-scale` or `python benchmarks/scale.py [--rows llama8b-dm ...] [--budget S]
[--json rows.json]`. Abstract shapes only: nothing at this scale is allocated.
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
import resource  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

#: The memory each device has (bytes): an H100's 80 GB.
MEMORY_LIMIT = 80e9
#: The cost model's device.
DEVICE = "h100"
#: The rematerialization policies each expert schedule is also tried with, as
#: practitioners turn on activation checkpointing at this scale (MaxText's remat_policy).
EXPERT_REMAT = ("dots", "full")


@dataclasses.dataclass(frozen=True)
class Row:
    """One benchmark row: an example config (module, constant, overrides), a mesh, the
    expert schedules to beat (name, keyword arguments of `SCHEDULES[name]`) and the
    search's time budget."""

    label: str
    module: str
    config: str
    overrides: tuple
    mesh: tuple
    experts: tuple
    budget_s: float


def _llama(label, config, scan, mesh, experts, budget):
    form = "scan" if scan else "unrolled"
    return Row(f"{label} {form}", "llama", config, (("scan_layers", scan), ("remat", False)), mesh, experts, budget)


_DM = (("data", 8), ("model", 8))
_DFM = (("data", 2), ("fsdp", 4), ("model", 8))
_BIG = (("data", 16), ("fsdp", 8), ("model", 8))
_DM_EXPERTS = (("dp+tp+sp+zero3", (("data", "data"), ("model", "model"))),
               ("fsdp+tp", (("fsdp", "data"), ("model", "model"), ("data", None))),
               ("fsdp", (("axes", ("data", "model")),)))
_DFM_EXPERTS = (("fsdp+tp", (("fsdp", "fsdp"), ("model", "model"), ("data", "data"))),
                ("fsdp", (("axes", ("data", "fsdp", "model")),)))

#: Row key -> row.
ROWS = {
    **{f"llama8b-dm-{f}": _llama("Llama-3 8B, data=8 model=8", "LLAMA3_8B", f == "scan", _DM, _DM_EXPERTS, 25)
       for f in ("scan", "unrolled")},
    **{f"llama8b-dfm-{f}": _llama("Llama-3 8B, data=2 fsdp=4 model=8", "LLAMA3_8B", f == "scan", _DFM,
                                  _DFM_EXPERTS, 25) for f in ("scan", "unrolled")},
    **{f"llama70b-{f}": _llama("Llama-3 70B, data=16 fsdp=8 model=8", "LLAMA3_70B", f == "scan", _BIG,
                               _DFM_EXPERTS, 60) for f in ("scan", "unrolled")},
    "mixtral": Row("Mixtral 8x7B MoE, data=8 expert=8", "moe", "MIXTRAL_8X7B", (), (("data", 8), ("expert", 8)),
                   (("ep+dp", (("expert", "expert"), ("data", "data"))),
                    ("ep+fsdp", (("expert", "expert"), ("data", "data")))), 30),
}


def run_row(key: str, budget: float | None) -> dict:
    """Measure one row in this process (see the module docstring)."""
    import importlib

    import partir
    import search
    import tactics

    row = ROWS[key]
    module = importlib.import_module(f"examples.{row.module}")
    config = dataclasses.replace(getattr(module, row.config), **dict(row.overrides))
    step, args = module.make_train_step(config, abstract=True)
    t0 = time.perf_counter()
    program = partir.lift(step, *args)
    lift_s = time.perf_counter() - t0
    mesh = partir.MeshSpec(row.mesh)
    flops = search.CostModel(partir.Partitioning(program, mesh), DEVICE).cost().flops
    t0 = time.perf_counter()
    auto = search.AutomaticPartition(budget_s=budget or row.budget_s, memory_limit=MEMORY_LIMIT, device=DEVICE)
    searched = tactics.apply_schedule(program, mesh, [auto])
    search_s = time.perf_counter() - t0
    out = {"row": key, "label": row.label, "devices": mesh.num_devices, "lift_s": lift_s, "search_s": search_s,
           "searched": _summary(searched.partitioning, flops, mesh), "experts": {},
           "plan": [a.describe(r.groups) for r in searched.context.search for a in r.actions]}
    for name, kwargs in row.experts:
        kw = dict(kwargs)
        schedule = module.SCHEDULES[name](*kw.pop("axes")) if "axes" in kw else module.SCHEDULES[name](**kw)
        for policy in (None,) + EXPERT_REMAT:
            label = name if policy is None else f"{name}+remat({policy})"
            try:
                remat = [tactics.Remat(policy)] if policy else []
                part = tactics.apply_schedule(program, mesh, schedule + remat).partitioning
                out["experts"][label] = _summary(part, flops, mesh)
            except partir.PartitioningError as e:
                out["experts"][label] = {"error": str(e).splitlines()[0]}
    out["rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def _summary(part, flops, mesh) -> dict:
    import search

    cost = search.CostModel(part.copy(), DEVICE, memory_limit=MEMORY_LIMIT).cost()
    peak_flops = search.get_device(DEVICE).flops_for("bfloat16")
    return {"step_s": cost.step_time, "peak_bytes": cost.memory_peak, "fits": bool(cost.fits),
            "mfu": flops / (mesh.num_devices * peak_flops * cost.step_time)}


def best_expert(experts: dict) -> tuple[str, dict] | None:
    """The fastest expert schedule that fits, else the one with the smallest peak."""
    ok = [(k, v) for k, v in experts.items() if "error" not in v]
    if not ok:
        return None
    fitting = [kv for kv in ok if kv[1]["fits"]]
    return min(fitting, key=lambda kv: kv[1]["step_s"]) if fitting else min(ok, key=lambda kv: kv[1]["peak_bytes"])


def _table(results) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"plans at scale ({DEVICE} cost model, {MEMORY_LIMIT / 1e9:.0f} GB per device)")
    for col in ("row", "devices", "lift", "search", "RSS", "searched step", "peak", "fits", "MFU", "best expert",
                "step", "peak", "fits", "MFU", "searched/expert"):
        table.add_column(col, justify="left" if col in ("row", "best expert") else "right")
    for r in results:
        s, best = r["searched"], best_expert(r["experts"])
        e = best[1] if best else {}
        table.add_row(r["label"], str(r["devices"]), f"{r['lift_s']:.1f} s", f"{r['search_s']:.1f} s",
                      f"{r['rss_gib']:.2f} GiB", f"{s['step_s'] * 1e3:.0f} ms", f"{s['peak_bytes'] / 2**30:.1f} GiB",
                      "yes" if s["fits"] else "no", f"{s['mfu']:.1%}", best[0] if best else "-",
                      f"{e['step_s'] * 1e3:.0f} ms" if e else "-", f"{e['peak_bytes'] / 2**30:.1f} GiB" if e else "-",
                      ("yes" if e["fits"] else "no") if e else "-", f"{e['mfu']:.1%}" if e else "-",
                      f"{s['step_s'] / e['step_s']:.2f}" if e else "-")
    Console(width=200).print(table)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--budget", type=float, default=None, help="search seconds per row (default: the row's)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # run one row, print JSON
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_row(args.one, args.budget)))
        return
    results = []
    for key in args.rows:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", key]
        if args.budget is not None:
            cmd += ["--budget", str(args.budget)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            print(f"row {key} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    _table(results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
