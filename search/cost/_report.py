"""Rich tables of a `Cost`: headline, top ops by time, collectives by axis, memory at peak."""

from __future__ import annotations

from rich.table import Table

from ._units import bytes_str, time_str


def collectives_table(cost, title: str) -> Table:
    """The collectives of a step by (mesh axes, kind): count, bytes per device, time."""
    comm = Table(title=title)
    for col in ("axes", "kind", "count", "bytes/device", "time"):
        comm.add_column(col, justify="left" if col in ("axes", "kind") else "right")
    rows: dict = {}
    for c in cost.collectives:
        e = rows.setdefault((c.axes, c.kind), [0.0, 0.0, 0.0])
        e[0] += c.count
        e[1] += c.bytes * c.count
        e[2] += c.time * c.count
    for (axes, kind), (n, b, t) in sorted(rows.items()):
        comm.add_row(", ".join(axes), kind, f"{n:g}", bytes_str(b), time_str(t))
    return comm


def cost_tables(cost):
    """Yield the renderables that show a `Cost`."""
    head = Table(title=f"modeled step on {cost.device}, mesh {cost.mesh} (per device)", show_header=False)
    head.add_column("what")
    head.add_column("value", justify="right")
    head.add_row("step time" + (" (overlapped as the device does)" if cost.overlap else ", no overlap"),
                 time_str(cost.step_time))
    head.add_row("step time, gradient reductions overlapped", time_str(cost.step_time_overlap))
    head.add_row("compute", time_str(cost.compute_time))
    head.add_row("communication (exposed)", f"{time_str(cost.comm_time)} ({time_str(cost.exposed_comm_time)})")
    head.add_row("flops", f"{cost.flops:.4g}")
    head.add_row("peak memory", f"{bytes_str(cost.memory_peak)} of {bytes_str(cost.memory_limit)}"
                 + ("" if cost.fits else "  [red]does not fit[/]"))
    head.add_row("arguments", bytes_str(cost.argument_bytes))
    yield head

    ops = Table(title="top ops by time")
    ops.add_column("op", no_wrap=True)
    ops.add_column("time", justify="right")
    for name, t in cost.top_ops:
        ops.add_row(name, time_str(t))
    yield ops

    yield collectives_table(cost, "collectives by mesh axis (per step)")

    mem = Table(title=f"live at the memory peak ({bytes_str(cost.memory_peak)})")
    mem.add_column("buffer", no_wrap=True)
    mem.add_column("bytes", justify="right")
    for name, b in cost.memory_at_peak:
        mem.add_row(name, bytes_str(b))
    yield mem
