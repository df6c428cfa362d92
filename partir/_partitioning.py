"""A partitioning of a program: tilings of every value, decided by actions and
completed by propagation.

State: each value has an at-rest `Tiling`; each op has a *factor tiling*, the mesh axes
of each of its rule's factors, i.e. how the op itself is computed. Both only ever grow.

Values that must share a tiling (`partir._classes`) are tiled as one class.
Propagation is a worklist fixpoint over the non-trivial ops. When a class changes, each
op touching it merges the class's tiling into its factor tiling (projecting dims onto
factors), then pushes the factor tiling back onto all its classes. A proposal that disagrees with what is
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
from ._ir import Program, no_gc
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
        self._cls = program.classes
        self._of = self._cls.of
        # Dim tilings of each class as plain tuples (axes per dim): the propagator's hot data.
        self._d: list[tuple] = [((),) * program.values[m[0]].rank for m in self._cls.members]
        empty: dict[int, tuple] = {}
        self._f: list[tuple] = [empty.setdefault(op.rule.num_factors, ((),) * op.rule.num_factors) for op in program.ops]
        self._pinned = bytearray(len(self._cls))
        self._inq = bytearray(len(program.ops))
        self._log: list[tuple] = []
        self._decisions: list[Decision] = []
        self._hash = 0

    # -- reading -----------------------------------------------------------------------
    def tiling(self, value) -> Tiling:
        """The at-rest tiling of a value (id, `Value` or name)."""
        return Tiling(self._d[self._of[self.program.resolve(value)]])

    def factor_tiling(self, op: int) -> tuple[tuple[str, ...], ...]:
        """Mesh axes of each factor of op `op`'s rule: how the op is computed."""
        if not self._cls.trivial[op]:
            return self._f[op]
        F = list(self._f[op])
        for c, d, f in self._cls.single[op]:
            F[f] = self._d[c][d]
        return tuple(F)

    def is_pinned(self, value) -> bool:
        """True when `replicate` fixed the value's tiling (and its class's)."""
        return bool(self._pinned[self._of[self.program.resolve(value)]])

    @property
    def decisions(self) -> tuple[Decision, ...]:
        """The actions taken so far, in order."""
        return tuple(self._decisions)

    def key(self) -> int:
        """A hash of the whole state (tilings, pins, factor tilings), kept incrementally."""
        return self._hash

    def required(self, op: int, operand: int) -> Tiling:
        """The tiling op `op` computes with for its `operand`-th operand."""
        o = self.program.ops[op]
        return Tiling(self._project(self.factor_tiling(op), o.rule.operands[operand], o.rule.sizes))

    def produced(self, value) -> Tiling:
        """The tiling a value has as its producer computes it: partial over the axes of
        any split reduction factor of that op."""
        v = self.program.resolve(value)
        oid = self.program.producer[v]
        if oid < 0:
            return Tiling(self._d[self._of[v]])
        op = self.program.ops[oid]
        k = op.results.index(v)
        F = self.factor_tiling(oid)
        dims = self._project(F, op.rule.results[k], op.rule.sizes)
        return Tiling(dims, self._partial_axes(op, F), op.rule.reduce_kind)

    def reshards(self, ops=None) -> list[Reshard]:
        """Every reshard and reduction point (of the given ops, or of all), in op order."""
        out = []
        prog = self.program
        D = self._d
        of = self._of
        trivial = self._cls.trivial
        for oid in range(len(prog.ops)) if ops is None else sorted(ops):
            if trivial[oid]:
                continue
            op = prog.ops[oid]
            F = self._f[oid]
            partial = self._partial_axes(op, F)
            sizes = op.rule.sizes
            for k, (v, spec) in enumerate(zip(op.operands, op.rule.operands)):
                if v >= 0 and spec:
                    want = self._project(F, spec, sizes)
                    if want != D[of[v]]:
                        out.append(Reshard(oid, v, "operand", k, Tiling(D[of[v]]), Tiling(want)))
            for k, (v, spec) in enumerate(zip(op.results, op.rule.results)):
                if v >= 0 and (spec or partial):
                    made = self._project(F, spec, sizes)
                    if made != D[of[v]] or partial:
                        out.append(Reshard(oid, v, "result", k, Tiling(made, partial, op.rule.reduce_kind),
                                           Tiling(D[of[v]])))
        return out

    # -- actions -----------------------------------------------------------------------
    def tile(self, value, dim: int, axis: str, *, source: str = "user") -> None:
        """Split `dim` of `value` over mesh `axis` (minor to any axes already on that dim),
        then propagate. A no-op when `axis` already splits that dim (e.g. by propagation).
        Raises `PartitioningError`, changing nothing, when it cannot."""
        prog = self.program
        v = prog.resolve(value)
        val = prog.values[v]
        size = self.mesh.size(axis)
        if not -val.rank <= dim < val.rank:
            raise PartitioningError(f"cannot tile {prog.name(v)}: dim {dim} is out of range for shape {val.shape}")
        dim %= val.rank
        c = self._of[v]
        dims = self._d[c]
        if axis in dims[dim]:
            return
        if self._pinned[c]:
            raise PartitioningError(f"cannot tile {prog.name(v)}: it was pinned replicated by an earlier decision")
        if any(axis in d for d in dims):
            raise PartitioningError(
                f"cannot tile {prog.name(v)} dim {dim} over {axis!r}: its tiling {Tiling(dims)} already uses that axis")
        k = size
        for a in dims[dim]:
            k *= self._msize[a]
        if val.shape[dim] % k:
            raise PartitioningError(
                f"cannot tile {prog.name(v)} dim {dim} (size {val.shape[dim]}) over {axis!r}: {k} devices do not "
                "divide it; pick a dim whose size the axis divides"
            )
        mark = self.mark()
        try:
            new = list(dims)
            new[dim] = dims[dim] + (axis,)
            self._set(c, tuple(new))
            self._decide(Decision("tile", v, dim, axis, source))
            with no_gc():
                self._propagate(c)
        except BaseException:
            self.rollback(mark)
            raise

    def replicate(self, value, *, source: str = "user") -> None:
        """Pin `value` replicated: propagation will not split it, and ops that want it split
        reshard it instead."""
        v = self.program.resolve(value)
        c = self._of[v]
        if any(self._d[c]):
            raise PartitioningError(
                f"cannot replicate {self.program.name(v)}: it is already tiled {Tiling(self._d[c])}; "
                "replicate it before the decisions that split it"
            )
        if not self._pinned[c]:
            self._log.append((_PIN, c))
            self._pinned[c] = 1
            self._hash ^= hash((_PIN, c))
        self._decide(Decision("replicate", v, None, None, source))

    def mark(self) -> int:
        """A point to `rollback` to."""
        return len(self._log)

    def rollback(self, mark: int) -> None:
        """Undo every change made since `mark`."""
        log, D, Fs = self._log, self._d, self._f
        h = self._hash
        while len(log) > mark:
            entry = log.pop()
            kind = entry[0]
            if kind == _VAL:
                _, v, old = entry
                h ^= _vhash(v, D[v]) ^ _vhash(v, old)
                D[v] = old
            elif kind == _FAC:
                _, o, old = entry
                h ^= _fhash(o, Fs[o]) ^ _fhash(o, old)
                Fs[o] = old
            elif kind == _PIN:
                self._pinned[entry[1]] = 0
                h ^= hash((_PIN, entry[1]))
            else:
                self._decisions.pop()
        self._hash = h

    def changed_since(self, mark: int) -> tuple[set[int], set[int]]:
        """(values, ops) whose tilings changed since `mark`: values of changed classes;
        ops whose factor tiling changed, including trivial ops of changed classes."""
        classes, ops = set(), set()
        for entry in self._log[mark:]:
            if entry[0] in (_VAL, _PIN):
                classes.add(entry[1])
            elif entry[0] == _FAC:
                ops.add(entry[1])
        vals = {v for c in classes for v in self._cls.members[c]}
        trivial = self._cls.trivial
        value_ops = self.program.value_ops
        ops.update(o for v in vals for o in value_ops[v] if trivial[o])
        return vals, ops

    def copy(self) -> "Partitioning":
        """An independent copy (the undo log is not carried over)."""
        c = Partitioning.__new__(Partitioning)
        c.program, c.mesh, c._msize = self.program, self.mesh, self._msize
        c._d, c._f = list(self._d), list(self._f)
        c._pinned, c._inq = bytearray(self._pinned), bytearray(len(self._inq))
        c._log, c._decisions, c._hash = [], list(self._decisions), self._hash
        return c

    # -- internals ---------------------------------------------------------------------
    def _set(self, v: int, dims: tuple) -> None:
        old = self._d[v]
        self._hash ^= _vhash(v, old) ^ _vhash(v, dims)
        self._log.append((_VAL, v, old))
        self._d[v] = dims

    def _decide(self, d: Decision) -> None:
        self._decisions.append(d)
        self._log.append((_DEC,))

    def _partial_axes(self, op, F) -> tuple[str, ...]:
        if not op.rule.reduction:
            return ()
        axes = {a for f in op.rule.reduction for a in F[f]}
        return tuple(a for a in self.mesh.names if a in axes)

    def _project(self, F, spec, sizes) -> tuple[tuple[str, ...], ...]:
        # Factor tilings -> dim tilings. A dim made of several factors can only carry the
        # minor factors' axes when the major ones are split all the way.
        out = []
        for fs in spec:
            out.append(F[fs[0]] if len(fs) == 1 else self._join(F, fs, sizes) if fs else ())
        return tuple(out)

    def _join(self, F, fs, sizes) -> tuple[str, ...]:
        ms = self._msize
        axes = ()
        for f in fs:
            ax = F[f]
            axes += ax
            k = 1
            for a in ax:
                k *= ms[a]
            if k != sizes[f]:
                break
        return axes

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

    def _propagate(self, c: int) -> None:
        value_ops = self._cls.ops
        inq = self._inq
        queue = deque(value_ops[c])
        for o in queue:
            inq[o] = 1
        process = self._process
        while queue:
            o = queue.popleft()
            inq[o] = 0
            for w in process(o):
                for o2 in value_ops[w]:
                    if not inq[o2] and o2 != o:
                        inq[o2] = 1
                        queue.append(o2)

    def _process(self, oid: int) -> list[int]:
        op = self.program.ops[oid]
        single, multi = self._cls.single[oid], self._cls.multi[oid]
        D = self._d
        F = self._f[oid]
        new = None
        # 1. Pull: merge every class's dim tilings into the op's factor tiling; a proposal
        # that disagrees with what is there loses (the earlier tiling wins).
        for vid, d, f in single:
            axes = D[vid][d]
            if not axes:
                continue
            cur = (new or F)[f]
            if cur == axes:
                continue
            n = len(cur)
            if len(axes) <= n or axes[:n] != cur:
                continue
            new = self._grow(new, F, f, axes, n, op.rule.sizes)
        for vid, d, fs in multi:
            axes = D[vid][d]
            if axes:
                for f, ax in self._split(axes, fs, op.rule.sizes, op.rule.blocked):
                    cur = (new or F)[f]
                    n = len(cur)
                    if len(ax) > n and ax[:n] == cur:
                        new = self._grow(new, F, f, ax, n, op.rule.sizes)
        if new is None:
            return []
        new = tuple(new)
        self._hash ^= _fhash(oid, F) ^ _fhash(oid, new)
        self._log.append((_FAC, oid, F))
        F = self._f[oid] = new
        # 2. Push: grow every class toward the op's factor tiling where compatible.
        pinned = self._pinned
        pending: dict[int, list] = {}
        for vid, d, f in single:
            w = F[f]
            if w and not pinned[vid]:
                self._offer(pending, D, vid, d, w)
        for vid, d, fs in multi:
            if not pinned[vid]:
                w = self._join(F, fs, op.rule.sizes)
                if w:
                    self._offer(pending, D, vid, d, w)
        for vid, dims in pending.items():
            self._set(vid, tuple(dims))
        return list(pending)

    def _grow(self, new, F, f, axes, n, sizes):
        # Extend factor f to `axes` unless an added axis already splits another factor of
        # this op or the axes do not divide the factor.
        G = new or F
        add = axes[n:]
        for fa in G:
            for a in add:
                if a in fa:
                    return new
        k = 1
        ms = self._msize
        for a in axes:
            k *= ms[a]
        if sizes[f] % k:
            return new
        if new is None:
            new = list(F)
        new[f] = axes
        return new

    @staticmethod
    def _offer(pending, D, vid, d, w):
        dims = pending.get(vid) or D[vid]
        cur = dims[d]
        n = len(cur)
        if len(w) <= n or w[:n] != cur:
            return
        add = w[n:]
        for dd in dims:
            for a in add:
                if a in dd:
                    return
        if vid not in pending:
            dims = pending[vid] = list(dims)
        dims[d] = w


_VAL, _FAC, _PIN, _DEC = range(4)


def _vhash(v: int, dims: tuple) -> int:
    return hash((v, dims)) if any(dims) else 0


def _fhash(o: int, F: tuple) -> int:
    return hash((-1 - o, F)) if any(F) else 0
