"""Groups of inputs that play the same role in structurally identical layers.

A weight of every transformer block, whatever its name, lands in one group. Roles are
compared by a signature of the input's surroundings in the dataflow: its shape and
dtype, and the multiset of (distance, primitive, factor rule, operand position) of the
ops reachable downstream within `RADIUS` hops. Tactics use groups to decide a layer
kind once; the search decides each group with one action.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass

#: Op hops explored downstream of an input to tell its role apart; enough to reach the
#: matmul that reads a layer norm's scale, short enough to stay inside one layer.
RADIUS = 4


@dataclass(frozen=True, slots=True)
class Group:
    """Inputs decided together: same shape, dtype and dataflow surroundings."""

    members: tuple[int, ...]
    label: str


def _signature(prog, v: int, rule_text: dict) -> str:
    counts: Counter = Counter()
    frontier, seen = {v}, {v}
    for depth in range(RADIUS):
        nxt = set()
        for u in frontier:
            for o in prog.users[u]:
                op = prog.ops[o]
                text = rule_text.get(id(op.rule))
                if text is None:
                    text = rule_text[id(op.rule)] = str(op.rule)
                counts[(depth, op.primitive, text, op.operands.index(u))] += 1
                for r in op.results:
                    if r >= 0 and r not in seen:
                        seen.add(r)
                        nxt.add(r)
        frontier = nxt
    val = prog.values[v]
    text = repr((val.shape, str(val.dtype), sorted(counts.items())))
    return hashlib.sha1(text.encode()).hexdigest()


def _label(names: list[str]) -> str:
    """The members' common name with the parts that differ replaced by `*`."""
    if len(names) == 1:
        return names[0]
    parts = [re.split(r"(\[[^\]]*\]|\.)", n) for n in names]
    if len({len(p) for p in parts}) != 1:
        return f"{names[0]} (+{len(names) - 1} alike)"
    return "".join(p[0] if len(set(p)) == 1 else "[*]" for p in zip(*parts))


def _signatures(prog) -> dict[int, str]:
    # input -> signature, filled as inputs are asked for (kept with the program)
    return {}


def input_groups(prog, inputs, *, group: bool = True) -> list[Group]:
    """Groups of `inputs` (one per input when `group` is False), in input order.
    Signatures are computed once per program."""
    if not group:
        return [Group((v,), prog.name(v)) for v in sorted(inputs)]
    sigs = prog.analysis(_signatures)
    rule_text: dict = {}
    by_sig: dict[str, list[int]] = {}
    for v in inputs:
        key = sigs.get(v)
        if key is None:
            key = sigs[v] = _signature(prog, v, rule_text)
        by_sig.setdefault(key, []).append(v)
    groups = [Group(tuple(vs), _label([prog.name(v) for v in vs])) for vs in by_sig.values()]
    return sorted(groups, key=lambda g: g.members[0])


