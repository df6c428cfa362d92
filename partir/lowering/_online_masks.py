"""One block of a value made from scalars (a causal mask, a fill, a scale), made as a
block: what the blockwise attention (`_online`) applies to one block of scores.

Made whole and then cut, a mask over `[B, H, S, S]` costs a whole `S x S` buffer on
every device, the memory the blockwise attention exists to save. Instead the block is
made from the blocks of what the value is made from, op by op: an iota as the
positions of its block (in the plan's token order, `Reordering`), a broadcast from the
block of its operand's dims, elementwise ops and transposes from their operands'
blocks (`BLOCKWISE`). Any other op makes its value whole and cuts the block from it:
the numbers are the same, only the memory is not saved.

A block is given as one `(start, size)` per dim (`Spec`); starts may be traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._eval import bind_equation

#: Elementwise primitives whose block is the op on its operands' blocks (a rank-0
#: operand as it is).
BLOCKWISE = frozenset({"add", "sub", "mul", "div", "neg", "max", "min", "select_n", "convert_element_type", "eq",
                       "ne", "ge", "gt", "le", "lt", "and", "or", "not", "stop_gradient"})


class BlockConstants:
    """Blocks of values made from scalars for one trace of the interpreter `interp`;
    `whole(v)` the value whole (the fallback)."""

    def __init__(self, interp, whole):
        self.interp, self.whole = interp, whole

    def block(self, v: int, spec: tuple):
        """Value `v`'s block `spec` (one `(start, size)` per dim)."""
        prog = self.interp.prog
        p = prog.producer[v]
        if p < 0 or not prog.values[v].shape:
            return self._cut(v, spec)
        op = prog.ops[p]
        if op.link:
            return self.block(op.operands[0], spec)
        if op.primitive == "iota":
            return self._iota(v, op, spec)
        if op.primitive == "broadcast_in_dim":
            dims = op.eqn.params["broadcast_dimensions"]
            u = op.operands[0]
            if u < 0:
                x = op.eqn.invars[0].val
            else:
                inner = tuple((0, 1) if prog.values[u].shape[k] == 1 else spec[d] for k, d in enumerate(dims))
                x = self.block(u, inner) if inner else self.whole(u)
            return jax.lax.broadcast_in_dim(x, tuple(s for _, s in spec), dims)
        if op.primitive == "transpose":
            perm = op.eqn.params["permutation"]
            inner = [None] * len(perm)
            for d, k in enumerate(perm):
                inner[k] = spec[d]
            return jnp.transpose(self.block(op.operands[0], tuple(inner)), perm)
        if op.primitive in BLOCKWISE and len(op.results) == 1:
            args = [x.val if u < 0 else self.block(u, spec) if prog.values[u].shape else self.whole(u)
                    for x, u in zip(op.eqn.invars, op.operands)]
            return bind_equation(op.eqn, args)[0]
        return self._cut(v, spec)

    def _iota(self, v: int, op, spec):
        """An iota's block: the positions along its dimension from the block's start (the
        permuted ones where the plan reorders the sequence)."""
        params = op.eqn.params
        along = params["dimension"]
        start, size = spec[along]
        order = self.interp.order.iotas.get(v)
        if order is None:
            line = start + jnp.arange(size, dtype=params["dtype"])
        else:
            line = jax.lax.dynamic_slice_in_dim(jnp.asarray(order, params["dtype"]), start, size)
        return jax.lax.broadcast_in_dim(line, tuple(s for _, s in spec), (along,))

    def _cut(self, v: int, spec):
        x = self.whole(v)
        if not x.shape:
            return x
        return jax.lax.dynamic_slice(x, tuple(s for s, _ in spec), tuple(n for _, n in spec))


def tiling_spec(tiling, shape, mesh) -> list:
    """One `(start, size)` per dim of this device's block of a value of `shape` laid out
    as `tiling` (the axes of a dim major to minor, as `PartitionSpec` reads them)."""
    out = []
    for n, axes in zip(shape, tiling.dims):
        index = 0
        for a in axes:
            index = index * mesh.size(a) + jax.lax.axis_index(a)
        size = n // mesh.devices_along(axes)
        out.append((index * size, size))
    return out
