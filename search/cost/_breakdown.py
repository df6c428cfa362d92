"""The readable breakdown of a step's cost (`Cost`), and how bytes and seconds print."""

from __future__ import annotations

from dataclasses import dataclass

from ._comm import CollectiveCost
from ._report import cost_tables
from ._units import bytes_str, time_str  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class Cost:
    """A readable cost breakdown; `print(cost)` or `rich.print(cost)` shows the tables."""

    device: str
    mesh: str
    flops: float
    flops_loops_once: float
    transcendentals: float
    compute_time: float
    backward_compute_time: float
    comm_time: float
    exposed_comm_time: float
    overlap: bool
    gradient_comm_time: float
    collectives: tuple[CollectiveCost, ...]
    memory_peak: float
    memory_at_peak: tuple[tuple[str, float], ...]
    argument_bytes: float
    memory_limit: float
    top_ops: tuple[tuple[str, float], ...]
    #: Per pipeline of the plan (`Partitioning.pipelines`), one tick's seconds per pass
    #: (`_timeline.TickTimes`): what the schedule's timeline is drawn from.
    pipeline_ticks: tuple = ()

    @property
    def step_time(self) -> float:
        """Compute plus the communication it does not hide (seconds): all of it where
        the device does not overlap (`DeviceSpec.overlap`), see `_achieved`."""
        return self.compute_time + self.exposed_comm_time

    @property
    def step_time_overlap(self) -> float:
        """Step time with gradient reductions overlapping the backward pass (seconds):
        `step_time` where the device's model overlaps already."""
        if self.overlap:
            return self.step_time
        hidden = min(self.gradient_comm_time, self.backward_compute_time)
        return self.compute_time + self.comm_time - hidden

    @property
    def fits(self) -> bool:
        """Whether the peak memory fits the memory limit."""
        return self.memory_peak <= self.memory_limit

    def by_kind(self) -> dict[str, tuple[float, float]]:
        """Collective kind -> (count per step, bytes per device per step)."""
        out: dict[str, list] = {}
        for c in self.collectives:
            e = out.setdefault(c.kind, [0.0, 0.0])
            e[0] += c.count
            e[1] += c.bytes * c.count
        return {k: tuple(v) for k, v in sorted(out.items())}

    def by_axis(self) -> dict[tuple[str, ...], tuple[float, float, float]]:
        """Mesh axes -> (count, bytes, seconds) per step, over all kinds."""
        out: dict[tuple, list] = {}
        for c in self.collectives:
            e = out.setdefault(c.axes, [0.0, 0.0, 0.0])
            e[0] += c.count
            e[1] += c.bytes * c.count
            e[2] += c.time * c.count
        return {k: tuple(v) for k, v in sorted(out.items())}

    def __rich_console__(self, console, options):
        yield from cost_tables(self)

    def __str__(self) -> str:
        import io

        from rich.console import Console

        console = Console(width=120, file=io.StringIO())
        console.print(self)
        return console.file.getvalue()
