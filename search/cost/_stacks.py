"""How a scan's residuals are seen through its stacked outputs and inputs (`_fusion`):
a fused residual of the forward loop is re-derived in the backward loop from what it is
made of, as XLA does in unrolled code, so that one computation has one cost."""

from __future__ import annotations

import partir
from partir import Link, call_roots

#: Links through which XLA sees one computation: it inlines calls, so a value fuses
#: across a call's boundary as if the call were not there.
CALL_LINKS = frozenset((Link.CALL_IN, Link.CALL_OUT))

#: The links of a scan's stacked inputs and outputs. A residual of a scan body (a value
#: its forward loop stacks for the backward loop to slice) is seen through them, as if
#: the two loops were one computation: the model assumes that cheap residuals are
#: re-derived in the backward loop, as XLA does in unrolled code, so that one computation
#: has one cost (XLA today stacks them all: a scan may need more than modeled).
STACKS = frozenset((Link.SCAN_YS, Link.SCAN_XS))

#: A body value this many times smaller than a residual it helps re-derive is taken along
#: as it is (a norm's per-token statistics beside the normalized activations).
SMALL = 16


class Stacks:
    """How a scan's residuals are seen through its stacked outputs and inputs: a fused
    residual of the forward loop is re-derived in the backward loop from the slices of
    what it is made from, when the forward loop stacks all of that and the backward loop
    slices it (else the stack is a buffer, as XLA makes it)."""

    def __init__(self, program, carry: bool = False):
        self.program, self.carry = program, carry
        self.values, self.ops, self.producer = program.values, program.ops, program.producer
        self.carried: dict[int, list[int]] = {}  # forward body buffer -> the stacks re-derived from it
        self.stacked: dict[int, int] = {}  # forward body value -> its stacked output
        self.sliced: dict[tuple[int, int], int] = {}  # (stacked value, body) -> the slice
        self.readers: dict[int, list[int]] = {}  # stacked value -> bodies slicing it
        self.stacks: set[int] = set()  # the stacked outputs
        self.root = call_roots(program)  # one value across call boundaries
        for op in program.ops:
            if not op.link or op.operands[0] < 0 or op.results[0] < 0:
                continue
            a, b = op.operands[0], op.results[0]
            if op.primitive == Link.SCAN_YS:
                self.stacked[a] = b
                self.stacks.add(b)
            elif op.primitive == Link.SCAN_XS:
                body = program.values[b].region
                self.sliced[(a, body)] = b
                self.readers.setdefault(a, []).append(body)
        self.stacked_alias = {self.root[a]: a for a in self.stacked}

    def fused(self, op, virtual, scalar_made, sources):
        """(made from scalars, sources) if the stack or slice is fused, else None."""
        v = op.operands[0]
        if v < 0 or not virtual[v]:
            return None
        if op.primitive == Link.SCAN_YS:
            carried: list[int] = []
            outer = self._express(v, virtual, set(), self.values[v].nbytes, carried)
            bodies = self.readers.get(op.results[0], ())
            if outer is None or any((s, b) not in self.sliced for s in outer if s in self.stacks for b in bodies):
                return None
            for u in carried:
                self.carried.setdefault(u, []).append(op.results[0])
            return bool(scalar_made[v]), outer
        body = self.values[op.results[0]].region
        return bool(scalar_made[v]), tuple(self.sliced.get((s, body), s) for s in sources.get(v, ()))

    def _through_calls(self, u: int) -> int:
        """The stacked value among `u`'s aliases through call boundaries (a call's
        argument and result only rename a value), else `u`."""
        return self.stacked_alias.get(self.root[u], u)

    def _express(self, v, virtual, seen, nbytes, carried) -> tuple[int, ...] | None:
        """What a fused body value of `nbytes` can be re-derived from in the backward loop:
        the stacks of its operands, or of theirs where an operand is fused and not stacked
        itself, or a body value much smaller than it (a norm's statistics: its stack would
        cost next to nothing); None if some other operand is a buffer the loop does not
        stack, unless the loop may stack it for this (`carry`: then it is appended to
        `carried`)."""
        out: dict[int, None] = {}
        producer = self.producer[v]
        for u in self.ops[producer].operands if producer >= 0 else ():
            if u < 0 or not self.values[u].shape or u in seen:
                continue
            seen.add(u)
            u = self._through_calls(u)
            if u in self.stacked:
                out[self.stacked[u]] = None
            elif virtual[u] and self.producer[u] >= 0 and not self.ops[self.producer[u]].link:
                more = self._express(u, virtual, seen, nbytes, carried)
                if more is None:
                    return None
                out.update(dict.fromkeys(more))
            elif not virtual[u] and self.values[u].nbytes * SMALL <= nbytes:
                out[u] = None
            elif not virtual[u] and self.carry and self._loop_of(u) == self._loop_of(v) >= 0:
                carried.append(u)
                out[u] = None
            elif not virtual[u]:
                return None
        return tuple(out)

    def _loop_of(self, v: int) -> int:
        """The scan body `v` is made in (-1 outside every loop)."""
        return partir.scan_body_of(self.program, self.values[v].region)

    def carried_buffers(self, virtual) -> tuple:
        """`Materialization.carried` for the body buffers `_express` carried: each
        stacked once, for as long as the backward loops that read the stacks re-derived
        from it run (the stacks that stayed fused)."""
        out = []
        for u, stacks in sorted(self.carried.items()):
            stacks = tuple(st for st in stacks if virtual[st])
            bodies = {b for st in stacks for b in self.readers.get(st, ())}
            if not bodies:
                continue
            end = max(o.id for o in self.ops if partir.scan_body_of(self.program, o.region) in bodies)
            trips = self.program.regions[self._loop_of(u)].trip_count or 1
            if trips > 1:
                out.append((max(self.producer[u], 0), end, u, trips - 1, stacks))
        return tuple(out)
