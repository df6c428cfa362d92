"""Which mechanism of the time model moves which published row (`published.py --ablate`).

Each mechanism is a set of `DeviceSpec` fields (`search.cost._device`); switched off,
they take the ideal machine's values, the `cpu` preset's. Per expressible row, the
modeled error of its published configuration with every mechanism on (the table of
`make bench-published`), then with each one off in turn: the change is what that
mechanism does to the row. The partitioning is built once a row; only the device
changes.
"""

from __future__ import annotations

import dataclasses

#: (name, the `DeviceSpec` fields that switch it off, what it is). Each name is a
#: mechanism of docs/design.md, "The time model".
MECHANISMS = (
    ("matmul rate", {"matmul_efficiency": 1.0, "matmul_knee": 0.0},
     "achieved matmul throughput below the datasheet, lower for small and skinny shards"),
    ("fused attention", {"fused_attention": False},
     "the cuDNN/splash kernel: no score buffers, its own rate, Q K^T again in the backward"),
    ("overlap", {"overlap": False, "overlap_activations": False, "overlap_slowdown": 0.0},
     "collectives behind compute (weight gathers, gradient reductions; activations where the run overlaps them)"),
    ("bus bandwidth", {"collective_efficiency": 1.0}, "NCCL-tests' bus bandwidth below the line rate"),
    ("op overhead", {"op_overhead": 0.0}, "a fixed cost per matmul and attention kernel"),
    ("fusion", {"priority_fusion": False}, "XLA:GPU's priority fusion of cheap producers into all readers (TPU too)"),
    ("reassociation", {"reassociate": False}, "XLA:GPU's one reduction of a sum of reductions"),
)


def ablate(published, rows, names=None) -> dict[str, dict[str, float]]:
    """Per expressible row of `rows` (the `published` benchmark module's `Row`s): the
    modeled error of its published configuration with every mechanism ('all') and with
    each of `names` (default: all of `MECHANISMS`) switched off."""
    chosen = [m for m in MECHANISMS if names is None or m[0] in names]
    unknown = sorted(set(names or ()) - {m[0] for m in MECHANISMS})
    if unknown:
        raise ValueError(f"unknown mechanisms {unknown}; allowed: {[m[0] for m in MECHANISMS]}")
    out = {}
    for r in (r for r in rows if r.expressible):
        device = published.row_device(r)
        part, two, whole = published.published_plan(r)
        step = published.published_step(r)

        def error(spec):
            modeled = published.summary(part, r, spec, two, whole=whole)["step_s"]
            return step / modeled - 1  # MFU is flops over time: modeled MFU / published MFU - 1

        out[r.id] = {"all": error(device)} | {name: error(dataclasses.replace(device, **off))
                                               for name, off, _ in chosen}
    return out


def print_table(errors: dict[str, dict[str, float]]) -> None:
    """The ablation as a table: a row's error with every mechanism, then with each off."""
    from rich.console import Console
    from rich.table import Table

    names = [n for n in next(iter(errors.values()))] if errors else ["all"]
    table = Table(title="modeled error of each published configuration with every mechanism ('all') and with "
                        "each one off (docs/design.md, 'The time model')")
    table.add_column("run", justify="left")
    for n in names:
        table.add_column(n if n != "all" else "all on", justify="right")
    for rid, row in errors.items():
        table.add_row(rid, *(f"{row[n]:+.1%}" for n in names))
    Console(width=200).print(table)
