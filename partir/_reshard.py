"""What a change of layout costs in collectives.

`transition(src, dst, mesh)` lists the collectives that turn a value laid out as `src`
(possibly partial) into `dst`, one per kind, each over a set of mesh axes:

- partial over an axis that `dst` splits a dim over: reduce-scatter;
- partial over an axis that `dst` does not use: all-reduce;
- an axis splitting one dim in `src` and another dim in `dst`: all-to-all;
- an axis splitting a dim in `src` and nothing in `dst`: all-gather;
- an axis splitting a dim in `dst` only: a local slice (no communication);
- a dim that trades the axes after its shared leading ones for others splitting it
  into as many blocks or more (`P('data') -> P('model')` on a mesh `data=2, model=4`):
  a collective-permute of the new blocks, each cut from the old block that holds it,
  as XLA's partitioner moves it (after all-reducing any of the new axes the value is
  partial over). Traded for fewer blocks, the dim is gathered whole and sliced.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ._mesh import MeshSpec
from ._tiling import Tiling


class Kind(enum.StrEnum):
    """What a layout change runs: the one list of collective kinds (and the local slice),
    in the order they run, what shrinks the buffer first. Strings as XLA's HLO names
    them, so a `Kind` compares equal to the name."""

    REDUCE_SCATTER = "reduce-scatter"
    SLICE = "slice"  # each device keeps its block: no communication
    ALL_REDUCE = "all-reduce"
    COLLECTIVE_PERMUTE = "collective-permute"
    ALL_TO_ALL = "all-to-all"
    ALL_GATHER = "all-gather"

    @property
    def communicates(self) -> bool:
        """Does it move data between devices (every kind but the slice)?"""
        return self is not Kind.SLICE


@dataclass(frozen=True, slots=True)
class Transition:
    """One collective of a layout change: its kind and the mesh axes it runs over."""

    kind: Kind
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
    by_kind: dict[Kind, set[str]] = {}
    permuted = {a for gone, new in permuted_dims(src, dst, mesh).values() for a in gone + new}
    # A partial axis that splits a dim which trades axes is reduced whole first: scattered
    # there, each device would hold a strided set of blocks.
    trading = {dim for dim, (before, after) in enumerate(zip(src.dims, dst.dims)) if all(traded(before, after))}
    for a in src.partial:
        scatter = a in d and d[a][0] not in trading
        by_kind.setdefault(Kind.REDUCE_SCATTER if scatter else Kind.ALL_REDUCE, set()).add(a)
    if permuted:
        by_kind[Kind.COLLECTIVE_PERMUTE] = permuted
    for a, (dim, before) in s.items():
        if a in permuted:
            continue
        if a not in d:
            by_kind.setdefault(Kind.ALL_GATHER, set()).add(a)
        elif d[a][0] != dim:
            by_kind.setdefault(Kind.ALL_TO_ALL, set()).add(a)
        elif d[a][1] != before:
            by_kind.setdefault(Kind.ALL_GATHER, set()).add(a)
            by_kind.setdefault(Kind.SLICE, set()).add(a)
    for a in d:
        if a not in s and a not in src.partial and a not in permuted:
            by_kind.setdefault(Kind.SLICE, set()).add(a)
    order = mesh.names
    return [Transition(k, tuple(a for a in order if a in by_kind[k])) for k in Kind if k in by_kind]


def traded(before: tuple, after: tuple) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A dim's axes `before` and `after` past the leading run they share: those it
    loses and those it gains (major to minor)."""
    k = 0
    while k < min(len(before), len(after)) and before[k] == after[k]:
        k += 1
    return before[k:], after[k:]


def permuted_dims(src: Tiling, dst: Tiling, mesh: MeshSpec) -> dict[int, tuple[tuple[str, ...], tuple[str, ...]]]:
    """The dims that `src -> dst` moves by a collective-permute, each with the axes it
    loses and gains (see `traded`): the gained ones (used by no other dim of either
    layout, as the lost ones) split it into a multiple of as many blocks, so each new
    block lies within one old one. Size-1 axes split nothing and are left out."""
    def real(axes):
        return tuple(a for a in axes if mesh.size(a) > 1)

    out = {}
    for dim, (before, after) in enumerate(zip(src.dims, dst.dims)):
        gone, new = traded(real(before), real(after))
        if not gone or not new or mesh.devices_along(new) % mesh.devices_along(gone):
            continue
        elsewhere = {a for t in (src, dst) for j, axes in enumerate(t.dims) if j != dim for a in axes}
        if not (set(gone) | set(new)) & elsewhere:
            out[dim] = (gone, new)
    return out


def gathered_first(src: Tiling, dst: Tiling, mesh: MeshSpec) -> Tiling | None:
    """The layout `src -> dst` passes through where a dim trades axes for fewer blocks
    (gathered to the axes it keeps, then sliced: see `transition`), else None. A
    lowering that leaves the move to XLA states it, or XLA permutes blocks to groups
    of devices and gathers within them, which the model does not charge."""
    permuted = permuted_dims(src, dst, mesh)
    dims, cut = [], False
    for dim, (before, after) in enumerate(zip(src.dims, dst.dims)):
        gone, new = traded(before, after)
        if gone and new and dim not in permuted:
            before, cut = before[:len(before) - len(gone)], True
        dims.append(before)
    return Tiling(tuple(dims)) if cut else None
