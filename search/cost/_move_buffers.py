"""Where the buffers of moves live, and how many there are, on the device's backend.

A move (`CostModel`'s reshard buffers) is a value in the layout its readers want, or the
whole result of an op that is reduce-scattered or sliced after it. By default a move's
buffer lives from its first reader to its last, and the whole result for its op. XLA:CPU
differs in three ways, each a flag of the `DeviceSpec`:

- `reduce_scatter=False`: it all-reduces the whole value and fuses the slice into the
  value's elementwise readers, so the whole buffer lives until the last of them;
- `breadth_first=True`: it schedules every op as soon as its operands are ready (and
  drops optimization barriers before scheduling), so a value is moved as soon as it is
  made, a backward reader's move included;
- `gather_copies=True`: it gathers along a dim after the leading one with that dim major,
  then copies the result row-major once per way the reading dots contract it.
"""

from __future__ import annotations

from partir import Kind

from ._memory import fused_reads_end


class MoveBuffers:
    """Start, end and number of the buffers of one program's moves on one device."""

    def __init__(self, part, device, mat):
        self.part, self.program, self.device = part, part.program, device
        self.whole_until = None if device.reduce_scatter else fused_reads_end(self.program, mat)

    def start(self, key, v: int, first: int) -> int:
        """Where the buffer of move `key` of value `v`, first read by op `first`, starts:
        there, or, on a breadth-first backend, where the value is made (in the readers'
        loop body, else at the reader)."""
        if not self.device.breadth_first or key[0] != "read":
            return first
        prog = self.program
        p, region = prog.producer[v], prog.ops[first].region
        if p < 0:
            return 0 if region == 0 else first
        return min(first, p) if prog.ops[p].region == region else first

    def end(self, key, entry, end: int) -> int:
        """Where it ends: at `end`, but a value all-reduced whole and sliced (a
        reduce-scatter on a backend without one) lives until its last fused reader."""
        v, cols, _ = entry
        if self.whole_until is None or key[0] != "made" or not any(c.kind == Kind.ALL_REDUCE for c in cols):
            return end
        return max(end, int(self.whole_until[v]))

    def copies(self, key, v: int, readers) -> int:
        """How many buffers the move takes for its reader ops `readers`: one, or on a
        backend with `gather_copies`, one per way the reading dots contract a value
        gathered along a dim after the leading one (a weight gradient reads it
        transposed)."""
        if not self.device.gather_copies or key[0] != "read" or not self._gathered_inside(v, key[2]):
            return 1
        ways = set()
        for o in readers:
            op = self.program.ops[o]
            if op.primitive == "dot_general":
                (lc, rc), (lb, rb) = op.eqn.params["dimension_numbers"]
                ways.update(((lc, lb), (rc, rb))[k] for k, u in enumerate(op.operands[:2]) if u == v)
        return max(1, len(ways))

    def _gathered_inside(self, v: int, dst) -> bool:
        """Does moving `v` to `dst` gather along a dim after one of more than one element?"""
        part = self.part
        src, shape = part.class_tilings[part.classes.of[v]], self.program.values[v].shape
        local = [n // part.mesh.devices_along(axes) for n, axes in zip(shape, dst)]
        return any(set(a) - set(b) and any(n > 1 for n in local[:d]) for d, (a, b) in enumerate(zip(src, dst)))
