"""automap's errors and warnings. All errors are `partir.PartitioningError`s (so
`ValueError`s); each message names the thing, the problem and the fix, and nothing is
half-applied when one is raised (no cache entry, plan file or partitioning changed)."""

from __future__ import annotations

from partir import PartitioningError


class AutomapError(PartitioningError):
    """An argument of automap's API that cannot be used (a wrong type, range or value);
    also the base of automap's other errors."""


class PlanError(AutomapError):
    """A plan that does not fit the program, mesh or file it is used with."""


class MemoryLimitError(PlanError):
    """No plan found fits the memory limit. `peak` and `limit` are bytes per device;
    `live` lists `(buffer name, bytes)` live at the best plan's peak, largest first;
    `plan` is that best plan (what `best_effort=True` returns)."""

    def __init__(self, message: str, *, peak: float, limit: float, live: tuple, plan=None):
        super().__init__(message)
        self.peak, self.limit, self.live, self.plan = peak, limit, live, plan


class PlanCacheWarning(UserWarning):
    """A plan cache entry that could not be used was set aside; the plan is made again."""
