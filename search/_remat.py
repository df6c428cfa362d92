"""What rematerialization does to the cost of a step (see `partir._remat`).

Recomputing a residual instead of keeping it

- frees it: in an unrolled program its buffer dies at its last forward read; a scan
  does not stack it at all;
- makes it again in the backward pass: a temporary from its first backward read to its
  last (in a scan, within the backward loop's body);
- keeps what it is recomputed from (its sources), which other residuals and the inputs
  are anyway; a scan's layer input that the forward loop did not stack is stacked for
  it (the lowering adds that output);
- runs its forward ops again, in the backward pass, collectives included (the
  `collectives` policy keeps what moved data, so it repeats none).

`RematView(program, base, recomputed)` holds these static facts for one set of
recomputed residuals; the cost model keeps one per set it meets.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import partir
from partir import Link

from ._memory import Liveness


class RematView:
    """The buffer structure (`liveness`) and the ops run again (`ops`) when the
    residuals `recomputed` are rematerialized; `extra` lists additional temporaries as
    `(start, end, value, scale)`, of `scale` times the value's bytes."""

    def __init__(self, program, materialization, donated, recomputed: frozenset):
        rec = partir.recompute(program, recomputed)
        self.ops = np.array(rec.ops, dtype=np.int64)
        backward = program.backward
        virtual = materialization.virtual.copy()
        sources = dict(materialization.sources)
        forward_only, extra, added, extend = set(), [], set(), {}
        stacked = {op.operands[0]: op.results[0] for op in program.ops if op.link and op.primitive == Link.SCAN_YS}
        for r, srcs in rec.sources.items():
            stack = stacked.get(r)
            if stack is None:  # unrolled: freed after the forward reads, made again for the backward ones
                forward_only.add(r)
                late = [u for u in program.users[r] if backward[u]]
                if late:  # its sources stay until it is made again
                    extra.append((min(late), max(late), r, 1))
                    for s in srcs:
                        extend[s] = max(extend.get(s, 0), min(late))
                continue
            virtual[stack] = True
            for op in program.ops:
                if op.link and op.primitive == Link.SCAN_XS and op.operands[0] == stack:
                    sliced = op.results[0]
                    virtual[sliced] = True
                    users = program.users[sliced]
                    if users:
                        extra.append((min(users), max(users), sliced, 1))
            trips = program.regions[program.values[r].region].trip_count or 1
            for s in srcs:
                if s not in stacked and _is_invar(program, s) and s not in added:
                    added.add(s)
                    extra.append((_made(program, s), len(program.ops) - 1, s, trips))  # stacked for it
        mat = dataclasses.replace(materialization, virtual=virtual, sources=sources)
        self.liveness = Liveness(program, mat, donated, forward_only=forward_only, extend=extend)
        self.extra = extra

    def buffers(self, value_bytes):
        """(starts, ends, bytes) of the extra temporaries for per-device `value_bytes`."""
        if not self.extra:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
        starts, ends, values, scales = (np.array(x) for x in zip(*self.extra))
        return starts.astype(np.int64), ends.astype(np.int64), value_bytes[values] * scales


def _made(program, v: int) -> int:
    p = program.producer[v]
    return max(p, 0)


def _is_invar(program, v: int) -> bool:
    """Is `v` a body's invar not stacked by the forward loop (its layer input, say)?"""
    p = program.producer[v]
    return p >= 0 and program.ops[p].link and program.ops[p].primitive in (Link.SCAN_CARRY_IN, Link.SCAN_CARRY_LOOP)
