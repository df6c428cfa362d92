"""Peak memory per device: what XLA reserves to run the step.

XLA runs a step with three kinds of memory (`compiled.memory_analysis()`): the arguments
(parameters, optimizer state, batch), the outputs (allocated before the step runs, so
they count for its whole duration, except where a donated argument's buffer is reused
for an output of the same shape and dtype: `donate_argnums`), and one arena for every
temporary, as large as the most temporaries live at once. The peak is their sum:

    memory_peak = arguments + outputs - aliased + max over ops of live temporaries

A *buffer* is a value together with its aliases: the values a link op only renames (a
call's argument and the body's invar, a loop carry going round) and the views a reshape
makes of it (see `_fusion`). Values XLA never materializes (dead code, broadcasts,
iotas and what is made from them alone) are no buffer: they cost nothing, and the
buffers they are re-derived from stay live for as long as they are read. A temporary
(an activation kept for the backward pass, a gradient) lives from the op that makes it
to the last op that reads it or any of its aliases; a value resharded for its readers
(an all-gathered parameter, an all-to-all'd activation) is a temporary of its own in the
readers' layout, from the first reader to the last, since XLA moves it once and keeps
the result (`CostModel` passes these); a reduce-scatter or a slice after an op needs the
op's whole result for a moment, and a reduce-scatter on a backend without one (an
all-reduce and a slice, which XLA fuses into the value's elementwise readers) until the
last of those (`fused_reads_end`).

Scheduling assumption: ops run in lift order, which is JAX's order (the forward pass,
the backward pass in reverse, the optimizer update), with a loop body's ops in line,
once: a body's temporaries count once, not per iteration. XLA's scheduler may reorder
independent ops to lower the peak; on train steps the peak is where the forward pass has
left every residual live, which no order avoids, and `tests/test_cost.py` holds the
model to `compiled.memory_analysis()` on the examples. On a backend that schedules
breadth first (XLA:CPU) the one exception the model makes is the moves: a value is
moved for its readers as soon as it is made (`_moves.MoveBuffers` starts those
buffers there).
The arena is assumed packed without gaps (XLA's best-fit packing can leave a few
percent). A buffer's bytes per
device are its largest member's shard.
"""

from __future__ import annotations

import numpy as np

from partir import Link, UnionFind

from ._arena import arena
from ._fusion import op_traits, view_pairs

#: Buffer kinds: a temporary (in the arena), an argument, an output's allocation.
TEMPORARY, ARGUMENT, OUTPUT = 0, 1, 2

#: Link kinds that make a new buffer rather than rename one: none. Every link renames,
#: a scan's stacked links included: an iteration reads its slice of a stacked input in
#: place (XLA fuses the dynamic slice into its readers) and writes its slice of a stacked
#: output in place (a dynamic-update-slice into the stack, allocated before the loop), as
#: an unrolled layer reads and writes its own buffers.
COPYING_LINKS = ()


def backward_reads(program) -> np.ndarray:
    """Per op, does it read for the backward pass: a backward op, or a link that carries
    a value to one (a residual passed into a call the backward pass makes, such as the
    derivative of `jax.nn.silu`). `Program.backward` leaves links out."""
    out = np.array(program.backward, dtype=bool)
    for o in range(len(program.ops) - 1, -1, -1):  # a link's readers come after it
        op = program.ops[o]
        if op.link:
            out[o] = any(out[u] for r in op.results if r >= 0 for u in program.users[r])
    return out


