"""Tiling classes: values that must share one tiling, found once per program.

An op whose rule gives two values the identical factors dim by dim (every dim one
unblocked factor) computes one from the other block by block: elementwise ops, links
into and out of calls, a loop carry going round. Such values always carry the same
tiling at the fixpoint, so the partitioning stores one tiling per *class* (union-find
over those pairs) and never propagates through an op whose values are all one class
with one spec (a *trivial* op). Propagation then only visits the ops where tilings can
really change shape (contractions, reshapes, broadcasts, reductions, gathers, ...), and
tiling a class updates all its values at once.

Values can be *detached*: kept out of every class, so their at-rest layout is a
decision of its own (a parameter may stay replicated while the optimizer update that
reads it is sharded, as ZeRO-1 does); the ops touching them then reshard if needed.
Detaching costs propagation speed, so it is done only where a schedule asks for it
(`Partitioning.detach`).
"""

from __future__ import annotations

from ._graph import UnionFind


class TilingClasses:
    """Classes of a program: `of[v]` is value v's class; `members[c]` its values;
    `ops[c]` the non-trivial ops touching it; per op, `single[o]` lists
    `(class, dim, factor)` for dims of one unblocked factor and `multi[o]` lists
    `(class, dim, factors)` for dims of several; `trivial[o]` marks ops needing no
    propagation (they also never reshard)."""

    def __init__(self, program, detached: frozenset = frozenset()):
        n = len(program.values)
        sets = UnionFind(n)
        boundary = detached
        shapes = {}  # rule id -> its slot structure (rules are shared by equal ops)
        op_slots = []
        for op in program.ops:
            sh = shapes.get(id(op.rule))
            if sh is None:
                sh = shapes[id(op.rule)] = _Shape(op.rule)
            vids = [v for v in op.operands] + [v for v in op.results]
            op_slots.append(vids)
            for group in sh.groups:
                present = [vids[k] for k in group if vids[k] >= 0 and vids[k] not in boundary]
                for v in present[1:]:
                    sets.union(present[0], v)
        of = sets.labels()
        self.of: tuple[int, ...] = tuple(of)
        members: list[list[int]] = [[] for _ in range(max(of, default=-1) + 1)]
        for v, c in enumerate(of):
            members[c].append(v)
        self.members: tuple[tuple[int, ...], ...] = tuple(map(tuple, members))
        single, multi, trivial = [], [], []
        ops_of: list[list[int]] = [[] for _ in members]
        for op, vids in zip(program.ops, op_slots):
            sh = shapes[id(op.rule)]
            if sh.trivial and len({of[vids[k]] for k in sh.slots if vids[k] >= 0}) <= 1:
                # One class, one spec: the first slot's dims say everything.
                k0 = next((k for k in sh.slots if vids[k] >= 0), None)
                c = of[vids[k0]] if k0 is not None else -1
                single.append(tuple((c, d, f) for k, d, f in sh.single if k == k0))
                multi.append(())
                trivial.append(True)
                continue
            single.append(tuple(dict.fromkeys((of[vids[k]], d, f) for k, d, f in sh.single if vids[k] >= 0)))
            multi.append(tuple(dict.fromkeys((of[vids[k]], d, fs) for k, d, fs in sh.multi if vids[k] >= 0)))
            trivial.append(False)
            for c in sorted({of[vids[k]] for k in sh.slots if vids[k] >= 0}):
                ops_of[c].append(op.id)
        self.single: tuple = tuple(single)
        self.multi: tuple = tuple(multi)
        self.trivial: tuple[bool, ...] = tuple(trivial)
        self.ops: tuple[tuple[int, ...], ...] = tuple(map(tuple, ops_of))

    def __len__(self) -> int:
        return len(self.members)


class _Shape:
    """What classes need of one rule, by slot (operands then results): the slots of
    rank > 0, groups of slots with identical clean specs, the propagation entries, and
    whether an op with this rule is trivial."""

    def __init__(self, rule):
        blocked = set(rule.blocked)
        specs = list(rule.operands) + list(rule.results)
        self.slots = [k for k, spec in enumerate(specs) if spec]
        clean = {k: all(len(fs) == 1 and fs[0] not in blocked for fs in specs[k]) for k in self.slots}
        groups: dict = {}
        for k in self.slots:
            if clean[k]:
                groups.setdefault(specs[k], []).append(k)
        self.groups = [g for g in groups.values() if len(g) > 1]
        self.trivial = (len({specs[k] for k in self.slots}) <= 1 and all(clean.values())
                        and not rule.reduction)
        self.single = [(k, d, fs[0]) for k in self.slots for d, fs in enumerate(specs[k])
                       if len(fs) == 1 and fs[0] not in blocked]
        self.multi = [(k, d, fs) for k in self.slots for d, fs in enumerate(specs[k]) if len(fs) > 1]
