"""Values moved round a ring: the data movement of ring attention as a plan records it.

`Partitioning.ring(value, dim, axis)` says that `value`, split along `dim` over `axis`
at rest, reaches the dots that read it whole along `dim` as a ring over `axis` instead
of an all-gather, and that a dot making it partial over `axis` completes it round the
ring instead of by a reduce-scatter. The layouts stay what they are (the plan's
tilings, the ops' factor tilings): only how the shard_map lowering moves the value
changes, and what the cost model charges for it. `ring_moves(part)` names the dots
concerned, which both read:

- a *gather ring* (a collective matmul): a `dot_general` reads a ringed value in a
  layout that is its at-rest one without the ring axis on `dim`. Each of the axis's `n`
  devices computes the dot with the block it holds while passing the block on to the
  next device (`jax.lax.ppermute`), `n` block dots and `n - 1` permutes; no device
  holds more than its block and the one in flight.
- a *scatter ring* (a matmul-reduce-scatter): a `dot_general` makes a ringed value
  partial over the ring axis, and its at-rest layout adds the axis on `dim`. Each
  device computes the contribution of its operands to one block at a time, adds it to
  the partial sum it received and passes that on; after `n - 1` permutes each block's
  sum ends on the device that holds it.

Along `dim` the dot must not batch (its block would pair with another operand's block
of the same dim, which is not a ring); other dots read or make the value as its
layouts say.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._decision import Decision
from ._errors import PartitioningError
from ._propagate import _RNG
from ._tiling import Tiling

#: The kinds of a `RingMove` (module docstring).
RING_KINDS = ("gather", "scatter")


@dataclass(frozen=True)
class RingMove:
    """One dot that moves a ringed value round its ring: op `op` reads (`kind`
    'gather') operand `slot`, or makes (`kind` 'scatter') result `slot`, which is value
    `value`, along its dim `dim` over mesh axis `axis`."""

    op: int
    kind: str
    slot: int
    value: int
    dim: int
    axis: str

    def made(self, produced: Tiling) -> Tiling:
        """The layout a scatter ring makes its value in, from the one the dot makes it in
        (`produced`, partial over the ring axis): split over the axis on `dim`, no longer
        partial over it."""
        dims = tuple(d + (self.axis,) if i == self.dim else d for i, d in enumerate(produced.dims))
        return Tiling(dims, tuple(a for a in produced.partial if a != self.axis), produced.reduce_kind)


class Rings:
    """Mixin of `Partitioning`: the values it moves round rings (module docstring)."""

    def ring(self, value, dim: int, axis: str, *, source: str = "user") -> None:
        """Move `value` round a ring over `axis` along `dim` (module docstring). A
        `PartitioningError`, changing nothing, when `dim` is out of range, `axis` is not
        the last axis splitting `dim` at rest, or the value is ringed already otherwise."""
        prog = self.program
        v = prog.resolve(value)
        val = prog.values[v]
        if not 0 <= dim < val.rank:
            raise PartitioningError(f"cannot ring {prog.name(v)}: dim {dim} is out of range for shape {val.shape}")
        self.mesh.size(axis)  # a clear error for an unknown axis
        dims = self.tiling(v).dims[dim]
        if not dims or dims[-1] != axis:
            raise PartitioningError(f"cannot ring {prog.name(v)} over {axis!r} along dim {dim}: it is split "
                                    f"{dims or 'by no axis'} there at rest; split it over {axis!r} first "
                                    "(constrain it), then ring it")
        self._keep(_RNG, self._rings, v, (dim, axis), Decision("ring", v, dim, axis, source),
                   lambda old: f"cannot ring {prog.name(v)} over {axis!r} along dim {dim}: it is ringed over "
                               f"{old[1]!r} along dim {old[0]} already")
        self._touched_classes.add(self._of[v])  # what reads it is priced anew

    @property
    def rings(self) -> dict[int, tuple[int, str]]:
        """Per ringed value, (dim, mesh axis)."""
        return dict(self._rings)


def ring_moves(part) -> dict[int, RingMove]:
    """The dots of `part` that move a ringed value round its ring, by op id (module
    docstring); empty for a plan without rings."""
    if not part.rings:
        return {}
    prog = part.program
    out = {}
    for v, (dim, axis) in sorted(part.rings.items()):
        if part.mesh.size(axis) < 2:
            continue
        rest = part.tiling(v)
        for o in prog.users[v]:
            k = _read_slot(part, o, v, rest, dim, axis)
            if k is not None:
                out[o] = RingMove(o, "gather", k, v, dim, axis)
        o = prog.producer[v]
        if o >= 0 and _is_dot(prog.ops[o]):
            k = prog.ops[o].results.index(v)
            made = part.produced(v)
            if axis in made.partial and _less(rest, made.dims, dim, axis) and not _batched(prog.ops[o], k, dim, True):
                out[o] = RingMove(o, "scatter", k, v, dim, axis)
    return out


def _is_dot(op) -> bool:
    return op.primitive == "dot_general" and not op.link and op.eqn is not None and op.rule.fixed is None


def _read_slot(part, o: int, v: int, rest: Tiling, dim: int, axis: str) -> int | None:
    """The operand of op `o` that reads `v` whole along `dim` over `axis` and is
    otherwise at rest, when `o` is a dot not batching along it."""
    op = part.program.ops[o]
    if not _is_dot(op) or op.operands.count(v) != 1:
        return None
    k = op.operands.index(v)
    slots, _, _ = part.block_layout(o)
    need = next(d for side, j, _, d in slots if side == "operand" and j == k)
    return k if _less(rest, need, dim, axis) and not _batched(op, k, dim, False) else None


def _less(rest: Tiling, dims: tuple, dim: int, axis: str) -> bool:
    """Is `rest` the layout `dims` with `axis` added last on `dim`?"""
    want = tuple(d + (axis,) if i == dim else d for i, d in enumerate(dims))
    return rest.dims == want


def _batched(op, slot: int, dim: int, result: bool) -> bool:
    """Is `dim` of the dot's operand (or result) `slot` one of its batch dims?"""
    (_, _), (lb, rb) = op.eqn.params["dimension_numbers"]
    if result:
        return dim < len(lb)
    return dim in (lb, rb)[slot]
