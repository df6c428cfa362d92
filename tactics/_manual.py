"""Manual tactics: say exactly how named inputs are laid out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import PartitionSpec

from partir import PartitioningError, Tiling
from partir._ir import close_names

from . import _checks
from ._base import Context, Tactic, TacticError


def _matches(part, pattern: str) -> list[int]:
    prog = part.program
    hits = prog.match_inputs(pattern)
    if not hits:
        near = close_names(pattern, prog.input_names)
        hint = f"; near misses: {', '.join(near)}" if near else f"; inputs look like {prog.input_names[0]!r}"
        raise TacticError(f"pattern {pattern!r} matches no input{hint}")
    _checks.warn_alike_paths("pattern", pattern, prog, hits)
    return hits


@dataclass(frozen=True)
class Shard(Tactic):
    """Split `dim` of every input whose path matches `pattern` over mesh `axis`.

    Patterns are globs on `/`-joined keys (`params/layers/*/mlp/w1`) or `re:` regexes
    on the names `lift` gives (`params['layers'][3]['mlp']['w1']`). Collectives: none
    of its own; propagation decides what the split implies.
    """

    pattern: str
    dim: int
    axis: str

    def __post_init__(self):
        _checks.pattern("Shard pattern", self.pattern, error=TacticError)
        _checks.number("Shard dim", self.dim, integer=True, sign="any", example="dim=1", error=TacticError)
        _checks.text("Shard axis", self.axis, example="axis='model'", error=TacticError)

    def apply(self, part, ctx: Context):
        hits = _matches(part, self.pattern)
        for v in hits:
            part.tile(v, self.dim, self.axis, source=str(self))
        return part, [f"{len(hits)} input(s) match {self.pattern!r}"]


@dataclass(frozen=True)
class Replicate(Tactic):
    """Keep every input matching `pattern` replicated (and what shares its tiling class:
    a parameter's optimizer state and update). Consumers that want it split slice it."""

    pattern: str

    def __post_init__(self):
        _checks.pattern("Replicate pattern", self.pattern, error=TacticError)

    def apply(self, part, ctx: Context):
        hits = _matches(part, self.pattern)
        for v in hits:
            part.replicate(v, source=str(self))
        return part, [f"{len(hits)} input(s) match {self.pattern!r}"]


@dataclass(frozen=True)
class Specs(Tactic):
    """Lay out inputs from a pytree of `PartitionSpec`s a user already has (MaxText-style
    logical rules, flax metadata, an earlier plan): `specs` mirrors argument `arg` (a
    parameter name, e.g. "params") or, with `arg=None`, the whole argument tuple. `None`
    leaves (or subtrees) are left to other tactics."""

    specs: Any
    arg: str | None = None

    def apply(self, part, ctx: Context):
        prog = part.program
        by_name = dict(zip(prog.input_names, prog.inputs))
        leaves = jax.tree_util.tree_flatten_with_path(self.specs, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
        if not leaves:
            raise TacticError("Specs got no PartitionSpec leaves: pass a pytree mirroring the arguments")
        count = 0
        for path, spec in leaves:
            if not isinstance(spec, PartitionSpec):
                raise TacticError(f"Specs leaf at {jax.tree_util.keystr(path)} is {spec!r}, not a PartitionSpec or None")
            if self.arg is not None:
                name = self.arg + jax.tree_util.keystr(path)
            else:
                idx = getattr(path[0], "idx", None)
                if idx is None:
                    raise TacticError(f"Specs without `arg` must mirror the argument tuple; got a {type(self.specs).__name__}")
                name = _arg_name(prog, idx) + jax.tree_util.keystr(path[1:])
            v = by_name.get(name)
            if v is None:
                near = close_names(name, prog.input_names)
                raise TacticError(f"spec for {name!r} matches no input" + (f"; near misses: {', '.join(near)}" if near else ""))
            t = Tiling.from_spec(spec, prog.values[v].rank)
            try:
                for d, axes in enumerate(t.dims):
                    for a in axes:
                        part.tile(v, d, a, source=str(self))
            except PartitioningError as e:
                raise TacticError(f"spec {spec} for {name}: {e}") from e
            count += 1
        return part, [f"{count} input(s) laid out from specs"]

    def __str__(self) -> str:
        return f"Specs(arg={self.arg!r})"


def _arg_name(prog, index: int) -> str:
    for name, a in zip(prog.input_names, prog.input_args):
        if a == index:
            return name.split("[")[0].split(".")[0]
    raise TacticError(f"argument {index} has no array inputs")
