"""Explicit collectives for a change of layout, inside `jax.shard_map`.

`move(x, src, dst, mesh)` turns `x`, a device's block of a value laid out as `src`
(possibly partial), into its block under `dst`, with one collective per kind that
`transition(src, dst)` names, in the order and on the buffers the cost model charges
(`search._comm.LinkModel.reshard`): reduce-scatter, local slices, all-reduce,
all-to-all, all-gather. Size-1 mesh axes split nothing and are left out, as there.

How: along each dim, the axes both layouts share as a leading run stay as they are
(`keep`); the block they leave is cut by the axes that follow in `src` (`gone`:
gathered or sent away) or in `dst` (`new`: scattered, sliced or received). When a dim
has only one of the two, the local block is viewed as one factor per such axis
(the device's own piece, size 1, or every piece, size n) and a rest; each collective
brings the factors of its axes to the front, runs once over all its axes at once, and
puts them back. A dim with both that `permuted_dims` names (its new axes split it into
a multiple of its old blocks) is moved by one `ppermute` first, each device cutting
from its block the new block of the device it sends to. Another dim with both (an
axis that stays on its dim but behind other axes, or fewer blocks) cannot be
rearranged by one collective of each kind: the value is then gathered to the shared
layout first and cut to `dst` after, which is always right and, into fewer blocks,
what the model charges.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .._mesh import MeshSpec
from .._reshard import Kind, permuted_dims, traded, transition
from .._tiling import Tiling

#: Reduction kind -> the collective that completes a partial value of that kind.
_REDUCERS = {
    "sum": jax.lax.psum,
    "max": jax.lax.pmax,
    "min": jax.lax.pmin,
    "and": lambda x, axes: jax.lax.pmin(x.astype(jnp.uint8), axes).astype(x.dtype),
    "or": lambda x, axes: jax.lax.pmax(x.astype(jnp.uint8), axes).astype(x.dtype),
}


def block_index(axes, mesh: MeshSpec):
    """The index of this device's block of a dim split over `axes` (major to minor), a
    traced scalar inside `shard_map` (0 when `axes` is empty)."""
    index = jnp.int32(0)
    for a in axes:
        index = index * mesh.size(a) + jax.lax.axis_index(a)
    return index


def reduce_all(x, axes, kind: str):
    """`x` reduced over mesh `axes` by the collective of reduction `kind`."""
    if kind == "prod":  # no product collective: gather the factors and multiply locally
        return jnp.prod(jax.lax.all_gather(x, tuple(axes), axis=0, tiled=False), axis=0)
    return _REDUCERS[kind](x, tuple(axes))


def _strip(t: Tiling, sizes: dict) -> Tiling:
    """`t` without its size-1 axes."""
    dims = tuple(tuple(a for a in d if sizes[a] > 1) for d in t.dims)
    return Tiling(dims, tuple(a for a in t.partial if sizes[a] > 1), t.reduce_kind)


def move(x, src: Tiling, dst: Tiling, mesh: MeshSpec, *, again: bool = False):
    """`x` (the local block of a value laid out as `src`) as its block under `dst`.

    `again` marks a move the program already made once (a forward value moved again in
    the backward pass): its collectives then run on a flattened buffer, the same bytes
    in another shape, so that XLA does not merge them with the first move's (JAX gives
    every `shard_map` collective the same channel, which makes equal ones merge)."""
    sizes = mesh.sizes()
    src, dst = _strip(src, sizes), _strip(dst, sizes)
    if src == dst:
        return x
    permuted = permuted_dims(src, dst, mesh)
    if permuted:
        return _move_permuting(x, src, dst, mesh, permuted, again)
    keeps = [len(s) - len(traded(s, d)[0]) for s, d in zip(src.dims, dst.dims)]  # the shared leading runs
    if any(len(s) > k and len(d) > k for s, d, k in zip(src.dims, dst.dims, keeps)):
        shared = Tiling(tuple(s[:k] for s, k in zip(src.dims, keeps)))
        return move(move(x, src, shared, mesh, again=again), shared, dst, mesh, again=again)
    return _Factors(x, src, dst, keeps, mesh, again).run()


def _move_permuting(x, src: Tiling, dst: Tiling, mesh: MeshSpec, permuted: dict, again: bool):
    """`move` for a change in which dims trade axes by a collective-permute: the new
    axes the value is partial over are all-reduced, each such dim permuted, then the
    rest moved."""
    new = {a for _, gained in permuted.values() for a in gained}
    summed = tuple(a for a in src.partial if a in new)
    if summed:
        x = reduce_all(x, summed, src.reduce_kind)
    for dim, (gone, gained) in permuted.items():
        x = _permute(x, dim, gone, gained, mesh, again)
    dims = tuple(dst.dims[d] if d in permuted else axes for d, axes in enumerate(src.dims))
    partial = tuple(a for a in src.partial if a not in new)
    return move(x, Tiling(dims, partial, src.reduce_kind if partial else "sum"), dst, mesh, again=again)


def _permute(x, dim: int, gone: tuple, gained: tuple, mesh: MeshSpec, again: bool):
    """This device's block of dim `dim` split over `gained` (after shared leading axes)
    instead of `gone`: each device cuts, from its old block, the new block of the
    device it sends to; one collective-permute over the axes of both."""
    axes = tuple(a for a in mesh.names if a in set(gone) | set(gained))
    coords = list(itertools.product(*(range(mesh.size(a)) for a in axes)))

    def index(c, over):  # block index of device coords `c` over axes `over`, major first
        i = 0
        for a in over:
            i = i * mesh.size(a) + c[axes.index(a)]
        return i

    ratio = mesh.devices_along(gained) // mesh.devices_along(gone)
    wanted: dict[int, list] = {}  # old block -> (receiver, piece of it)
    for r, c in enumerate(coords):
        wanted.setdefault(index(c, gained) // ratio, []).append((r, index(c, gained) % ratio))
    held: dict[int, list] = {}  # old block -> senders holding it
    for r, c in enumerate(coords):
        held.setdefault(index(c, gone), []).append(r)
    pairs, piece = [], [0] * len(coords)
    for block, receivers in wanted.items():
        for (receiver, k), sender in zip(receivers, held[block]):
            pairs.append((sender, receiver))
            piece[sender] = k
    n = x.shape[dim] // ratio
    y = jax.lax.dynamic_slice_in_dim(x, jnp.asarray(piece, jnp.int32)[block_index(axes, mesh)] * n, n, axis=dim)
    if again:  # a flat buffer, so that XLA does not merge it with the first move's
        return jax.lax.ppermute(y.reshape(-1), axes, perm=pairs).reshape(y.shape)
    return jax.lax.ppermute(y, axes, perm=pairs)


class _Factors:
    """A local block viewed as factors (see the module docstring): `labels[i]` is
    `(dim, axis)` for an axis's factor or `(dim, None)` for a dim's rest."""

    def __init__(self, x, src: Tiling, dst: Tiling, keeps, mesh: MeshSpec, again: bool = False):
        self.src, self.dst, self.mesh, self.again = src, dst, mesh, again
        self.out_shape = tuple(n * mesh.devices_along(s) // mesh.devices_along(d)
                               for n, s, d in zip(x.shape, src.dims, dst.dims))
        labels, shape = [], []
        for dim, (n, s, d, k) in enumerate(zip(x.shape, src.dims, dst.dims, keeps)):
            gone, new = s[k:], d[k:]
            for a in gone:
                labels.append((dim, a)), shape.append(1)
            for a in new:
                labels.append((dim, a)), shape.append(mesh.size(a))
            labels.append((dim, None)), shape.append(n // mesh.devices_along(new))
        self.labels = labels
        self.x = x.reshape(shape)

    def run(self):
        steps = {t.kind: t.axes for t in transition(self.src, self.dst, self.mesh)}
        kind = self.src.reduce_kind
        place = {a: dim for dim, axes in enumerate(self.dst.dims) for a in axes}
        if Kind.REDUCE_SCATTER in steps:
            axes = steps[Kind.REDUCE_SCATTER]
            at = [(place[a], a) for a in axes]
            if kind == "sum":
                self._front(at, lambda y: jax.lax.psum_scatter(y, axes, scatter_dimension=0, tiled=True))
            else:  # no scattering collective for this kind: reduce whole, keep one's piece
                self.x = self._flat(self.x, lambda y: reduce_all(y, axes, kind))
                self._front(at, lambda y: self._own(y, axes), collective=False)
        if Kind.SLICE in steps:
            axes = steps[Kind.SLICE]
            self._front([(place[a], a) for a in axes], lambda y: self._own(y, axes), collective=False)
        if Kind.ALL_REDUCE in steps:
            self.x = self._flat(self.x, lambda y: reduce_all(y, steps[Kind.ALL_REDUCE], kind))
        if Kind.ALL_TO_ALL in steps:
            self._all_to_all(steps[Kind.ALL_TO_ALL], place)
        if Kind.ALL_GATHER in steps:
            axes = steps[Kind.ALL_GATHER]
            at = [(dim, a) for dim, dims in enumerate(self.src.dims) for a in dims if a in axes]
            at.sort(key=lambda label: axes.index(label[1]))
            self._front(at, lambda y: jax.lax.all_gather(y, axes, axis=0, tiled=True))
        return self.x.reshape(self.out_shape)

    def _own(self, y, axes):
        """This device's piece of a front dim that runs over `axes`."""
        return jax.lax.dynamic_slice_in_dim(y, block_index(axes, self.mesh), 1, axis=0)

    def _front(self, labels, fn, collective: bool = True) -> None:
        """Run `fn` on the factors `labels` merged (in that order) into a leading dim, and
        put what it returns back in their places; a `collective` is run flattened when
        the move is made again (`_flat`), a slice (this device's piece) as it is."""
        idx = [self.labels.index(label) for label in labels]
        perm = idx + [i for i in range(len(self.labels)) if i not in idx]
        y = jnp.transpose(self.x, perm)
        rest = y.shape[len(idx):]
        y = y.reshape((-1,) + rest)
        y = self._flat(y, fn) if collective else fn(y)
        n = y.shape[0]
        sizes = _split_sizes(n, [self.mesh.size(a) for _, a in labels])
        y = y.reshape(tuple(sizes) + rest)
        self.x = jnp.transpose(y, np.argsort(perm))

    def _flat(self, y, collective):
        """`collective(y)`, run on `y` flattened for a move made again."""
        if not self.again or y.ndim <= 1:
            return collective(y)
        out = collective(y.reshape(-1))
        return out.reshape((-1,) + y.shape[1:])

    def _all_to_all(self, axes, place) -> None:
        """Send the pieces of each axis's dim in `dst` to their owners and receive one's
        pieces of its dim in `src` from them, in one collective over all `axes`."""
        at_src = {a: dim for dim, dims in enumerate(self.src.dims) for a in dims}
        self._front([(place[a], a) for a in axes],
                    lambda y: jax.lax.all_to_all(y, axes, 0, 0, tiled=True))
        # What arrived is indexed by the sender: it belongs at each axis's factor of its
        # dim in `src` (size 1 so far), which trades places with its factor in `dst`.
        for a in axes:
            i, j = self.labels.index((place[a], a)), self.labels.index((at_src[a], a))
            self.x = jnp.swapaxes(self.x, i, j)


def _split_sizes(n: int, full: list[int]) -> list[int]:
    """The per-factor sizes of a merged front dim of size `n` over factors of full sizes
    `full`: all of them whole (n = their product) or all one piece (n = 1)."""
    if n == 1:
        return [1] * len(full)
    assert n == math.prod(full), (n, full)
    return full
