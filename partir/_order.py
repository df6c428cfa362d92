"""A permuted token order: the sequence laid out so that a causal attention split along
it gives every device the same work.

Split into contiguous blocks, a causal sequence gives the device holding the last block
the most unmasked scores and the first the least. Load balancing lays the tokens out in
another order before splitting (`token_order`):

- 'zigzag': the sequence in `2 n` chunks, device `i` holding chunks `i` and `2 n - 1 - i`
  (Megatron/NeMo context parallelism);
- 'striped': device `i` holding tokens `i, i + n, i + 2 n, ...` (striped attention).

The program then computes on the permuted sequence: the inputs along it are permuted
on the way in and the outputs along it back on the way out, and every iota along it
(the positions that rotary tables and causal masks are made of) holds the permuted
positions, so the numbers are the unsplit program's. That holds when every op that
reads or makes a dim of the sequence commutes with permuting it (`order_sites` checks
each op, before any work, and names the first that does not: a slice, a shift, a
cumulative sum, a constant laid out along the sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._decision import Decision
from ._errors import PartitioningError
from ._propagate import _ORD

#: The token orders a sequence split can be balanced with (module docstring).
BALANCES = ("zigzag", "striped")

#: Ops whose numbers depend on where along a dim each element is, though their factor
#: rules leave that dim free: an index into the dim, a running total along it, random
#: bits drawn per position.
ORDER_SENSITIVE = frozenset({"argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "sort",
                             "top_k", "rng_bit_generator", "random_bits", "rng_uniform"})

#: Ops that make a dim of the sequence from nothing along it: an iota (permuted where it
#: is made), a broadcast (the same along the new dim, in any order).
SOURCES = frozenset({"iota", "broadcast_in_dim"})


def token_order(length: int, parts: int, balance: str) -> np.ndarray:
    """`order[p]`: the original position of the token the permuted sequence holds at `p`,
    for a sequence of `length` split into `parts` contiguous blocks."""
    if balance not in BALANCES:
        raise PartitioningError(f"unknown balance {balance!r}; choose one of {', '.join(BALANCES)}")
    chunks = 2 * parts if balance == "zigzag" else parts
    if length % chunks:
        raise PartitioningError(f"balance={balance!r} over {parts} devices needs a sequence length divisible by "
                                f"{chunks}; {length} is not")
    if balance == "striped":
        return np.concatenate([np.arange(i, length, parts) for i in range(parts)])
    pieces = np.arange(length).reshape(chunks, length // chunks)
    return np.concatenate([np.concatenate([pieces[i], pieces[chunks - 1 - i]]) for i in range(parts)])


def order_axes(axis) -> tuple[str, ...]:
    """The mesh axes a token order is made for, major first, from the `axis` a
    `Partitioning.reorder` took: one name, or a tuple (or a plan file's list) of them."""
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _extends(axes: tuple[str, ...], before: tuple[str, ...]) -> bool:
    """Whether an order for `axes` extends one for `before`: the same leading axes, more
    of them."""
    return len(axes) > len(before) and axes[:len(before)] == before


@dataclass(frozen=True)
class OrderSites:
    """Where a permuted sequence (one class of `partir.dim_classes`) meets the program:
    `inputs` and `outputs` as (position among the program's inputs or outputs, dims),
    `iotas` as (value, dims): the dims of each along the sequence."""

    inputs: tuple[tuple[int, tuple[int, ...]], ...]
    outputs: tuple[tuple[int, tuple[int, ...]], ...]
    iotas: tuple[tuple[int, tuple[int, ...]], ...]


def order_sites(program, label: int) -> OrderSites:
    """The sites of the sequence `label` (a class of `partir.dim_classes`), checked to
    commute with a permutation of it: a `PartitioningError` names the first op that
    does not. Kept with the program."""
    return program.analysis(_order_sites, label)


def _order_sites(program, label: int) -> OrderSites:
    from ._attention import dim_classes

    classes = dim_classes(program)

    def dims(v: int) -> tuple[int, ...]:
        return classes.dims_in(v, program.values[v].rank, label) if v >= 0 else ()

    iotas = []
    for op in program.ops:
        reads = [dims(u) for u in op.operands]
        makes = [dims(r) for r in op.results]
        if not any(reads) and not any(makes):
            continue
        _check_op(program, op, reads, makes)
        if op.primitive == "iota" and makes[0]:
            iotas.append((op.results[0], makes[0]))
    consts = [v for r in program.regions for v in r.constvars if dims(v)]
    if consts:
        raise PartitioningError(f"a balanced token order cannot permute {program.name(consts[0])}, a constant laid "
                                "out along the sequence: make it in the step (from iotas) or leave balance=None")
    inputs = tuple((k, dims(v)) for k, v in enumerate(program.inputs) if dims(v))
    outputs = tuple((k, dims(v)) for k, v in enumerate(program.outputs) if dims(v))
    return OrderSites(inputs, outputs, tuple(iotas))


def _check_op(program, op, reads, makes) -> None:
    """Raise unless `op` commutes with permuting the sequence dims it reads (`reads`,
    per operand) and makes (`makes`, per result)."""
    if op.link:
        return  # a value crossing a region boundary, the same on both sides

    def where() -> str:  # named only for an error: naming every op of a deep program takes long
        return program.name(next(v for v in (*op.results, *op.operands) if v >= 0))

    if op.primitive in ORDER_SENSITIVE:
        raise PartitioningError(f"a balanced token order cannot permute the sequence through {op.primitive} "
                                f"making {where()}: its numbers depend on positions along it; leave balance=None")
    if op.rule.fixed is not None:
        raise PartitioningError(f"a balanced token order cannot permute the sequence through {where()}, a region "
                                "partitioned by hand (shard_map); leave balance=None")
    if not any(reads) and op.primitive not in SOURCES:
        raise PartitioningError(f"a balanced token order cannot permute {where()}: {op.primitive} makes a dim along "
                                "the sequence from nothing along it; leave balance=None")
    rule = op.rule
    seq = set()
    for vals, specs, found in ((op.operands, rule.operands, reads), (op.results, rule.results, makes)):
        for v, spec, ds in zip(vals, specs, found):
            for d in ds:
                if len(spec[d]) != 1 or spec[d][0] in rule.blocked:
                    raise PartitioningError(
                        f"a balanced token order cannot permute the sequence through {op.primitive} making {where()} "
                        "(it slices, shifts, pads or merges the sequence dim); leave balance=None")
                seq.add(spec[d][0])
    for specs in (rule.operands, rule.results):
        for spec in specs:
            if any(len(fs) > 1 and seq & set(fs) for fs in spec):
                raise PartitioningError(f"a balanced token order cannot permute the sequence through {op.primitive} "
                                        f"making {where()}: it merges the sequence dim with another; leave "
                                        "balance=None")


class Orders:
    """Mixin of `Partitioning`: the token orders its sequences are laid out in."""

    def reorder(self, value, dim: int, axis, order: str, *, source: str = "user") -> None:
        """Lay out the sequence that `dim` of `value` runs along (its class of
        `partir.dim_classes`) in the token `order` (`partir.BALANCES`) for a split over
        `axis`, a mesh axis or a tuple of them, major first (a sequence split over
        several axes, e.g. context parallelism over two: the order is made for all
        their devices, so each holds its share of the work): the lowerings permute the
        inputs and iotas along it and the outputs back (`partir._order`), so the
        numbers stay the program's. A `PartitioningError`, changing nothing, when an op
        does not commute with the permutation, the sequence length does not fit the
        order, or the sequence already has another, but for fewer of these axes (the
        leading ones), which this one then replaces: a sequence split over one more
        axis is balanced again for all of them."""
        from ._attention import dim_classes

        prog = self.program
        v = prog.resolve(value)
        val = prog.values[v]
        if not 0 <= dim < val.rank:
            raise PartitioningError(f"cannot reorder {prog.name(v)}: dim {dim} is out of range for shape {val.shape}")
        axes = order_axes(axis)
        if not axes or len(set(axes)) != len(axes):
            raise PartitioningError(f"cannot reorder {prog.name(v)} over {axis!r}: give a mesh axis, or a tuple of "
                                    "distinct mesh axes for a sequence split over several")
        # A clear error for an unknown axis or a length the order does not fit.
        token_order(val.shape[dim], self.mesh.devices_along(axes), order)
        label = dim_classes(prog).label(v, dim)
        order_sites(prog, label)
        self._keep(_ORD, self._orders, label, (axis, order), Decision("reorder", v, dim, axis, source, order=order),
                   lambda old: f"cannot reorder {prog.name(v)} dim {dim} {order!r} over {axis!r}: its sequence is "
                               f"already laid out {old[1]!r} over {old[0]!r}",
                   replaces=lambda old: _extends(axes, order_axes(old[0])))

    def _unorder(self, entry, h: int) -> int:
        """Undo the token order that log `entry` set (putting back the one it replaced,
        if any); the key `h` updated."""
        _, label, old = entry
        h ^= hash((_ORD, label, self._orders.pop(label)))
        if old is not None:
            self._orders[label] = old
            h ^= hash((_ORD, label, old))
        return h

    @property
    def orders(self) -> dict[int, tuple]:
        """Per reordered sequence (a class of `partir.dim_classes`), (axis, balance): the
        axis as `reorder` took it (a name, or a tuple of names; `order_axes`)."""
        return dict(self._orders)
