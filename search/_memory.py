"""Peak memory per device by liveness over program order.

A *buffer* is a value together with its aliases: the values a link op only renames (a
call's argument and the body's invar, a loop carry going round). Each buffer lives from
the op that makes its first value to the last op that reads any of them:

- program inputs (parameters, optimizer state, batch) are live from the start; they
  stay live to the end unless donated (`donate_argnums`), when they die at their last
  read and their space is reused;
- program outputs stay live to the end;
- everything else (activations kept for the backward pass, gradients, temporaries) lives
  from definition to last use.

Op order is the lift order, i.e. execution order with a loop body's ops in line, once:
a body's temporaries count once, not per iteration. A buffer's bytes per device are its
largest member's shard. The peak is the largest sum of live bytes at any op.
"""

from __future__ import annotations

import numpy as np

from partir import Link

#: Link kinds that make a new buffer rather than rename one: the per-iteration slice of
#: a scan's stacked input, and the stacked output a scan writes.
COPYING_LINKS = (Link.SCAN_XS, Link.SCAN_YS)


class Liveness:
    """Static buffer structure of a program: `buffer[v]` per value, and per buffer its
    live interval `[start, end]` in op indices (the end index `len(ops)` is "after the
    last op")."""

    def __init__(self, program, donated_args=()):
        n = len(program.values)
        parent = list(range(n))

        def find(x):
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for op in program.ops:
            if op.link and op.primitive not in COPYING_LINKS:
                a, b = find(op.operands[0]), find(op.results[0])
                if a != b:
                    parent[max(a, b)] = min(a, b)
        roots: dict[int, int] = {}
        self.buffer = np.array([roots.setdefault(find(v), len(roots)) for v in range(n)], dtype=np.int64)
        nb = len(roots)
        end_of_program = len(program.ops)
        start = np.full(nb, end_of_program, dtype=np.int64)
        end = np.zeros(nb, dtype=np.int64)
        for v in range(n):
            p = program.producer[v]
            users = program.users[v]
            first = p if p >= 0 else (users[0] if users else 0)
            b = self.buffer[v]
            start[b] = min(start[b], first)
            if users:
                end[b] = max(end[b], users[-1])
        donated = set(donated_args)
        self.inputs = np.array(sorted({int(self.buffer[v]) for v in program.inputs}), dtype=np.int64)
        for v, arg in zip(program.inputs, program.input_args):
            b = self.buffer[v]
            start[b] = 0
            if arg not in donated:
                end[b] = end_of_program
        for v in program.outputs:
            if v >= 0:
                end[self.buffer[v]] = end_of_program
        self.start, self.end = start, np.maximum(end, start)
        self.num_buffers = nb
        self.length = end_of_program + 1

    def peak(self, value_bytes: np.ndarray) -> tuple[float, int, np.ndarray]:
        """(peak bytes, op index of the peak, bytes of every buffer) for per-device
        `value_bytes` (one entry per value)."""
        buf = np.zeros(self.num_buffers)
        np.maximum.at(buf, self.buffer, value_bytes)
        delta = np.zeros(self.length + 1)
        np.add.at(delta, self.start, buf)
        np.add.at(delta, self.end + 1, -buf)
        live = np.cumsum(delta[:-1])
        t = int(np.argmax(live))
        return float(live[t]), t, buf

    def live_at(self, t: int) -> np.ndarray:
        """Indices of the buffers live at op index `t`."""
        return np.nonzero((self.start <= t) & (self.end >= t))[0]
