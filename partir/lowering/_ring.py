"""The rings of a plan (`partir.ring_moves`) as each device runs them in the shard_map
lowering: a dot that reads a value whole along a dim split over a mesh axis, or makes
it partial over that axis, computed block by block while the blocks (or the partial
sums) travel round the axis with `jax.lax.ppermute`.

Both rings send to the next device of the axis (device `i` to `i + 1`, the last to the
first): after `s` sends a device holds the block that started `s` devices before it.
Each send is issued before the block dot it overlaps, so XLA may run the dot while the
block is in flight. The results are those of the dot on the gathered operand (or of
the dot followed by a reduce-scatter), the block sums taken in another order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._eval import bind_equation


def _next(x, axis: str, n: int, again: bool = False):
    """`x` sent to the next device of `axis` (of `n` devices), the last's to the first.
    `again`: as a flat buffer, the same bytes in another shape, so that XLA does not
    merge the send with an equal one of the forward pass (`_spmd.move`'s `again`)."""
    perm = [(i, (i + 1) % n) for i in range(n)]
    if again:
        return jax.lax.ppermute(x.reshape(-1), axis, perm).reshape(x.shape)
    return jax.lax.ppermute(x, axis, perm)


def _free_position(dn, slot: int, dim: int, ranks: tuple[int, int]) -> int:
    """The result dim of a `dot_general` (dimension numbers `dn`, operand ranks
    `ranks`) that free dim `dim` of operand `slot` becomes: batch dims first, then the
    lhs's free dims, then the rhs's."""
    (lc, rc), (lb, rb) = dn
    free = [[d for d in range(ranks[k]) if d not in (lc, rc)[k] and d not in (lb, rb)[k]] for k in (0, 1)]
    return len(lb) + (0 if slot == 0 else len(free[0])) + free[slot].index(dim)


def gather_ring(eqn, operands: list, slot: int, dim: int, axis: str, n: int, again: bool = False):
    """The result of dot `eqn` on `operands`, where operand `slot` is given as this
    device's block along `dim` of the operand the dot reads whole over `axis` (`n`
    devices); `again` for a forward value the backward pass rotates again (`_next`). Along a contracted dim, the other operand's matching block of that dim is
    taken and the block products summed; along a free dim, each block's product is put
    where its block sits in the result."""
    dn = eqn.params["dimension_numbers"]
    contracting = dn[0][slot]
    me = jax.lax.axis_index(axis)
    block, size = operands[slot], operands[slot].shape[dim]
    other = operands[1 - slot]
    pos = None if dim in contracting else _free_position(dn, slot, dim, (operands[0].ndim, operands[1].ndim))
    out = None
    for s in range(n):
        held = (me - s) % n  # whose block this device holds after s sends
        sent = _next(block, axis, n, again) if s + 1 < n else None
        args = list(operands)
        args[slot] = block
        if pos is None:
            other_dim = dn[0][1 - slot][contracting.index(dim)]
            args[1 - slot] = jax.lax.dynamic_slice_in_dim(other, held * size, size, other_dim)
            (part,) = bind_equation(eqn, args)
            out = part if out is None else out + part
        else:
            (part,) = bind_equation(eqn, args)
            if out is None:
                shape = list(part.shape)
                shape[pos] *= n
                out = jnp.zeros(shape, part.dtype)
            out = jax.lax.dynamic_update_slice_in_dim(out, part, held * size, pos)
        block = sent
    return out


def scatter_ring(eqn, operands: list, dim: int, axis: str, n: int):
    """This device's block along result dim `dim`, split over `axis` (`n` devices), of
    the sum over `axis` of dot `eqn`'s results on `operands`: the partial sum of one
    block at a time travels round the ring, each device adding its operands' part of
    that block, and ends on the device that holds the block."""
    dn = eqn.params["dimension_numbers"]
    ranks = (operands[0].ndim, operands[1].ndim)
    slot, src = next((k, d) for k in (0, 1) for d in range(ranks[k])
                     if d not in dn[0][k] and d not in dn[1][k] and _free_position(dn, k, d, ranks) == dim)
    size = operands[slot].shape[src] // n
    me = jax.lax.axis_index(axis)

    def part(block):
        args = list(operands)
        args[slot] = jax.lax.dynamic_slice_in_dim(operands[slot], block * size, size, src)
        return bind_equation(eqn, args)[0]

    # Step s adds the part of block (me - s - 1) mod n: the sum started by device b + 1
    # for block b has passed every device when it reaches b, after n - 1 sends.
    acc = part((me - 1) % n)
    for s in range(1, n):
        mine = part((me - s - 1) % n)
        acc = _next(acc, axis, n) + mine
    return acc


def run_ring(ring, eqn, operands: list, mesh, again: bool = False) -> list:
    """The results of dot `eqn` as `ring` (a `partir.RingMove`) moves its value: read
    as this device's block at rest ('gather'), or made as its block of the sum over the
    ring axis ('scatter', `RingMove.made`). `again`: the read is of a forward value in
    the backward pass (`_next`)."""
    n = mesh.size(ring.axis)
    if ring.kind == "gather":
        return [gather_ring(eqn, operands, ring.slot, ring.dim, ring.axis, n, again)]
    return [scatter_ring(eqn, operands, ring.dim, ring.axis, n)]

