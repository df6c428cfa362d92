"""When each stage runs which unit under 1F1B, with or without virtual stages
(`OnefSchedule`): the lockstep tick loop `lowering/_onef` runs and the cost model
prices.

A unit is one chunk of a stage's layers on one microbatch. With S stages, R chunks a
stage (R = 1: plain 1F1B; R > 1: interleaved 1F1B, Megatron's virtual stages) and M
microbatches (a multiple of S when R > 1), microbatch m = g*S + j (group g, j < S) in
chunk r is forward unit u = g*S*R + r*S + j, run by stage s in tick u + s; its
backward is unit v = g*S*R + (R-1-r)*S + j, run by stage s in tick v + (R+1)*S - 2 - s.
So a stage runs one forward and one backward unit a tick; a microbatch's carry leaves
stage S-1 in chunk r and reaches stage 0 for chunk r+1 the next tick (the loop sends
around a ring); its last chunk's forward on stage S-1 and its backward start in the same
tick, around the head. The loop has M*R + (R+1)*S - 2 ticks, of which M*R + S - 1 run a
forward on some stage and as many a backward: the step is (M*R + S - 1) ticks of a
chunk's forward and backward, the bubble (S-1)/(M*R+S-1), as the circular schedule's.
With R = 1 this is the 1F1B the project ran before, unit for unit.

A stage keeps each forward unit's residuals until its backward. The units in flight
on one stage at once are at most `ring`: (R+1)S - 1 (at most M*R), the first stage's,
which is S + (S-1)/R microbatches' residuals of the whole stage, 2S-1 with R = 1; a static
assignment of ring slots to units (`slot`) keeps them apart: lifetimes are intervals of
ticks, and assigning slots in order of start reaches the most that overlap.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class OnefSchedule:
    """The 1F1B schedule of `stages` S, `repeats` R chunks a stage and `microbatches` M
    (see the module docstring)."""

    stages: int
    repeats: int
    microbatches: int

    def __post_init__(self):
        if min(self.stages, self.repeats, self.microbatches) < 1:
            raise ValueError(f"a 1f1b schedule of {self.stages} stages, {self.repeats} repeats and "
                             f"{self.microbatches} microbatches: give positive counts")
        if self.repeats > 1 and self.microbatches % self.stages:
            raise ValueError(f"interleaved 1f1b ({self.repeats} chunks a stage) runs the microbatches in groups of "
                             f"the {self.stages} stages; {self.microbatches} microbatches are not whole groups")

    @property
    def units(self) -> int:
        """Units a stage runs each way: M*R."""
        return self.microbatches * self.repeats

    @property
    def ticks(self) -> int:
        """Trips of the tick loop: M*R + (R+1)*S - 2."""
        return self.units + (self.repeats + 1) * self.stages - 2

    @property
    def lag(self) -> int:
        """Ticks from stage s's forward unit u to its backward unit u at stage s = 0:
        (R+1)*S - 2 (backward unit v runs on stage s in tick v + lag - s)."""
        return (self.repeats + 1) * self.stages - 2

    def unit(self, m: int, r: int) -> int:
        """The forward unit of microbatch `m` in chunk `r`."""
        S, R = self.stages, self.repeats
        return (m // S) * S * R + r * S + m % S

    def forward_of(self, u):
        """(microbatch, chunk) of forward unit `u` (ints or arrays)."""
        S, R = self.stages, self.repeats
        return (u // (S * R)) * S + u % S, (u % (S * R)) // S

    def backward_of(self, v):
        """(microbatch, chunk) of backward unit `v`: chunks run last to first."""
        m, k = self.forward_of(v)
        return m, self.repeats - 1 - k

    def forward_tick(self, m: int, r: int, s: int) -> int:
        """The tick stage `s` runs microbatch `m`'s chunk `r` forward."""
        return self.unit(m, r) + s

    def backward_tick(self, m: int, r: int, s: int) -> int:
        """The tick stage `s` runs microbatch `m`'s chunk `r` backward."""
        return self.unit(m, self.repeats - 1 - r) + self.lag - s

    @property
    def ring(self) -> int:
        """Ring slots a stage needs: the most units any stage keeps at once."""
        return _assignment(self)[1]

    def slots(self) -> np.ndarray:
        """[S, M*R] ring slot of each forward unit on each stage (`slot`)."""
        return _assignment(self)[0]


@functools.lru_cache(maxsize=64)
def _assignment(sched: OnefSchedule) -> tuple[np.ndarray, int]:
    """([S, M*R] slot per forward unit and stage, slots used): each unit's residuals
    live from its forward tick to its backward tick, both included (the last stage's
    last chunk reads its own in the tick it makes them); slots handed out in order of
    start, a slot free again after the tick its unit's backward reads it."""
    stages, repeats, microbatches = sched.stages, sched.repeats, sched.microbatches
    if repeats == 1:  # (the ring in microbatch order: microbatch m in slot m mod min(M, 2S-1))
        size = min(microbatches, 2 * stages - 1)
        return np.tile(np.arange(microbatches) % size, (stages, 1)), size
    table, size = np.zeros((stages, sched.units), dtype=np.int32), 0
    for s in range(stages):
        free, busy, used = [], [], 0  # (free slots; (tick the slot frees after, slot); slots handed out)
        for u in range(sched.units):  # forward units start in order of u
            m, r = sched.forward_of(u)
            while busy and busy[0][0] < u + s:
                heapq.heappush(free, heapq.heappop(busy)[1])
            if free:
                slot = heapq.heappop(free)
            else:
                slot, used = used, used + 1
            table[s, u] = slot
            heapq.heappush(busy, (sched.backward_tick(m, r, s), slot))
        size = max(size, int(table[s].max()) + 1)
    return table, size
