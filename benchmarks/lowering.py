"""The two lowerings side by side: compile time and collective bytes per example and plan.

For each example (at `examples.plans.FIDELITY_CONFIGS`) and plan (the hand-written
strategies of `examples.plans` and the plan the automatic search returns, or random
valid plans with `--plans random`, on a
`data=2, model=4` mesh of simulated CPU devices), the time to trace, lower and compile
the train step with the `jit` lowering (XLA's partitioner inserts the collectives) and
with the `shard_map` lowering (the per-device program with explicit collectives), the
collective bytes per device per step the cost model lists and each compiled program
holds (the buffer of an all-reduce, all-to-all or collective-permute, the result of an
all-gather or reduce-scatter; loop bodies once, as the HLO text holds them), and
whether each program holds exactly the modeled collectives (kind, axes and bytes of
every one).

The `cpu` device costs a reduce-scatter as the all-reduce of its operand, which is what
XLA's partitioner emits on CPU under the jit lowering; the shard_map lowering runs a
real reduce-scatter there too, so its bytes are smaller than modeled where a plan
reduce-scatters (FSDP's gradients), and "exact" counts a reduce-scatter as the
all-reduce of its operand.

Run: `python benchmarks/lowering.py [--models gpt mlp] [--plans hand searched] [--json out.json]`.
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
import collections  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import partir  # noqa: E402
import search  # noqa: E402
from examples import REGISTRY  # noqa: E402
from examples.plans import FIDELITY_CONFIGS  # noqa: E402
from search import materialization  # noqa: E402

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # after `search`: the sibling benchmark's plans
from cost_fidelity import plans  # noqa: E402

MESH = partir.MeshSpec.of(data=2, model=4)


def compiled(part, args, backend: str):
    """(seconds to trace, lower and compile, the compiled program's collectives)."""
    options = {"free": materialization(part.program).from_scalars} if backend == "shard_map" else {}
    start = time.perf_counter()
    text = partir.lower(part, backend=backend, **options).lower(*args).compile().as_text()
    return time.perf_counter() - start, partir.collectives(text, MESH.jax_mesh())


def row(name, label, part, args) -> dict:
    cost = search.CostModel(part, "cpu").cost()
    modeled = collections.Counter((c.kind, c.axes, int(c.bytes)) for c in cost.collectives)
    out = {"model": name, "plan": label, "modeled_bytes": sum(c.bytes for c in cost.collectives)}
    for backend in ("jit", "shard_map"):
        seconds, cols = compiled(part, args, backend)
        out[f"{backend}_compile_s"] = seconds
        out[f"{backend}_bytes"] = sum(c.result_bytes for c in cols)
        out[f"{backend}_count"] = len(cols)
        out[f"{backend}_exact"] = partir.collective_buffers(cols, reduce_scatter=False) == modeled
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt", "convnet", "moe"])
    parser.add_argument("--plans", nargs="+", default=["hand", "searched"], help="hand, searched and/or random")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)
    table = Table(title="jit vs shard_map lowering (CPU, data=2 x model=4): compile time and collective bytes "
                        "per device per step")
    for col in ("model", "plan", "compile jit", "compile shard_map", "bytes modeled", "bytes jit",
                "bytes shard_map", "exact jit", "exact shard_map"):
        table.add_column(col, justify="left" if col in ("model", "plan") else "right")
    rows = []
    for name in args.models:
        step, ex = REGISTRY[name](FIDELITY_CONFIGS[name], abstract=True)
        program = partir.lift(step, *ex)
        for label, part in plans(name, program, MESH, args.plans):
            r = row(name, label, part, ex)
            rows.append(r)
            table.add_row(name, label, f"{r['jit_compile_s']:.2f} s", f"{r['shard_map_compile_s']:.2f} s",
                          f"{r['modeled_bytes']:,.0f}", f"{r['jit_bytes']:,.0f}", f"{r['shard_map_bytes']:,.0f}",
                          "yes" if r["jit_exact"] else "no", "yes" if r["shard_map_exact"] else "no")
    Console(width=170).print(table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
