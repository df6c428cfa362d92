"""Full and incremental cost evaluation on the 24-layer GPT train step (d_model 1024).

Full: build a `CostModel` on a partitioning (static analysis included) and cost it.
Incremental: after one `tile` action (a random valid (parameter, dim, axis), the same
sample as `benchmarks/propagation.py`), re-evaluate the model, which re-costs only what
the action changed; then roll back and re-evaluate again (also incremental). Timed:
`CostModel.evaluate()` (step time and peak memory, the search's call) and
`CostModel.cost()` (the full breakdown). Target: incremental re-cost < 5 ms median.

Run: `make bench` or `python benchmarks/cost.py [--layers 24]`.
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
import search  # noqa: E402
from examples import gpt  # noqa: E402

MESH = partir.MeshSpec.of(data=2, model=4)
SAMPLE = 100


def measure(n_layers: int, seed: int = 0) -> dict:
    cfg = gpt.GPTConfig(n_layers=n_layers, d_model=1024, n_heads=16, d_ff=4096, vocab=32768, seq_len=1024, batch=16)
    step, args = gpt.make_train_step(cfg, abstract=True)
    prog = partir.lift(step, *args)
    part = partir.Partitioning(prog, MESH)
    t0 = time.perf_counter()
    model = search.CostModel(part, "h100")
    model.cost()
    full_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.cost()
    breakdown_s = time.perf_counter() - t0
    actions = [(v, d, a) for v, n in zip(prog.inputs, prog.input_names) if n.startswith("params")
               for d, size in enumerate(prog.values[v].shape) for a in MESH.names if size % MESH.size(a) == 0]
    random.Random(seed).shuffle(actions)
    incremental, undo = [], []
    for v, d, a in actions[:SAMPLE]:
        mark = part.mark()
        part.tile(v, d, a)
        t0 = time.perf_counter()
        model.evaluate()
        incremental.append(time.perf_counter() - t0)
        part.rollback(mark)
        t0 = time.perf_counter()
        model.evaluate()
        undo.append(time.perf_counter() - t0)
    return {"layers": n_layers, "ops": len(prog.ops), "full_s": full_s, "breakdown_ms": 1e3 * breakdown_s,
            "inc_ms": 1e3 * statistics.median(incremental), "inc_p90_ms": 1e3 * sorted(incremental)[int(0.9 * len(incremental))],
            "undo_ms": 1e3 * statistics.median(undo)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[24])
    args = parser.parse_args(argv)
    table = Table(title="cost model evaluation (GPT, d_model 1024, mesh data=2,model=4, h100)")
    for col in ("layers", "ops", "full build+cost s", "cost() breakdown ms", "incremental median ms", "p90 ms",
                "after rollback ms"):
        table.add_column(col, justify="right")
    for r in (measure(n) for n in args.layers):
        table.add_row(str(r["layers"]), str(r["ops"]), f"{r['full_s']:.3f}", f"{r['breakdown_ms']:.2f}",
                      f"{r['inc_ms']:.2f}", f"{r['inc_p90_ms']:.2f}", f"{r['undo_ms']:.2f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
