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
cheaply; `key()` is an incrementally maintained hash of the whole state; `delta` and
`replay` (`partir._replay`) take a change again without working it out again.
"""

from __future__ import annotations

import gc

from ._errors import PartitioningError
from ._ir import Program
from ._mesh import MeshSpec
from ._order import Orders
from ._pipelines import Pipelines
from ._propagate import _BND, _FAC, _ORD, _PIN, _PIP, _REM, _REU, _RNG, _SAV, _VAL, Propagation, _fhash, _vhash
from ._replay import Replay
from ._rings import Rings
from ._recomputed import Recomputed
from .rules._manual import check_fixed_regions
from ._decision import Decision, Reshard, _check_action
from ._tiling import Tiling


class Partitioning(Propagation, Replay, Orders, Rings, Pipelines, Recomputed):
    """Tilings for every value of `program` on `mesh`, changed only by `tile` and
    `replicate` actions (each followed by propagation)."""

    def __init__(self, program: Program, mesh: MeshSpec, *, detached=()):
        self.program = program
        self.mesh = mesh
        check_fixed_regions(program, mesh)
        # Axis sizes as a plain dict for `_split`'s greedy loop, which reads them one
        # axis at a time (products over whole axis tuples use `mesh.devices_along`).
        self._msize = mesh.sizes()
        self.detached = frozenset(program.resolve(v) for v in detached)
        self._all_axes = frozenset(mesh.names)
        self._cls = program.classes_for(self.detached)
        self._of = self._cls.of
        # Dim tilings of each class as plain tuples (axes per dim): the propagator's hot data.
        self._d: list[tuple] = [((),) * program.values[m[0]].rank for m in self._cls.members]
        empty: dict[int, tuple] = {}
        self._f: list[tuple] = [empty.setdefault(op.rule.num_factors, ((),) * op.rule.num_factors) for op in program.ops]
        # Per class, the mesh axes it may not be split over (None: any); `replicate`
        # forbids all of them.
        self._forbid: list = [None] * len(self._cls)
        # Classes fixed by `constrain`: layout boundaries that ops do not read tilings from.
        self._boundary: set[int] = set()
        # Residuals recomputed in the backward pass instead of kept (`remat`).
        self._remat: set[int] = set()
        # Values a user's `jax.checkpoint` recomputes that the backward reads from the
        # forward pass instead (`reuse`).
        self._reuse: set[int] = set()
        # Values a recomputation reads instead of remaking them (`save`).
        self._save: set[int] = set()
        # Layer scans run as pipeline stages (`pipeline`), in the order they were added.
        self._pipelines: tuple = ()
        # Per sequence (a class of `partir.dim_classes`), the token order it is laid out
        # in (`reorder`): (mesh axis or axes, balance).
        self._orders: dict[int, tuple] = {}
        # Per value moved round a ring (`ring`): (dim, mesh axis).
        self._rings: dict[int, tuple[int, str]] = {}
        self._layouts: dict = {}  # (rule id, factor tiling) -> projected dims (see op_layout)
        self._inq = bytearray(len(program.ops))
        self._log: list[tuple] = []
        self._marks: list[tuple[int, int]] = []  # (log length, key there) of live marks, ascending
        self._decisions: list[Decision] = []
        self._hash = 0
        # Classes and ops changed since the last `take_touched`, by actions and rollbacks
        # alike: what an incremental consumer (the cost model) must look at again.
        self._touched_classes: set[int] = set()
        self._touched_ops: set[int] = set()

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
        """True when `replicate` or `pin` restricted the value's tiling (and its class's)."""
        return self._forbid[self._of[self.program.resolve(value)]] is not None

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
        if o.rule.fixed is not None:
            return Tiling(o.rule.fixed.ins[operand])
        return Tiling(self._project(self.factor_tiling(op), o.rule.operands[operand], o.rule.sizes, strict=False))

    def produced(self, value) -> Tiling:
        """The tiling a value has as its producer computes it: partial over the axes of
        any split reduction factor of that op."""
        v = self.program.resolve(value)
        oid = self.program.producer[v]
        if oid < 0:
            return Tiling(self._d[self._of[v]])
        op = self.program.ops[oid]
        k = op.results.index(v)
        if op.rule.fixed is not None:
            return Tiling(op.rule.fixed.outs[k])
        F = self.factor_tiling(oid)
        dims = self._project(F, op.rule.results[k], op.rule.sizes, strict=False)
        return Tiling(dims, self._partial_axes(op, F), op.rule.reduce_kind)

    def op_layout(self, op: int):
        """How op `op` computes: `(slots, partial, reduce_kind)` where `slots` lists
        `(side, index, value, dims)` for each operand ('operand') and result ('result')
        that is a value (not a literal or dropped), `dims` being the dim tiling the op
        uses or produces, and
        `partial` the axes its results are partial over. Reshard points are where a
        slot's dims (or partial) differ from the value's at-rest tiling."""
        return self._layout(op, self.factor_tiling(op))

    def block_layout(self, op: int):
        """`op_layout` as a device computes op `op` on contiguous blocks: without the axes
        of a factor that follows, in some dim, a factor not split all the way (a merged
        `[i, j]` with only `j` split holds interleaved, not contiguous, blocks of `i*j`).
        The op reads such factors whole: for a reshape, the bytes of the gather that
        `op_layout` implies at the merged dim, moved where the factor is a dim of its own."""
        o = self.program.ops[op]
        F = self.factor_tiling(op)
        along, sizes = self.mesh.devices_along, o.rule.sizes
        hidden = set()
        for spec in o.rule.operands + o.rule.results:
            for fs in spec:
                cut = next((n for n, f in enumerate(fs) if along(F[f]) != sizes[f]), len(fs))
                hidden.update(f for f in fs[cut + 1:] if F[f])
        if not hidden:
            return self._layout(op, F)
        return self._layout(op, tuple(() if f in hidden else axes for f, axes in enumerate(F)))

    def _layout(self, op: int, F):
        o = self.program.ops[op]
        key = (id(o.rule), F)
        shape = self._layouts.get(key)
        if shape is None:  # ops of repeated layers share rules and factor tilings
            sizes, fixed = o.rule.sizes, o.rule.fixed
            if fixed is not None:  # a region the user partitioned by hand: its specs, not its factors
                ins, outs = fixed.ins, fixed.outs
            else:
                ins = tuple(self._project(F, spec, sizes, strict=False) for spec in o.rule.operands)
                outs = tuple(self._project(F, spec, sizes, strict=False) for spec in o.rule.results)
            shape = self._layouts[key] = (ins, outs, self._partial_axes(o, F))
        ins, outs, partial = shape
        slots = [("operand", k, v, d) for k, (v, d) in enumerate(zip(o.operands, ins)) if v >= 0]
        slots += [("result", k, v, d) for k, (v, d) in enumerate(zip(o.results, outs)) if v >= 0]
        return tuple(slots), partial, o.rule.reduce_kind

    def reshards(self, ops=None) -> list[Reshard]:
        """Every reshard and reduction point (of the given ops, or of all), in op order."""
        out = []
        trivial = self._cls.trivial
        for oid in range(len(self.program.ops)) if ops is None else sorted(ops):
            if not trivial[oid]:
                out.extend(self.layout_reshards(oid, self.op_layout(oid)))
        return out

    def layout_reshards(self, op: int, layout) -> list[Reshard]:
        """The reshard points of op `op` given its `op_layout` (which callers may cache
        for as long as the op's factor tiling does not change)."""
        slots, partial, kind = layout
        D, of = self._d, self._of
        out = []
        for side, k, v, dims in slots:
            have = D[of[v]]
            if side == "operand":
                if dims != have:
                    out.append(Reshard(op, v, side, k, Tiling(have), Tiling(dims)))
            elif dims != have or partial:
                out.append(Reshard(op, v, side, k, Tiling(dims, partial, kind), Tiling(have)))
        return out

    # -- actions -----------------------------------------------------------------------
    def tile(self, value, dim: int, axis: str, *, source: str = "user") -> None:
        """Split `dim` of `value` over mesh `axis` (minor to any axes already on that dim),
        then propagate. A no-op when `axis` already splits that dim (e.g. by propagation).
        Raises `PartitioningError`, changing nothing, when it cannot."""
        prog = self.program
        v = prog.resolve(value)
        val = prog.values[v]
        self.mesh.size(axis)  # a clear error for an unknown axis
        if not -val.rank <= dim < val.rank:
            raise PartitioningError(f"cannot tile {prog.name(v)}: dim {dim} is out of range for shape {val.shape}")
        dim %= val.rank
        c = self._of[v]
        dims = self._d[c]
        if axis in dims[dim]:
            return
        forbid = self._forbid[c]
        if forbid is not None and axis in forbid:
            raise PartitioningError(f"cannot tile {prog.name(v)} over {axis!r}: an earlier decision pinned it "
                                    f"({'replicated' if forbid == self._all_axes else 'whole over ' + ', '.join(sorted(forbid))})")
        if any(axis in d for d in dims):
            raise PartitioningError(
                f"cannot tile {prog.name(v)} dim {dim} over {axis!r}: its tiling {Tiling(dims)} already uses that axis")
        k = self.mesh.devices_along((*dims[dim], axis))
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
            gc_was = gc.isenabled()  # see partir._ir.no_gc (inlined: this is a hot path)
            gc.disable()
            try:
                self._propagate(c)
            finally:
                if gc_was:
                    gc.enable()
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
        self._restrict(c, self._all_axes)
        self._decide(Decision("replicate", v, None, None, source))

    def detach(self, values) -> "Partitioning":
        """A new partitioning in which `values` (and those already detached) keep a tiling
        of their own instead of sharing their class's, with this one's decisions
        replayed in order. Needed before giving a value a layout that differs from the
        values an elementwise op ties it to (see `partir._classes`)."""
        new = Partitioning(self.program, self.mesh, detached=self.detached | {self.program.resolve(v) for v in values})
        for d in self._decisions:
            new.redo(d)
        return new

    def redo(self, decision: Decision, value=None) -> None:
        """Take `decision` (from this or another partitioning) again, on `value` instead
        of its own value when given (e.g. the same input of another program)."""
        d, v = decision, decision.value if value is None else value
        _check_action(d.action)
        if d.action == "tile":
            self.tile(v, d.dim, d.axis, source=d.source)
        elif d.action == "replicate":
            self.replicate(v, source=d.source)
        elif d.action == "constrain":
            self.constrain(v, d.tiling, source=d.source)
        elif d.action == "remat":
            self.remat(v, source=d.source)
        elif d.action == "reuse":
            self.reuse(v, source=d.source)
        elif d.action == "save":
            self.save(v, source=d.source)
        elif d.action == "reorder":
            self.reorder(v, d.dim, d.axis, d.order, source=d.source)
        elif d.action == "ring":
            self.ring(v, d.dim, d.axis, source=d.source)
        else:
            self.pin(v, axes=d.axes, source=d.source)

    def constrain(self, value, tiling, *, source: str = "user") -> None:
        """Fix `value`'s layout to `tiling` (a `Tiling`, `PartitionSpec` or per-dim axes)
        as a boundary, like `with_sharding_constraint`: it does not propagate, ops next
        to it compute as their other values decide and reshard to or from it, and it is
        not split any further over the axes it uses. The constraint may only extend the
        value's current tiling (tilings never shrink)."""
        from jax.sharding import PartitionSpec

        prog = self.program
        v = prog.resolve(value)
        val = prog.values[v]
        if isinstance(tiling, PartitionSpec):
            tiling = Tiling.from_spec(tiling, val.rank)
        elif not isinstance(tiling, Tiling):
            tiling = Tiling(tuple(tuple(d) for d in tiling))
        if tiling.rank != val.rank:
            raise PartitioningError(f"cannot constrain {prog.name(v)} (rank {val.rank}) to {tiling} (rank {tiling.rank})")
        axes = tiling.axes()
        if len(set(axes)) != len(axes):
            raise PartitioningError(f"cannot constrain {prog.name(v)} to {tiling}: an axis splits two dims")
        for d, dim_axes in enumerate(tiling.dims):
            k = self.mesh.devices_along(dim_axes)
            if val.shape[d] % k:
                raise PartitioningError(f"cannot constrain {prog.name(v)}: dim {d} (size {val.shape[d]}) is not "
                                        f"divisible by the {k} devices of {dim_axes}")
        c = self._of[v]
        if any(tuple(new[:len(old)]) != old for old, new in zip(self._d[c], tiling.dims)):
            raise PartitioningError(f"cannot constrain {prog.name(v)} to {tiling}: it is already tiled "
                                    f"{Tiling(self._d[c])}, which {tiling} does not extend")
        self._set(c, tiling.dims)
        if c not in self._boundary:
            self._boundary.add(c)
            self._log.append((_BND, c))
            self._hash ^= hash((_BND, c))
        self._restrict(c, frozenset(axes))
        self._decide(Decision("constrain", v, None, None, source, tiling=tiling))

    def pin(self, value, axes=None, *, source: str = "user") -> None:
        """Keep `value` from being split any further over `axes` (all mesh axes when
        None: its tiling stays as it is): propagation leaves it be, and ops that want it
        otherwise reshard it."""
        v = self.program.resolve(value)
        axes = self._all_axes if axes is None else frozenset(axes)
        for a in axes:
            self.mesh.size(a)  # a clear error for an unknown axis
        self._restrict(self._of[v], axes)
        self._decide(Decision("pin", v, None, None, source, tuple(sorted(axes))))

    def _restrict(self, c: int, axes: frozenset) -> None:
        old = self._forbid[c]
        new = axes if old is None else old | axes
        if new != old:
            self._log.append((_PIN, c, old))
            self._hash ^= hash((_PIN, c, old)) ^ hash((_PIN, c, new))
            self._forbid[c] = new

    def mark(self) -> int:
        """A point to `rollback` to."""
        n, marks = len(self._log), self._marks
        if not marks or marks[-1][0] < n:
            marks.append((n, self._hash))  # the key there, so that rollback need not rehash
        return n

    def rollback(self, mark: int) -> None:
        """Undo every change made since `mark`."""
        marks = self._marks
        while marks and marks[-1][0] > mark:
            marks.pop()
        known = marks[-1][1] if marks and marks[-1][0] == mark else None
        log, D, Fs = self._log, self._d, self._f
        h = self._hash
        while len(log) > mark:
            entry = log.pop()
            kind = entry[0]
            if kind == _VAL:
                _, v, old = entry
                if known is None:
                    h ^= _vhash(v, D[v]) ^ _vhash(v, old)
                D[v] = old
                self._touched_classes.add(v)
            elif kind == _FAC:
                _, o, old = entry
                if known is None:
                    h ^= _fhash(o, Fs[o]) ^ _fhash(o, old)
                Fs[o] = old
                self._touched_ops.add(o)
            elif kind == _BND:
                self._boundary.discard(entry[1])
                h ^= hash((_BND, entry[1]))
            elif kind == _PIN:
                _, c, old = entry
                h ^= hash((_PIN, c, self._forbid[c])) ^ hash((_PIN, c, old))
                self._forbid[c] = old
            elif kind in (_REM, _REU, _SAV):
                {_REM: self._remat, _REU: self._reuse, _SAV: self._save}[kind].discard(entry[1])
                h ^= hash((kind, entry[1]))
            elif kind == _PIP:
                self._pipelines = self._pipelines[:-1]
                h ^= hash((_PIP, entry[1]))
            elif kind == _ORD:
                h = self._unorder(entry, h)
            elif kind == _RNG:
                h ^= hash((_RNG, entry[1], self._rings.pop(entry[1])))
                self._touched_classes.add(self._of[entry[1]])
            else:
                self._decisions.pop()
        self._hash = h if known is None else known

    def take_touched(self) -> tuple[set[int], set[int]]:
        """(classes, ops) changed since the previous call, forward or by rollback; clears
        them. Meant for one incremental consumer of this partitioning."""
        out = (self._touched_classes, self._touched_ops)
        self._touched_classes, self._touched_ops = set(), set()
        return out

    @property
    def classes(self):
        """The program's tiling classes (values that share one tiling)."""
        return self._cls

    def class_dims(self, c: int) -> tuple[tuple[str, ...], ...]:
        """The dim tiling (axes per dim) of tiling class `c`."""
        return self._d[c]

    @property
    def class_tilings(self) -> list:
        """Dim tilings of all classes, by class id (live and read-only: do not modify)."""
        return self._d

    def changed_since(self, mark: int) -> tuple[set[int], set[int]]:
        """(values, ops) whose tilings changed since `mark`: values of changed classes;
        ops whose factor tiling changed or that touch a changed class (their reshard
        points may have changed)."""
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
        ops.update(o for c in classes for o in self._cls.ops[c])
        return vals, ops

    def copy(self) -> "Partitioning":
        """An independent copy (the undo log is not carried over)."""
        c = Partitioning.__new__(Partitioning)
        c.__dict__.update(self.__dict__)  # immutable or shared-by-design parts
        c._d, c._f = list(self._d), list(self._f)
        c._forbid, c._inq = list(self._forbid), bytearray(len(self._inq))
        c._boundary = set(self._boundary)
        c._remat, c._reuse, c._save = set(self._remat), set(self._reuse), set(self._save)
        c._orders = dict(self._orders)
        c._rings = dict(self._rings)
        c._log, c._marks, c._decisions = [], [], list(self._decisions)
        c._touched_classes, c._touched_ops = set(), set()
        return c

