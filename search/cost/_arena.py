"""Where XLA puts temporaries: its buffer assignment, emulated.

XLA gives every output of the step an allocation of its own, held for the whole step,
and packs the temporaries into them and into one arena:

1. largest first, a temporary goes into an output's allocation that is at least as
   large and that is free for its whole lifetime (the output is written late: a
   gradient lives in the allocation of the parameter its update makes), but for the
   state of a pipeline's tick loop (`_tick_buffers`), which XLA keeps in the arena:
   packed into the outputs, uneven stages' plans with `Remat` modeled 0.78-0.85 of
   XLA's peak, in the arena 0.89-0.99 (`tests/test_pipeline_uneven.py`);
2. the rest go into the arena, largest first, each at the offset of the smallest gap
   that fits among the temporaries live at the same time (best fit). The arena is as
   large as its highest end: at least the most temporaries live at once, more where
   the packing leaves gaps.

`arena(...)` returns the arena's size; the cost model adds arguments and outputs.
"""

from __future__ import annotations

import bisect

import numpy as np

#: XLA aligns every buffer in the arena to this many bytes.
ALIGNMENT = 64


def arena(starts, ends, sizes, out_defs, out_sizes, hostable=None) -> float:
    """Bytes of the arena for temporaries live over `[starts, ends]` (op indices,
    inclusive) with `sizes` bytes, given outputs defined at `out_defs` with `out_sizes`
    bytes (their allocations are free before that); `hostable` (default all) says which
    temporaries may go into an output's allocation."""
    order = np.lexsort((starts, -(ends - starts), -sizes))
    spare = _output_slots(out_defs, out_sizes)
    spare_sizes = [slot[0] for slot in spare]
    # The buffers placed so far, their first `count` rows: filled in place (a deep
    # program places thousands, each against all placed before it).
    placed = _Placed(len(order))
    top = 0.0
    for i in order:
        s, e, z = int(starts[i]), int(ends[i]), float(sizes[i])
        if z <= 0 or ((hostable is None or hostable[i]) and _host(spare, spare_sizes, s, e, z)):
            continue
        z = -(-z // ALIGNMENT) * ALIGNMENT
        off = _best_fit(placed, s, e, z)
        placed.add(s, e, off, z)
        top = max(top, off + z)
    return top


class _Placed:
    """The buffers placed in the arena: live intervals, offsets and sizes."""

    def __init__(self, capacity: int):
        self.start = np.zeros(capacity, dtype=np.int64)
        self.end = np.zeros(capacity, dtype=np.int64)
        self.offset = np.zeros(capacity, dtype=float)
        self.size = np.zeros(capacity, dtype=float)
        self.count = 0

    def add(self, s: int, e: int, off: float, z: float) -> None:
        """Place one more buffer."""
        k = self.count
        self.start[k], self.end[k], self.offset[k], self.size[k] = s, e, off, z
        self.count = k + 1


def _output_slots(out_defs, out_sizes) -> list:
    """Per output allocation, smallest first: [size, busy intervals]."""
    slots = [[float(z), [(int(d), np.iinfo(np.int64).max)]] for d, z in zip(out_defs, out_sizes) if z > 0]
    slots.sort(key=lambda x: x[0])
    return slots


def _host(slots, sizes, s, e, z) -> bool:
    """Put a temporary into the smallest output allocation free over [s, e] (`sizes`:
    the slots' sizes, ascending)."""
    for slot in slots[bisect.bisect_left(sizes, z):]:
        if all(e < a or s > b for a, b in slot[1]):
            slot[1].append((s, e))
            return True
    return False


def _best_fit(placed: _Placed, s, e, z) -> float:
    """The offset of the smallest gap of at least z bytes among placed buffers live
    during [s, e] (the end of the highest one when none fits); the first such gap from
    the bottom where several are as small."""
    k = placed.count
    busy = np.nonzero((placed.start[:k] <= e) & (placed.end[:k] >= s))[0]
    if not len(busy):
        return 0.0
    lo = placed.offset[busy]
    hi = lo + placed.size[busy]
    idx = np.argsort(lo, kind="stable")
    lo, hi = lo[idx], hi[idx]
    # Below each buffer (in offset order), the gap from the highest end under it.
    below = np.maximum.accumulate(np.concatenate(([0.0], hi[:-1])))
    gaps = lo - below
    fits = np.nonzero(gaps >= z)[0]
    if not len(fits):
        return float(max(below[-1], hi[-1]))
    return float(below[fits[np.argmin(gaps[fits])]])
