"""The cost model beside XLA: for each example, strategy and mesh, the collectives the
model predicts and those in the compiled HLO (count and bytes per device, per kind),
per-device flops and argument bytes.

Counts differ where XLA combines gradient all-reduces into one tuple all-reduce; bytes
are what must agree (within 10%, as `tests/test_cost.py` asserts).

Run: `make bench` or `python benchmarks/cost_fidelity.py [--models gpt mlp] [--meshes 2x4]`.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's folder comes first on sys.path, where benchmarks/search.py
# would shadow the `search` package.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import argparse  # noqa: E402

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import partir  # noqa: E402
import search  # noqa: E402
from examples import REGISTRY, gpt  # noqa: E402
from examples.plans import STRATEGIES  # noqa: E402

GPT = gpt.GPTConfig(d_model=128, d_ff=512, n_heads=8, seq_len=32, vocab=512, batch=8)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt", "convnet", "moe"])
    parser.add_argument("--meshes", nargs="+", default=["1x8", "2x4", "4x2"])
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)
    table = Table(title="cost model vs XLA (CPU, per device): collectives by kind, flops, argument bytes")
    for col in ("model", "strategy", "mesh", "kind", "count model/xla", "bytes model", "bytes xla", "err",
                "flops model/xla", "args equal"):
        table.add_column(col, justify="left" if col in ("model", "strategy", "mesh", "kind") else "right")
    worst = 0.0
    for name in args.models:
        for mesh in args.meshes:
            d, m = map(int, mesh.split("x"))
            for strategy, apply in STRATEGIES.items():
                step, ex = gpt.make_train_step(GPT, abstract=True) if name == "gpt" else REGISTRY[name](abstract=True)
                part = partir.Partitioning(partir.lift(step, *ex), partir.MeshSpec.of(data=d, model=m))
                apply(part, name, "data", "model")
                f = search.compare_with_xla(part, ex)
                rows = f.rows() or [("-", 0, 0.0, 0, 0.0, 0.0)]
                for i, (kind, mc, mb, xc, xb, err) in enumerate(rows):
                    worst = max(worst, err)
                    first = i == 0
                    table.add_row(name if first else "", strategy if first else "", mesh if first else "", kind,
                                  f"{mc}/{xc}", f"{mb:,.0f}", f"{xb:,.0f}", f"{err:.1%}",
                                  f"{f.flops_model / f.flops_xla:.3f}" if first else "",
                                  str(f.args_model == f.args_xla) if first else "")
    Console(width=160).print(table)
    Console(width=160).print(f"largest bytes error per kind: {worst:.1%}")


if __name__ == "__main__":
    main()