class Liveness:
    """Static buffer structure of a program: `buffer[v]` per value (virtual values map to
    a buffer of no bytes), and per buffer its live interval `[start, end]` in op indices
    (the end index `len(ops)` is "after the last op")."""

    def __init__(self, program, materialization, donated_args=(), *, forward_only=frozenset(), extend=None):
        mat = materialization
        self.virtual = mat.virtual
        n = len(program.values)
        sets = UnionFind(n)
        pairs = [(op.operands[0], op.results[0]) for op in program.ops
                 if op.link and op.primitive not in COPYING_LINKS]
        for a, b in pairs + view_pairs(program, mat.virtual) + _donations(program, set(donated_args)):
            sets.union(a, b)
        self.buffer = np.array(sets.labels(), dtype=np.int64)
        self.num_buffers = int(self.buffer.max(initial=-1)) + 1
        self.length = len(program.ops) + 1
        self.start, self.end = self._intervals(program, mat, forward_only)
        for v, until in (extend or {}).items():  # kept to recompute from
            b = self.buffer[v]
            if self.kind[b] == TEMPORARY:
                self.end[b] = max(self.end[b], until)

    def _intervals(self, program, mat, forward_only):
        """Live intervals of the temporaries; arguments and outputs are held for the whole
        step (`kind` 1 and 2), an output being first written at `defined`."""
        nb, end_of_program = self.num_buffers, len(program.ops)
        start = np.full(nb, end_of_program, dtype=np.int64)
        end = np.zeros(nb, dtype=np.int64)
        loops = _Loops(program)
        backward = program.analysis(backward_reads)
        cut = {int(self.buffer[v]) for v in forward_only}
        # A fused value recomputed for the backward pass is re-derived there from what the
        # recomputation keeps: what it is made of stays live for its forward reads only.
        stopped = {v for v in forward_only if mat.virtual[v]}
        last = last_reads(program, mat, stop=(backward, stopped) if stopped else None)
        home = np.zeros(nb, dtype=np.int64)  # the region of a buffer's first member
        for v in range(len(program.values)):
            if mat.virtual[v]:
                continue
            p, users, b = program.producer[v], program.users[v], self.buffer[v]
            first = p if p >= 0 else (users[0] if users else 0)
            if first < start[b]:
                start[b], home[b] = first, program.values[v].region
        for v in range(len(program.values)):
            if mat.virtual[v]:
                for s in mat.sources.get(v, ()):  # re-derived where read: its sources stay live
                    if self.buffer[s] in cut and backward[last[v]]:
                        continue  # re-derived from the recomputed copy
                    end[self.buffer[s]] = max(end[self.buffer[s]], last[v])
                continue
            users, b = program.users[v], self.buffer[v]
            if b in cut:  # recomputed for the backward pass: freed after the forward's reads
                users = [u for u in users if not backward[u]]
            if users:
                end[b] = max(end[b], loops.last_read(int(home[b]), users))
        self.kind = np.zeros(nb, dtype=np.int8)
        self.kind[self.buffer[[v for v in program.outputs if v >= 0]]] = OUTPUT
        self.kind[self.buffer[list(program.inputs)]] = ARGUMENT
        self.defined = start.copy()
        held = self.kind > 0
        start[held], end[held] = 0, end_of_program
        return start, np.maximum(end, start)

    def peak(self, value_bytes: np.ndarray, extra=None, *, exact: bool = False,
             hostable=None) -> tuple[float, int, np.ndarray]:
        """(peak bytes, op index where the most temporaries are live, bytes of every
        buffer) for per-device `value_bytes` (one entry per value), plus `extra`
        temporaries `(starts, ends, bytes)` (the reshard buffers of the current
        partitioning), numbered after the static ones.

        The peak is arguments + outputs + the temporaries' arena: with `exact`, as XLA
        assigns them (`_arena`); else a fast estimate, the most temporaries live at once
        beyond what the output allocations not yet written can hold."""
        buf = np.zeros(self.num_buffers)
        np.maximum.at(buf, self.buffer, np.where(self.virtual, 0.0, value_bytes))
        temp = np.where(self.kind == TEMPORARY, buf, 0.0)
        delta = np.zeros(self.length + 1)
        np.add.at(delta, self.start, temp)
        np.add.at(delta, self.end + 1, -temp)
        starts, ends, sizes = extra if extra is not None else (np.zeros(0, np.int64),) * 2 + (np.zeros(0),)
        np.add.at(delta, starts, sizes)
        np.add.at(delta, ends + 1, -sizes)
        live = np.cumsum(delta[:-1])
        t = int(np.argmax(live))
        held = float(buf[self.kind > 0].sum())
        if exact:
            temps = np.nonzero(temp > 0)[0]
            outs = np.nonzero(self.kind == OUTPUT)[0]
            size = arena(np.concatenate([self.start[temps], starts]), np.concatenate([self.end[temps], ends]),
                         np.concatenate([temp[temps], sizes]), self.defined[outs], buf[outs],
                         None if hostable is None else np.concatenate([np.ones(len(temps), bool), hostable]))
        else:
            size = float(np.max(live - self._unwritten(buf), initial=0.0))
        return float(held + size), t, np.concatenate([buf, sizes])

    def _unwritten(self, buf) -> np.ndarray:
        """Per op index, the bytes of output allocations not written yet, which can hold
        temporaries (the fast estimate assumes they fit there perfectly)."""
        outs = self.kind == OUTPUT
        delta = np.zeros(self.length + 1)
        delta[0] = buf[outs].sum()
        np.add.at(delta, self.defined[outs], -buf[outs])
        return np.cumsum(delta[:-1])

    def live_at(self, t: int, extra=None) -> np.ndarray:
        """Indices of the buffers live at op index `t` (extra buffers numbered after the
        static ones, as `peak` returns them)."""
        static = np.nonzero((self.start <= t) & (self.end >= t))[0]
        if extra is None or not len(extra[0]):
            return static
        more = np.nonzero((extra[0] <= t) & (extra[1] >= t))[0] + self.num_buffers
        return np.concatenate([static, more])


