"""Lift time and the median time of one `tile` action (with its propagation) on the GPT
train step at 6, 12, 24 and 48 layers, d_model 1024, planned abstractly on a 2x4 mesh.

The actions timed are every (parameter, dim, axis) that is valid on a fresh
partitioning, in a seeded random order of 200, each applied to the untouched state and
rolled back, so each figure is one decision's propagation (the best of 3 runs, to keep
the machine's noise out). Lift is JAX's trace (`make_jaxpr`) plus building the IR; both
are shown. Printed as a table; the targets are lift < 1 s at 24 layers and a median
action < 10 ms.

Run: `make bench` or `python benchmarks/propagation.py [--layers 6 12 24 48]`.
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
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import partir  # noqa: E402
from examples import gpt  # noqa: E402

MESH = partir.MeshSpec.of(data=2, model=4)
SAMPLE = 200
REPEATS = 3


def measure(n_layers: int, seed: int = 0) -> dict:
    cfg = gpt.GPTConfig(n_layers=n_layers, d_model=1024, n_heads=16, d_ff=4096, vocab=32768, seq_len=1024, batch=16)
    step, args = gpt.make_train_step(cfg, abstract=True)
    t0 = time.perf_counter()
    prog = partir.lift(step, *args)
    lift_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    partir.lift(step, *args)  # JAX caches the trace: this second lift is the IR build alone
    build_s = time.perf_counter() - t0
    part = partir.Partitioning(prog, MESH)
    actions = [(v, d, a) for v, n in zip(prog.inputs, prog.input_names) if n.startswith("params")
               for d, size in enumerate(prog.values[v].shape) for a in MESH.names if size % MESH.size(a) == 0]
    random.Random(seed).shuffle(actions)
    times, touched = [], []
    for v, d, a in actions[:SAMPLE]:
        best = float("inf")
        for _ in range(REPEATS):
            mark = part.mark()
            t0 = time.perf_counter()
            part.tile(v, d, a)
            best = min(best, time.perf_counter() - t0)
            if _ == 0:
                touched.append(len(part.changed_since(mark)[1]))
            part.rollback(mark)
        times.append(best)
    return {"layers": n_layers, "ops": len(prog.ops), "trace_s": lift_s - build_s, "build_s": build_s,
            "median_ms": 1e3 * statistics.median(times),
            "p90_ms": 1e3 * sorted(times)[int(0.9 * len(times))], "max_ms": 1e3 * max(times),
            "touched": statistics.median(touched)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 12, 24, 48])
    args = parser.parse_args(argv)
    table = Table(title="lift and one tile action with propagation (GPT, d_model 1024, mesh data=2,model=4)")
    for col in ("layers", "ops", "lift s", "(trace s", "+ build s)", "action median ms", "p90 ms", "max ms",
                "ops touched (median)"):
        table.add_column(col, justify="right")
    rows = [measure(n) for n in args.layers]
    for r in rows:
        table.add_row(str(r["layers"]), str(r["ops"]), f"{r['trace_s'] + r['build_s']:.3f}", f"{r['trace_s']:.3f}",
                      f"{r['build_s']:.3f}", f"{r['median_ms']:.2f}",
                      f"{r['p90_ms']:.2f}", f"{r['max_ms']:.1f}", f"{r['touched']:.0f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
