"""The propagation engine of `Partitioning`: projecting tilings between values and op
factors, and the worklist that grows them to a fixpoint (see `_partitioning`)."""

from __future__ import annotations

from collections import deque

from ._errors import PartitioningError


class Propagation:
    """Mixin with the hot loops of propagation; `Partitioning` holds the state they use
    (`_d`, `_f`, `_forbid`, `_boundary`, `_cls`, `_msize`, the log and the hash)."""

    def _set(self, v: int, dims: tuple) -> None:
        old = self._d[v]
        self._hash ^= _vhash(v, old) ^ _vhash(v, dims)
        self._log.append((_VAL, v, old))
        self._d[v] = dims
        self._touched_classes.add(v)

    def _decide(self, d) -> None:
        self._decisions.append(d)
        self._log.append((_DEC,))

    def _keep(self, kind: int, table: dict, key, entry, decision, clash, replaces=None) -> None:
        """`table[key] = entry` (a token order, a ring), undone as `kind` on rollback and
        taken as `decision`: a no-op when it is there already, a `PartitioningError`
        saying `clash(entry there)` when another is, unless `replaces(entry there)` (a
        token order extended to more axes): then it takes its place, and a rollback
        puts it back."""
        old = table.get(key)
        if old == entry:
            return
        if old is not None:
            if replaces is None or not replaces(old):
                raise PartitioningError(clash(old))
            self._hash ^= hash((kind, key, old))
        table[key] = entry
        self._log.append((kind, key, old))
        self._hash ^= hash((kind, key, entry))
        self._decide(decision)

    def _partial_axes(self, op, F) -> tuple[str, ...]:
        if not op.rule.reduction:
            return ()
        axes = {a for f in op.rule.reduction for a in F[f]}
        return tuple(a for a in self.mesh.names if a in axes)

    def _project(self, F, spec, sizes, strict=True) -> tuple[tuple[str, ...], ...]:
        # Factor tilings -> dim tilings. A dim made of several factors can only carry the
        # minor factors' axes when the major ones are split all the way (`strict`: what
        # a value may be tiled as). Not strict: every axis splitting the dim's factors,
        # expressible or not: what the op computes with, which is what a reshard to or
        # from it must move (a reshape merging [2, T] with T split must gather T).
        out = []
        for fs in spec:
            if len(fs) == 1:
                out.append(F[fs[0]])
            elif not fs:
                out.append(())
            elif strict:
                out.append(self._join(F, fs, sizes))
            else:
                out.append(tuple(a for f in fs for a in F[f]))
        return tuple(out)

    def _join(self, F, fs, sizes) -> tuple[str, ...]:
        along = self.mesh.devices_along
        axes = ()
        for f in fs:
            ax = F[f]
            axes += ax
            if along(ax) != sizes[f]:
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
        # that disagrees with what is there loses (the earlier tiling wins). Constrained
        # classes are boundaries: nothing is read from them.
        boundary = self._boundary
        for vid, d, f in single:
            axes = D[vid][d]
            if not axes or vid in boundary:
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
            if axes and vid not in boundary:
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
        self._touched_ops.add(oid)
        # 2. Push: grow every class toward the op's factor tiling where compatible.
        forbid = self._forbid
        pending: dict[int, list] = {}
        for vid, d, f in single:
            w = F[f]
            if w:
                self._offer(pending, D, vid, d, w, forbid[vid])
        for vid, d, fs in multi:
            w = self._join(F, fs, op.rule.sizes)
            if w:
                self._offer(pending, D, vid, d, w, forbid[vid])
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
        if sizes[f] % self.mesh.devices_along(axes):
            return new
        if new is None:
            new = list(F)
        new[f] = axes
        return new

    @staticmethod
    def _offer(pending, D, vid, d, w, forbid):
        dims = pending.get(vid) or D[vid]
        cur = dims[d]
        n = len(cur)
        if len(w) <= n or w[:n] != cur:
            return
        add = w[n:]
        if forbid is not None:
            for a in add:
                if a in forbid:
                    return
        for dd in dims:
            for a in add:
                if a in dd:
                    return
        if vid not in pending:
            dims = pending[vid] = list(dims)
        dims[d] = w


_VAL, _FAC, _PIN, _DEC, _BND, _REM, _REU, _PIP, _ORD, _RNG, _SAV = range(11)


def _vhash(v: int, dims: tuple) -> int:
    return hash((v, dims)) if any(dims) else 0


def _fhash(o: int, F: tuple) -> int:
    return hash((-1 - o, F)) if any(F) else 0