class _Loops:
    """Where a read inside a loop really ends: a loop body's ops are in line once, but a
    buffer made outside the loop and read inside it (a stacked residual, a loop
    constant) is read by every iteration, so it lives until the loop's last op."""

    def __init__(self, program):
        self.regions = program.regions
        self.region_of = [op.region for op in program.ops]
        self.end = [0] * len(program.regions)
        for op in program.ops:
            r = op.region
            while r >= 0:
                self.end[r] = max(self.end[r], op.id)
                r = program.regions[r].parent

    def _loop(self, r: int) -> bool:
        return self.regions[r].trip_count != 1

    def _inside(self, r: int, outer: int) -> bool:
        while r >= 0:
            if r == outer:
                return True
            r = self.regions[r].parent
        return False

    def last_read(self, home: int, users) -> int:
        """The last op index at which a value of region `home` read by `users` is needed."""
        last = users[-1]
        for o in users:
            r, loop = self.region_of[o], None
            while r >= 0 and not self._inside(home, r):
                if self._loop(r):
                    loop = r
                r = self.regions[r].parent
            if loop is not None:
                last = max(last, self.end[loop])
        return last


def _donations(program, donated: set) -> list[tuple[int, int]]:
    """(input, output) pairs whose buffers XLA shares: each input of a donated argument
    with the first output of its shape and dtype not taken yet, as JAX pairs them."""
    free: dict = {}
    for o in program.outputs:
        if o >= 0:
            free.setdefault((program.values[o].shape, str(program.values[o].dtype)), []).append(o)
    pairs = []
    for v, arg in zip(program.inputs, program.input_args):
        if arg in donated:
            outs = free.get((program.values[v].shape, str(program.values[v].dtype)))
            if outs:
                pairs.append((v, outs.pop(0)))
    return pairs


def fused_reads_end(program, mat) -> np.ndarray:
    """Per value, the last op that reads it inside a fusion (an elementwise op, a
    reduction, a broadcast, or a consumer they are fused into), -1 if none. A backend
    that makes a value whole and slices it (XLA:CPU's all-reduce and dynamic slice for a
    reduce-scatter) fuses the slice into such readers, which then read the whole
    buffer: it lives until this op."""
    last = last_reads(program, mat)
    out = np.full(len(program.values), -1, dtype=np.int64)
    for op in program.ops:
        if op.link or not op_traits(op).fusion.fuses_producers or not mat.live_op[op.id]:
            continue
        results = [r for r in op.results if r >= 0]
        when = max(last[r] for r in results) if results and all(mat.virtual[r] for r in results) else op.id
        for v in op.operands:
            if v >= 0:
                out[v] = max(out[v], when)
    return out


def last_reads(program, mat, stop=None) -> np.ndarray:
    """Per virtual value, the last op that reads it, following it through the virtual
    values made from it (a broadcast of a broadcast, a call's argument). `stop` is
    (per op: does it read for the backward pass, values): reads of those values by
    such ops do not count (the backward pass reads a recomputed copy of them)."""
    last = np.zeros(len(program.values), dtype=np.int64)
    late, stopped = stop if stop is not None else (None, ())
    for op in reversed(program.ops):
        if not mat.live_op[op.id]:
            continue
        results = [r for r in op.results if r >= 0]
        fused = bool(results) and all(mat.virtual[r] for r in results)
        when = max((last[r] for r in results), default=op.id) if fused else op.id
        for v in op.operands:
            if v >= 0 and mat.virtual[v] and not (v in stopped and late[op.id]):
                last[v] = max(last[v], when)
    return last
