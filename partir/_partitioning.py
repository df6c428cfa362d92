"""A partitioning of a program: tilings of every value, decided by actions and
completed by propagation.

State: each value has an at-rest `Tiling`; each op has a *factor tiling*, the mesh axes
of each of its rule's factors, i.e. how the op itself is computed. Both only ever grow.

Propagation is a worklist fixpoint. When a value changes, each op touching it merges
the value's tiling into its factor tiling (projecting dims onto factors), then pushes
the factor tiling back onto all its values. A proposal that disagrees with what is
already there loses: the earlier decision wins, so the schedule order is the priority.
The loser is not dropped silently: wherever a value's tiling differs from what an op
computes with, `reshards()` reports a reshard point (and, for split reduction factors,
a reduction point), which the cost model charges and the lowering realises.

Undo is a log of old entries (`mark`/`rollback`), so search can explore and back out
cheaply; `key()` is an incrementally maintained hash of the whole state.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ._errors import PartitioningError
from ._ir import Program
from ._mesh import MeshSpec
from ._tiling import Tiling


@dataclass(frozen=True, slots=True)
class Decision:
    """One action taken on a partitioning, with who took it (a tactic name or 'user')."""

    action: str
    value: int
    dim: int | None
    axis: str | None
    source: str


@dataclass(frozen=True, slots=True)
class Reshard:
    """A point where a value must change layout: before op `op` consumes it (`side` ==
    'operand') or after `op` produces it (`side` == 'result'; `src` may be partial)."""

    op: int
    value: int
    side: str
    index: int
    src: Tiling
    dst: Tiling


class Partitioning:
    """Tilings for every value of `program` on `mesh`, changed only by `tile` and
    `replicate` actions (each followed by propagation)."""

    def __init__(self, program: Program, mesh: MeshSpec):
        self.program = program
        self.mesh = mesh
        self._msize = mesh.sizes()
        self._t: list[Tiling] = [Tiling.replicated(v.rank) for v in program.values]
        empty: dict[int, tuple] = {}
        self._f: list[tuple] = [empty.setdefault(op.rule.num_factors, ((),) * op.rule.num_factors) for op in program.ops]
        self._pinned = bytearray(len(program.values))
        self._inq = bytearray(len(program.ops))
        self._blocked: dict[int, frozenset] = {}
        self._log: list[tuple] = []
        self._decisions: list[Decision] = []
        self._hash = 0

    # -- reading -----------------------------------------------------------------------
    def tiling(self, value) -> Tiling:
        """The at-rest tiling of a value (id, `Value` or name)."""
        return self._t[self.program.resolve(value)]

    def factor_tiling(self, op: int) -> tuple[tuple[str, ...], ...]:
        """Mesh axes of each factor of op `op`'s rule: how the op is computed."""
        return self._f[op]

    def is_pinned(self, value) -> bool:
        """True when `replicate` fixed the value's tiling."""
        return bool(self._pinned[self.program.resolve(value)])

    @property
    def decisions(self) -> tuple[Decision, ...]:
        """The actions taken so far, in order."""
        return tuple(self._decisions)

    def key(self) -> int:
        """A hash of the whole state (tilings, pins, factor tilings), kept incrementally."""
        return self._hash

    def required(self, op: int, slot: int) -> Tiling:
        """The tiling op `op` computes its `slot`-th slot with (operands first, results
        after; only values of rank > 0 have slots)."""
        o = self.program.ops[op]
        _, spec = o.slots[slot]
        return Tiling(self._project(self._f[op], spec, o.rule.sizes))

    def produced(self, value) -> Tiling:
        """The tiling a value has as its producer computes it: partial over the axes of
        any split reduction factor of that op."""
        v = self.program.resolve(value)
        oid = self.program.producer[v]
        if oid < 0:
            return self._t[v]
        op = self.program.ops[oid]
        k = op.results.index(v)
        F = self._f[oid]
        dims = self._project(F, op.rule.results[k], op.rule.sizes)
        return Tiling(dims, self._partial_axes(op, F), op.rule.reduce_kind)

    def reshards(self, ops=None) -> list[Reshard]:
        """Every reshard and reduction point (of the given ops, or of all), in op order."""
        out = []
        prog = self.program
        for oid in range(len(prog.ops)) if ops is None else sorted(ops):
            op = prog.ops[oid]
            F = self._f[oid]
            partial = self._partial_axes(op, F)
            sizes = op.rule.sizes
            for k, (v, spec) in enumerate(zip(op.operands, op.rule.operands)):
                if v >= 0 and spec:
                    want = Tiling(self._project(F, spec, sizes))
                    if want != self._t[v]:
                        out.append(Reshard(oid, v, "operand", k, self._t[v], want))
            for k, (v, spec) in enumerate(zip(op.results, op.rule.results)):
                if v >= 0 and (spec or partial):
                    made = Tiling(self._project(F, spec, sizes), partial, op.rule.reduce_kind)
                    if made != self._t[v]:
                        out.append(Reshard(oid, v, "result", k, made, self._t[v]))
        return out

    # -- actions -----------------------------------------------------------------------
    def tile(self, value, dim: int, axis: str, *, source: str = "user") -> None:
        """Split `dim` of `value` over mesh `axis` (minor to any axes already on that dim),
        then propagate. A no-op when `axis` already splits that dim (e.g. by propagation).
        Raises `PartitioningError`, changing nothing, when it cannot."""
        prog = self.program
        v = prog.resolve(value)
        val = prog.values[v]
        name = prog.name(v)
        size = self.mesh.size(axis)
        if not -val.rank <= dim < val.rank:
            raise PartitioningError(f"cannot tile {name}: dim {dim} is out of range for shape {val.shape}")
        dim %= val.rank
        t = self._t[v]
        if self._pinned[v]:
            raise PartitioningError(f"cannot tile {name}: it was pinned replicated by an earlier decision")
        if axis in t.dims[dim]:
            return
        if axis in t.axes():
            raise PartitioningError(f"cannot tile {name} dim {dim} over {axis!r}: its tiling {t} already uses that axis")
        k = size
        for a in t.dims[dim]:
            k *= self._msize[a]
        if val.shape[dim] % k:
            raise PartitioningError(
                f"cannot tile {name} dim {dim} (size {val.shape[dim]}) over {axis!r}: {k} devices do not divide it; "
                "pick a dim whose size the axis divides"
            )
        mark = self.mark()
        try:
            dims = list(t.dims)
            dims[dim] = dims[dim] + (axis,)
            self._set(v, Tiling(tuple(dims)))
            self._decide(Decision("tile", v, dim, axis, source))
            self._propagate(v)
        except BaseException:
            self.rollback(mark)
            raise

    def replicate(self, value, *, source: str = "user") -> None:
        """Pin `value` replicated: propagation will not split it, and ops that want it split
        reshard it instead."""
        v = self.program.resolve(value)
        t = self._t[v]
        if not t.is_replicated:
            raise PartitioningError(
                f"cannot replicate {self.program.name(v)}: it is already tiled {t}; "
                "replicate it before the decisions that split it"
            )
        if not self._pinned[v]:
            self._hash ^= self._contrib(v)
            self._log.append(("p", v))
            self._pinned[v] = 1
            self._hash ^= self._contrib(v)
        self._decide(Decision("replicate", v, None, None, source))

    def mark(self) -> int:
        """A point to `rollback` to."""
        return len(self._log)

    def rollback(self, mark: int) -> None:
        """Undo every change made since `mark`."""
        log = self._log
        while len(log) > mark:
            entry = log.pop()
            kind = entry[0]
            if kind == "t":
                _, v, old = entry
                self._hash ^= self._contrib(v)
                self._t[v] = old
                self._hash ^= self._contrib(v)
            elif kind == "f":
                _, o, old = entry
                self._hash ^= self._fcontrib(o)
                self._f[o] = old
                self._hash ^= self._fcontrib(o)
            elif kind == "p":
                v = entry[1]
                self._hash ^= self._contrib(v)
                self._pinned[v] = 0
                self._hash ^= self._contrib(v)
            else:
                self._decisions.pop()

    def changed_since(self, mark: int) -> tuple[set[int], set[int]]:
        """(values, ops) whose tilings changed since `mark`."""
        vals, ops = set(), set()
        for entry in self._log[mark:]:
            if entry[0] in ("t", "p"):
                vals.add(entry[1])
            elif entry[0] == "f":
                ops.add(entry[1])
        return vals, ops

    def copy(self) -> "Partitioning":
        """An independent copy (the undo log is not carried over)."""
        c = Partitioning.__new__(Partitioning)
        c.program, c.mesh, c._msize = self.program, self.mesh, self._msize
        c._t, c._f = list(self._t), list(self._f)
        c._pinned, c._inq = bytearray(self._pinned), bytearray(len(self._inq))
        c._blocked, c._log, c._decisions, c._hash = self._blocked, [], list(self._decisions), self._hash
        return c

    # -- internals ---------------------------------------------------------------------
    def _contrib(self, v: int) -> int:
        t = self._t[v]
        return hash((v, t, self._pinned[v])) if (self._pinned[v] or not t.is_replicated) else 0

    def _fcontrib(self, o: int) -> int:
        F = self._f[o]
        return hash(("f", o, F)) if any(F) else 0

    def _set(self, v: int, t: Tiling) -> None:
        self._hash ^= self._contrib(v)
        self._log.append(("t", v, self._t[v]))
        self._t[v] = t
        self._hash ^= self._contrib(v)

    def _decide(self, d: Decision) -> None:
        self._decisions.append(d)
        self._log.append(("d",))

    def _blocked_of(self, rule) -> frozenset:
        b = self._blocked.get(id(rule))
        if b is None:
            b = self._blocked[id(rule)] = frozenset(rule.blocked)
        return b

    def _partial_axes(self, op, F) -> tuple[str, ...]:
        if not op.rule.reduction:
            return ()
        axes = {a for f in op.rule.reduction for a in F[f]}
        return tuple(a for a in self.mesh.names if a in axes)

    def _project(self, F, spec, sizes) -> tuple[tuple[str, ...], ...]:
        # Factor tilings -> dim tilings. A dim made of several factors can only carry the
        # minor factors' axes when the major ones are split all the way.
        ms = self._msize
        out = []
        for fs in spec:
            if len(fs) == 1:
                out.append(F[fs[0]])
                continue
            axes = ()
            for f in fs:
                ax = F[f]
                axes += ax
                k = 1
                for a in ax:
                    k *= ms[a]
                if k != sizes[f]:
                    break
            out.append(axes)
        return tuple(out)

    def _split(self, axes, fs, sizes, blocked):
        # Dim tiling -> proposals per factor, major factor first; stops where an axis does
        # not divide what is left of a factor (that layout has no factor form).
        ms = self._msize
        out = []
        i = 0
        for f in fs:
            size, prod, start = sizes[f], 1, i
            while i < len(axes) and size % (prod * ms[axes[i]]) == 0:
                prod *= ms[axes[i]]
                i += 1
            if i > start:
                if f in blocked:
                    break
                out.append((f, axes[start:i]))
            if prod != size or i == len(axes):
                break
        return out

    def _propagate(self, v: int) -> None:
        prog = self.program
        value_ops = prog.value_ops
        inq = self._inq
        queue = deque()
        for o in value_ops[v]:
            inq[o] = 1
            queue.append(o)
        while queue:
            o = queue.popleft()
            inq[o] = 0
            for w in self._process(o):
                for o2 in value_ops[w]:
                    if o2 != o and not inq[o2]:
                        inq[o2] = 1
                        queue.append(o2)

    def _process(self, oid: int) -> list[int]:
        op = self.program.ops[oid]
        rule = op.rule
        sizes = rule.sizes
        blocked = self._blocked_of(rule)
        ms = self._msize
        T = self._t
        F = self._f[oid]
        new = None
        used = None
        # 1. Pull: merge every value's dim tilings into the op's factor tiling.
        for vid, spec in op.slots:
            dims = T[vid].dims
            for d in range(len(spec)):
                axes = dims[d]
                if not axes:
                    continue
                fs = spec[d]
                if len(fs) == 1:
                    f = fs[0]
                    if f in blocked or (new or F)[f] == axes:
                        continue
                    props = ((f, axes),)
                else:
                    props = self._split(axes, fs, sizes, blocked)
                for f, ax in props:
                    cur = (new or F)[f]
                    n = len(cur)
                    if len(ax) <= n or ax[:n] != cur:
                        continue  # already there, or a conflict: the earlier tiling wins
                    if used is None:
                        used = {a for fa in F for a in fa}
                    add = ax[n:]
                    if any(a in used for a in add):
                        continue  # the axis already splits another factor of this op
                    k = 1
                    for a in ax:
                        k *= ms[a]
                    if sizes[f] % k:
                        continue
                    if new is None:
                        new = list(F)
                    new[f] = ax
                    used.update(add)
        if new is None:
            return []
        self._hash ^= self._fcontrib(oid)
        self._log.append(("f", oid, F))
        F = self._f[oid] = tuple(new)
        self._hash ^= self._fcontrib(oid)
        # 2. Push: grow every value toward the op's factor tiling where compatible.
        changed = []
        pinned = self._pinned
        for vid, spec in op.slots:
            if pinned[vid]:
                continue
            t = T[vid]
            want = self._project(F, spec, sizes)
            dims = None
            for d, w in enumerate(want):
                cur = (dims or t.dims)[d]
                n = len(cur)
                if len(w) <= n or w[:n] != cur:
                    continue
                taken = {a for dd in (dims or t.dims) for a in dd}
                if any(a in taken for a in w[n:]):
                    continue
                if dims is None:
                    dims = list(t.dims)
                dims[d] = w
            if dims is not None:
                self._set(vid, Tiling(tuple(dims)))
                changed.append(vid)
        return changed
