"""A plan's token orders as the lowerings apply them (`partir._order`): the inputs along
a reordered sequence permuted on the way in, the outputs back on the way out, and each
iota counting along it made to hold the permuted positions, whole or as a device's
block (whose iota already counts from the block's offset)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .._order import order_axes, order_sites, token_order


class Reordering:
    """The permutations of one plan (`Partitioning.orders`), per input and output
    position and per iota value."""

    def __init__(self, part):
        prog = part.program
        self.inputs: dict[int, list] = {}
        self.outputs: dict[int, list] = {}
        self.iotas: dict[int, np.ndarray] = {}
        for label, (axis, balance) in sorted(part.orders.items()):
            sites = order_sites(prog, label)
            n = part.mesh.devices_along(order_axes(axis))

            def perm(v, d):
                return token_order(prog.values[v].shape[d], n, balance)

            for k, dims in sites.inputs:
                self.inputs.setdefault(k, []).extend((d, perm(prog.inputs[k], d)) for d in dims)
            for k, dims in sites.outputs:
                self.outputs.setdefault(k, []).extend((d, np.argsort(perm(prog.outputs[k], d))) for d in dims)
            for v, dims in sites.iotas:
                along = prog.ops[prog.producer[v]].eqn.params["dimension"]
                if along in dims:  # an iota is the same along its other dims, in any order
                    self.iotas[v] = perm(v, along)

    def __bool__(self) -> bool:
        return bool(self.inputs or self.outputs or self.iotas)

    def enter(self, leaves) -> list:
        """The program's input leaves, permuted along their reordered dims."""
        return [_take(x, self.inputs.get(k, ())) for k, x in enumerate(leaves)]

    def leave(self, leaves) -> list:
        """The program's output leaves, permuted back to the original order."""
        return [_take(x, self.outputs.get(k, ())) for k, x in enumerate(leaves)]

    def made(self, v: int, x):
        """Value `v` as made (an iota counting along a reordered sequence: the permuted
        positions; anything else as it is)."""
        order = self.iotas.get(v)
        if order is None:
            return x
        return jnp.asarray(order)[x.astype(jnp.int32)].astype(x.dtype)


def _take(x, pairs):
    for d, order in pairs:
        x = jnp.take(x, jnp.asarray(order), axis=d)
    return x
