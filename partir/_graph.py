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
