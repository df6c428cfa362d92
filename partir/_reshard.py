"""What a change of layout costs in collectives.

`transition(src, dst, mesh)` lists the collectives that turn a value laid out as `src`
(possibly partial) into `dst`, one per kind, each over a set of mesh axes:

- partial over an axis that `dst` splits a dim over: reduce-scatter;
- partial over an axis that `dst` does not use: all-reduce;
- an axis splitting one dim in `src` and another dim in `dst`: all-to-all;
- an axis splitting a dim in `src` and nothing in `dst`: all-gather;
- an axis splitting a dim in `dst` only: a local slice (no communication).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._mesh import MeshSpec
from ._tiling import Tiling

#: Collective kinds, in the order they are applied and reported.
KINDS = ("all-reduce", "reduce-scatter", "all-to-all", "all-gather", "slice")


@dataclass(frozen=True, slots=True)
class Transition:
    """One collective of a layout change: its kind and the mesh axes it runs over."""

    kind: str
    axes: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.kind}({', '.join(self.axes)})"


def _place(t: Tiling) -> dict[str, tuple[int, tuple[str, ...]]]:
    # axis -> (dim, the axes before it on that dim): an axis keeps its blocks only if it
    # stays on the same dim behind the same major axes.
    out = {}
    for d, axes in enumerate(t.dims):
        for i, a in enumerate(axes):
            out[a] = (d, axes[:i])
    return out


def transition(src: Tiling, dst: Tiling, mesh: MeshSpec) -> list[Transition]:
    """The collectives that turn `src` into `dst` (empty when they are equal)."""
    if src == dst:
        return []
    s, d = _place(src), _place(dst)
    by_kind: dict[str, set[str]] = {}
    for a in src.partial:
        by_kind.setdefault("reduce-scatter" if a in d else "all-reduce", set()).add(a)
    for a, (dim, before) in s.items():
        if a not in d:
            by_kind.setdefault("all-gather", set()).add(a)
        elif d[a][0] != dim:
            by_kind.setdefault("all-to-all", set()).add(a)
        elif d[a][1] != before:
            by_kind.setdefault("all-gather", set()).add(a)
            by_kind.setdefault("slice", set()).add(a)
    for a in d:
        if a not in s and a not in src.partial:
            by_kind.setdefault("slice", set()).add(a)
    order = mesh.names
    return [Transition(k, tuple(a for a in order if a in by_kind[k])) for k in KINDS if k in by_kind]
