"""The rule registry: one table of factor rules, keyed by primitive name.

A rule function takes the operand shapes, the result shapes and the equation's params
and returns a `FactorRule`. Family helpers (`defelementwise`, `defreduction`, ...)
register many primitives at once, in the manner of JAX's `defbroadcasting`.
"""

from __future__ import annotations

import string
from typing import Callable, Iterator

from .._rule import FactorRule, factor_rule

Shape = tuple[int, ...]
RuleFn = Callable[[tuple[Shape, ...], tuple[Shape, ...], dict], FactorRule]

_RULES: dict[str, RuleFn] = {}


def register(*names: str) -> Callable[[RuleFn], RuleFn]:
    """Decorator: make `fn` the rule of each primitive in `names` (a name may be ruled once)."""

    def deco(fn: RuleFn) -> RuleFn:
        for name in names:
            if name in _RULES:
                raise ValueError(f"primitive {name!r} already has a partitioning rule ({_RULES[name].__name__})")
            _RULES[name] = fn
        return fn

    return deco


def get_rule(name: str) -> RuleFn | None:
    """The rule function of a primitive, or None when it has none."""
    return _RULES.get(name)


def registered() -> list[str]:
    """All primitive names with a rule, sorted."""
    return sorted(_RULES)


def letters() -> Iterator[str]:
    """Factor names in the order rules hand them out: i, j, k, ..., z, a, ..., h, f26, ..."""
    alphabet = string.ascii_lowercase[8:] + string.ascii_lowercase[:8]
    yield from alphabet
    n = len(alphabet)
    while True:
        yield f"f{n}"
        n += 1


class Namer:
    """Hands out factor names to arbitrary keys in order of first request."""

    def __init__(self):
        self._names: dict = {}
        self._gen = letters()

    def __call__(self, key) -> str:
        if key not in self._names:
            self._names[key] = next(self._gen)
        return self._names[key]

    def fresh(self) -> str:
        """A name no key has."""
        return self((object(),))


def conservative_rule(in_shapes: tuple[Shape, ...], out_shapes: tuple[Shape, ...]) -> FactorRule:
    """Every dim of every value is its own blocked factor: nothing is split at this op,
    so operands are gathered to replicated and results are produced replicated."""
    name = Namer()
    ins = [[name.fresh() for _ in s] for s in in_shapes]
    outs = [[name.fresh() for _ in s] for s in out_shapes]
    every = [f for v in ins + outs for f in v]
    return factor_rule(ins, outs, in_shapes, out_shapes, blocked=every)
