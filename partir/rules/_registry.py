"""The rule registry: one table of factor rules and op traits, keyed by primitive name.

A rule function takes the operand shapes, the result shapes and the equation's params
and returns a `FactorRule`. Each primitive is registered with its `Traits` (`_traits`:
how its work is counted, how XLA fuses it, whether it is a view or indexed), which the
cost model and the lowerings read. Family helpers register many primitives at once, in
the manner of JAX's `defbroadcasting`.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Callable, Iterator

from .._rule import FactorRule, factor_rule
from ._traits import Traits

Shape = tuple[int, ...]
RuleFn = Callable[[tuple[Shape, ...], tuple[Shape, ...], dict], FactorRule]

_RULES: dict[str, RuleFn] = {}
_TRAITS: dict[str, Traits] = {}


def register(*names: str, traits: Traits | Mapping[str, Traits]) -> Callable[[RuleFn], RuleFn]:
    """Decorator: make `fn` the rule of each primitive in `names` (a name may be ruled
    once), with its `traits` (one for all, or a mapping by name that holds every name)."""
    for name in names:
        if name in _RULES:
            raise ValueError(f"primitive {name!r} already has a partitioning rule ({_RULES[name].__name__})")
        if not isinstance(traits, Traits) and name not in traits:
            raise ValueError(f"primitive {name!r} is registered without its traits: add it to the mapping")

    def deco(fn: RuleFn) -> RuleFn:
        for name in names:
            _RULES[name] = fn
            _TRAITS[name] = traits if isinstance(traits, Traits) else traits[name]
        return fn

    return deco


def get_rule(name: str) -> RuleFn | None:
    """The rule function of a primitive, or None when it has none."""
    return _RULES.get(name)


def get_traits(name: str) -> Traits | None:
    """The traits of a primitive, or None when it has no rule (the IR replicates it and
    warns; the cost model then counts no work and fuses nothing into it)."""
    return _TRAITS.get(name)


def registered() -> list[str]:
    """All primitive names with a rule (and traits), sorted."""
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
