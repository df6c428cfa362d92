"""Search quality and speed on the GPT train step (d_model 1024, seq 1024, batch 8, H100).

For each depth and mesh: the modeled step time of the searched plan divided by the
expert's (the best of every schedule a practitioner would write for the model and mesh,
`examples.experts`: data parallel, ZeRO-1/2, FSDP, tensor parallelism with and without
sequence parallelism and with each of those, each with remat off, `dots` and `full`;
ranked on the model's scanned form, which costs the same, and the best few costed again
on the row's program; `--experts` lists them all), the wall time the search took to
first reach the expert's cost, and, on the small cases (6 layers), the searched plan
divided by the exact optimum among plans of at most `--exact-depth` actions (the same
action space and cost model, enumerated). Targets: <= 1.00 against the expert, within
2% of the optimum; 24 layers on 2x4 reach the expert in < 10 s, 48 layers in < 1.5x that.
From 8 layers on, the search runs on 2- and 3-layer twins of the model and extrapolates
their costs (`search._twins`), so its time does not grow with depth; "search s" also
counts applying the plan to the deep program and checking it against the twins.

Run: `make bench` or `python benchmarks/search.py [--layers 6 24] [--meshes 2x4] [--budget 30] [--experts]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

# Run as a script, this file's folder comes first on sys.path and its name would shadow
# the `search` package it measures.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
# The examples are not installed: import them from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import partir  # noqa: E402
import search  # noqa: E402
import tactics  # noqa: E402
from examples import experts, gpt  # noqa: E402

#: The cost model's device.
DEVICE = "h100"


def _program(cfg):
    step, args = gpt.make_train_step(cfg, abstract=True)
    return partir.lift(step, *args)


def run(layers: int, mesh_text: str, budget: float, seed: int, exact_depth: int, listing: bool) -> dict:
    d, m = map(int, mesh_text.split("x"))
    mesh = partir.MeshSpec.of(data=d, model=m)
    cfg = gpt.GPTConfig(n_layers=layers, d_model=1024, n_heads=16, d_ff=4096, vocab=32768, seq_len=1024, batch=8)
    prog = _program(cfg)
    scanned = _program(dataclasses.replace(cfg, scan_layers=True))
    best, costed = experts.expert(prog, mesh, device=DEVICE, ranking=scanned)
    if listing:
        print(f"{layers} layers, {mesh_text}: {len(costed)} expert candidates (on the scanned form); best {best.name}")
        print("\n".join(experts.listing(costed)))
    ename, etime = best.name, best.step_s
    t0 = time.perf_counter()
    auto = search.AutomaticPartition(budget_s=budget, seed=seed)
    res = tactics.apply_schedule(prog, mesh, [auto])
    wall = time.perf_counter() - t0
    (result,) = res.context.search
    stats = result.stats
    found = search.CostModel(res.partitioning.copy(), DEVICE).cost().step_time
    reach = next((t for t, _, st in stats.trace if st <= etime * (1 + 1e-9)), None)
    row = {"layers": layers, "mesh": mesh_text, "expert": ename, "ratio": found / etime, "reach": reach,
           "wall": wall, "episodes": stats.episodes, "states": stats.states, "exact": None}
    if exact_depth and layers <= 6:
        # The same search state and macros as the search's, walked exhaustively.
        state, macros = auto.search_space(partir.Partitioning(prog, mesh), tactics.Context())
        ex = search.exhaustive(state, max_depth=exact_depth, max_states=200_000, macros=macros)
        row["exact"] = found / ex.step_time
        row["exact_states"] = ex.states
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 12, 24, 48])
    parser.add_argument("--meshes", nargs="+", default=["1x8", "2x4", "4x2"])
    parser.add_argument("--budget", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exact-depth", type=int, default=3)
    parser.add_argument("--experts", action="store_true", help="list every expert candidate of every row")
    args = parser.parse_args(argv)
    table = Table(title="search vs expert plans (GPT d_model 1024, seq 1024, batch 8, H100, modeled)")
    for col in ("layers", "mesh", "expert plan", "searched/expert", "searched/exact", "s to reach expert",
                "search s", "episodes", "states"):
        table.add_column(col, justify="right")
    reach = {}
    for layers in args.layers:
        for mesh in args.meshes:
            r = run(layers, mesh, args.budget, args.seed, args.exact_depth, args.experts)
            reach[layers, mesh] = r["reach"]
            table.add_row(str(r["layers"]), r["mesh"], r["expert"], f"{r['ratio']:.3f}",
                          "-" if r["exact"] is None else f"{r['exact']:.3f} ({r['exact_states']} states)",
                          "not reached" if r["reach"] is None else f"{r['reach']:.2f}", f"{r['wall']:.1f}",
                          str(r["episodes"]), str(r["states"]))
    console = Console(width=160)
    console.print(table)
    for mesh in args.meshes:
        deep, shallow = reach.get((48, mesh)), reach.get((24, mesh))
        if deep is not None and shallow is not None:
            console.print(f"{mesh}: time to reach the expert, 48 layers / 24 layers = {deep / shallow:.2f} (target < 1.5)")


if __name__ == "__main__":
    main()
