"""Graph facts of a program defined once: sets joined by union-find, values that are one
across call boundaries, and what some values or ops depend on."""

from __future__ import annotations

import numpy as np

from ._nested import Link


class UnionFind:
    """Disjoint sets over `0..n-1`. A union keeps the smaller id as the root, so a set's
    root is its first member; `find` halves paths as it walks."""

    def __init__(self, n: int):
        self.parent = list(range(n))

    def find(self, x: int) -> int:
        """The root of `x`'s set."""
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> int:
        """Join the sets of `a` and `b`; their root."""
        a, b = self.find(a), self.find(b)
        if a != b:
            self.parent[max(a, b)] = min(a, b)
        return min(a, b)

    def labels(self) -> list[int]:
        """Per member, its set numbered densely in order of the sets' first members."""
        ids: dict[int, int] = {}
        return [ids.setdefault(self.find(x), len(ids)) for x in range(len(self.parent))]


def call_roots(program) -> tuple[int, ...]:
    """Per value, the first of the values it is the same as across call boundaries (a
    call's argument and result only rename what they carry). Kept with the program."""
    return program.analysis(_call_roots)


def _call_roots(program) -> tuple[int, ...]:
    sets = UnionFind(len(program.values))
    for op in program.ops:
        if op.link and op.primitive in (Link.CALL_IN, Link.CALL_OUT) and op.operands[0] >= 0 and op.results[0] >= 0:
            sets.union(op.operands[0], op.results[0])
    return tuple(sets.find(v) for v in range(len(program.values)))


def depended_on(program, values) -> tuple[np.ndarray, np.ndarray]:
    """(per value, per op) masks of what `values` depend on: the values themselves, the
    ops that make them (every op that makes a loop-carried value, its links included),
    what those ops read, and so on to the program's inputs."""
    makers = makers_of(program)
    needed = np.zeros(len(program.values), dtype=bool)
    ops = np.zeros(len(program.ops), dtype=bool)
    stack = [v for v in values if v >= 0]
    while stack:
        v = stack.pop()
        if needed[v]:
            continue
        needed[v] = True
        for o in makers[v]:
            if not ops[o]:
                ops[o] = True
                stack += [u for u in program.ops[o].operands if u >= 0]
    return needed, ops


def makers_of(program) -> tuple[tuple[int, ...], ...]:
    """Per value, every op that makes it (a loop carry: its entering and looping links;
    `Program.producer` keeps one). Kept with the program."""
    return program.analysis(_makers)


def _makers(program) -> tuple[tuple[int, ...], ...]:
    out: list[list[int]] = [[] for _ in program.values]
    for op in program.ops:
        for v in op.results:
            if v >= 0:
                out[v].append(op.id)
    return tuple(map(tuple, out))


def made_from_scalars(program) -> tuple[bool, ...]:
    """Per value: is it made from scalars alone, reached by no array the program takes
    (an iota, a broadcast constant, a causal mask, rotary frequencies)? Such a value has
    no data to move: it can be made wherever it is read, in the reader's layout. The cost
    model charges no move for the ones XLA fuses into their readers
    (`Materialization.from_scalars`); the lowerings make those where they are read. A
    loop's carry is made from scalars when what enters and what goes round both are.
    Kept with the program."""
    return program.analysis(_made_from_scalars)


def _made_from_scalars(program) -> tuple[bool, ...]:
    values = program.values
    out = [False] * len(values)
    seen = [False] * len(values)
    for op in program.ops:  # lift order: a value's makers after its operands' (a carry's loop link last)
        ok = all(out[u] for u in op.operands if u >= 0 and values[u].shape) and (bool(op.results) and not (
            op.link and not any(u >= 0 and values[u].shape for u in op.operands)))
        for r in op.results:
            if r >= 0:
                out[r] = ok and (out[r] or not seen[r])
                seen[r] = True
    return tuple(out)


#: Region kinds XLA runs as computations of their own: loop bodies and conditions, and a
#: cond's branches. Calls (`jit`, `remat2`, custom-derivative calls) are inlined into
#: their caller.
COMPUTATION_KINDS = ("scan", "while.cond", "while.body", "cond.branch")


def computations(program) -> tuple[int, ...]:
    """Per region, the region of the computation XLA runs it in: itself for the top level,
    a loop body or a branch; its caller's for a call. Kept with the program."""
    return program.analysis(_computations)


def _computations(program) -> tuple[int, ...]:
    out = []
    for r in program.regions:  # parents come before their children
        own = r.parent is None or r.parent < 0 or r.kind in COMPUTATION_KINDS
        out.append(r.id if own else out[r.parent])
    return tuple(out)
