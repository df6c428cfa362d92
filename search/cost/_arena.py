"""Where XLA puts temporaries: its buffer assignment, emulated.

XLA gives every output of the step an allocation of its own, held for the whole step,
and packs the temporaries into them and into one arena:

1. largest first, a temporary goes into an output's allocation that is at least as
   large and that is free for its whole lifetime (the output is written late: a
   gradient lives in the allocation of the parameter its update makes);
2. the rest go into the arena, largest first, each at the offset of the smallest gap
   that fits among the temporaries live at the same time (best fit). The arena is as
   large as its highest end: at least the most temporaries live at once, more where
   the packing leaves gaps.

`arena(...)` returns the arena's size; the cost model adds arguments and outputs.
"""

from __future__ import annotations

import numpy as np

#: XLA aligns every buffer in the arena to this many bytes.
ALIGNMENT = 64


def arena(starts, ends, sizes, out_defs, out_sizes) -> float:
    """Bytes of the arena for temporaries live over `[starts, ends]` (op indices,
    inclusive) with `sizes` bytes, given outputs defined at `out_defs` with `out_sizes`
    bytes (their allocations are free before that)."""
    order = np.lexsort((starts, -(ends - starts), -sizes))
    spare = _output_slots(out_defs, out_sizes)
    placed_s, placed_e, placed_o, placed_z = [], [], [], []
    top = 0.0
    for i in order:
        s, e, z = int(starts[i]), int(ends[i]), float(sizes[i])
        if z <= 0 or _host(spare, s, e, z):
            continue
        z = -(-z // ALIGNMENT) * ALIGNMENT
        off = _best_fit(placed_s, placed_e, placed_o, placed_z, s, e, z)
        placed_s.append(s), placed_e.append(e), placed_o.append(off), placed_z.append(z)
        top = max(top, off + z)
    return top


def _output_slots(out_defs, out_sizes) -> list:
    """Per output allocation, smallest first: [size, busy intervals]."""
    slots = [[float(z), [(int(d), np.iinfo(np.int64).max)]] for d, z in zip(out_defs, out_sizes) if z > 0]
    slots.sort(key=lambda x: x[0])
    return slots


def _host(slots, s, e, z) -> bool:
    """Put a temporary into the smallest output allocation free over [s, e]."""
    for slot in slots:
        if slot[0] < z:
            continue
        if all(e < a or s > b for a, b in slot[1]):
            slot[1].append((s, e))
            return True
    return False


def _best_fit(ps, pe, po, pz, s, e, z) -> float:
    """The offset of the smallest gap of at least z bytes among placed buffers live
    during [s, e] (the end of the highest one when none fits)."""
    if not ps:
        return 0.0
    ps_, pe_ = np.asarray(ps), np.asarray(pe)
    busy = np.nonzero((ps_ <= e) & (pe_ >= s))[0]
    if not len(busy):
        return 0.0
    lo = np.asarray(po)[busy]
    hi = lo + np.asarray(pz)[busy]
    idx = np.argsort(lo, kind="stable")
    lo, hi = lo[idx], hi[idx]
    best, best_gap, cursor = None, None, 0.0
    for a, b in zip(lo, hi):
        gap = a - cursor
        if gap >= z and (best_gap is None or gap < best_gap):
            best, best_gap = cursor, gap
        cursor = max(cursor, b)
    return cursor if best is None else best
