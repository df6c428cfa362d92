"""Collectives of a layout change, with bytes and alpha-beta ring time.

A reshard point `src -> dst` (see `partir.transition`) becomes collectives applied in
this order, the shard size per device tracked along the way (what shrinks the buffer
first, as XLA orders them):

    reduce-scatter    partial over axes dst splits a dim over     B -> B/n
    slice             axes dst splits and src did not             B -> B/n  (free)
    all-reduce        partial over axes dst does not split        buffer B
    collective-permute  a dim trades axes for as many or more     B -> B*m/n
    all-to-all        an axis moves from one dim to another       B
    all-gather        axes src splits and dst does not            B -> B*n

except that a dim which loses some axes and gains others splitting it into fewer blocks
(`P('model') -> P('data')` on `data=2, model=4`) is gathered before it is sliced:
slicing first would leave each device a strided set of blocks, not a shard of the new
layout. Into as many blocks or more, each device receives its new block from a device
whose old block holds it (a collective-permute of the new block, as XLA moves it).

Time on a ring of `n` devices with per-hop latency `alpha` (the slowest link level
among the collective's axes) and per-direction bandwidth `beta`:

    all-reduce      2 (n-1) alpha + 2 (n-1)/n * B / beta
    reduce-scatter    (n-1) alpha +   (n-1)/n * B / beta        (B = operand)
    all-gather        (n-1) alpha +   (n-1)/n * R / beta        (R = result)
    all-to-all        (n-1) alpha +   (n-1)/n * B / beta
    collective-permute      alpha +             R / beta        (R = result)

where `beta` is the bus bandwidth a collective reaches (`LinkModel.bandwidth`): the
link's figure times the device's `collective_efficiency` (NCCL-tests' busbw against the
line rate); a group spanning nodes with `k` members in each runs `k` rings side by side,
one per member's NIC (NCCL's rail-aligned rings), so `k` times the inter-node figure up
to the intra-node one; a group on a TPU torus larger than one side of it runs rings
along as many torus dims as it spans, each with its own links. With the latency, this
is the bus-bandwidth curve of NCCL-tests: small messages pay `alpha` per step. A ring
over a group spanning nodes with `k` members in each crosses nodes only between nodes:
of its steps, those of a ring over the `n / k` nodes pay the inter-node latency and the
rest the intra-node one, as NCCL's tuning model prices a ring (NVIDIA/nccl
src/graph/tuning.cc, `ncclTopoTuneModel`: `(nsteps - nInterSteps) * intraLat +
nInterSteps * interLat`, `nInterSteps` = nodes - 1 for an all-gather or reduce-scatter,
twice that for an all-reduce).

A contraction summed along several dims, each split over axes of its own (a weight's
gradient summed over a batch split over `data` and a sequence split over `context`), is
all-reduced once per dim, over that dim's axes (`per_contracted_dim`): XLA's SPMD
partitioner reduces each partitioned contracting dim in turn (measured on XLA:CPU: two
all-reduces of the whole buffer, over `context` then `data`, where one dim split over
both axes gives one all-reduce).

Gradient reductions over the same axes are combined into one collective per step
(their latency paid once), as XLA's combiner and DDP's buckets do.

`bytes` is the buffer XLA's HLO shows per device: the reduced buffer of an all-reduce,
the result of an all-gather or reduce-scatter, the buffer of an all-to-all. A backend
without a native reduce-scatter (`DeviceSpec.reduce_scatter=False`: XLA:CPU) all-reduces
the whole operand and slices instead, and is costed so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from partir import Kind, Tiling, permuted_dims, transition

from ._device import link_levels


#: Bytes of gradient reductions XLA combines into one collective (its all-reduce
#: combiner's threshold on GPU, `xla_gpu_all_reduce_combine_threshold_bytes`): the
#: gradients of a group are all held until the group's collective runs.
GRADIENT_COMBINE_BYTES = 30 * 2**20


@dataclass(frozen=True, slots=True)
class CollectiveCost:
    """One modeled collective: kind, mesh axes, bytes per device, seconds, where it is
    (op, value), how often it runs per step (loop trips), whether it reduces a gradient
    (it may then overlap the backward pass), the flops of its reduction (one per
    element reduced, as XLA counts them), and the seconds of it that the op issuing it
    hides behind its own compute on a backend that overlaps (`behind`: a ring's
    permutes, `search.cost._rings`)."""

    kind: str
    axes: tuple[str, ...]
    bytes: float
    time: float
    op: int
    value: int
    count: float = 1.0
    gradient: bool = False
    flops: float = 0.0
    behind: float = 0.0  # seconds of each run hidden behind the dot it overlaps (a ring's, `_rings`)


def gradient_groups(grads, region) -> list[list]:
    """Gradient reductions (in op order) in the groups XLA's combiner makes of them: the
    same collectives over the same axes in one computation (a loop body is one of its
    own: a scan's weight gradients are reduced in every trip), up to
    `GRADIENT_COMBINE_BYTES` each. `region[o]` is op o's region."""
    open_groups: dict = {}
    done = []
    for g in grads:
        kind = (region[g[0]],) + tuple((c.kind, c.axes) for c in g[2])
        nbytes = sum(c.bytes for c in g[2])
        group = open_groups.get(kind)
        if group is not None and group[0] + nbytes > GRADIENT_COMBINE_BYTES:
            done.append(group[1])
            group = None
        if group is None:
            group = open_groups[kind] = [0.0, []]
        group[0] += nbytes
        group[1].append(g)
    return done + [g[1] for g in open_groups.values()]


class LinkModel:
    """Per-axis link figures (size, bandwidth, latency) for one mesh on one device."""

    def __init__(self, mesh, device, levels: dict[str, str]):
        self.mesh = mesh
        self.sizes = mesh.sizes()
        self.device = device
        self.levels = levels
        self.placed = link_levels(mesh.axes, device)  # the levels the device layout gives
        self.bw = {a: device.intra_bandwidth if levels[a] == "intra" else device.inter_bandwidth for a in mesh.names}
        self.alpha = {a: device.intra_latency if levels[a] == "intra" else device.inter_latency for a in mesh.names}
        self._bandwidth: dict[tuple, float] = {}

    def bandwidth(self, axes: tuple[str, ...]) -> float:
        """Bus bandwidth (bytes/s per device per direction) of a collective over `axes`
        (module docstring)."""
        bw = self._bandwidth.get(axes)
        if bw is None:
            bw = self._bandwidth[axes] = self._group_bandwidth(axes)
        return bw

    def _group_bandwidth(self, axes) -> float:
        dev = self.device
        n = self.mesh.devices_along(axes)
        if any(self.levels[a] == "inter" for a in axes):
            # An axis said to cross nodes against the layout (a `links` override) has
            # its members on nodes of their own: one ring per group.
            bw = min(dev.intra_bandwidth, self._per_node(axes) * dev.inter_bandwidth)
        else:
            bw = min(self.bw[a] for a in axes)
            if dev.torus_dims and dev.torus_side > 1 and n > dev.torus_side:
                bw *= min(dev.torus_dims, math.ceil(math.log(n) / math.log(dev.torus_side) - 1e-9))
        return bw * dev.collective_efficiency

    def time(self, kind: str, axes: tuple[str, ...], nbytes: float) -> float:
        """Seconds for one collective of `kind` over `axes` moving a buffer of `nbytes`
        (the operand of a reduce-scatter, the result of an all-gather, else the buffer)."""
        n = self.mesh.devices_along(axes)
        if n <= 1:
            return 0.0
        bw = self.bandwidth(axes)
        if kind == Kind.COLLECTIVE_PERMUTE:  # one hop: each device sends its block, receives one
            return self.latency(kind, axes) + nbytes / bw
        traffic = (2.0 if kind == Kind.ALL_REDUCE else 1.0) * (n - 1) / n * nbytes
        return self.latency(kind, axes) + traffic / bw

    def exposed_time(self, cols) -> float:
        """`total_time(cols)` less what each collective's own op hides (`behind`), as a
        backend that overlaps runs them."""
        cols = list(cols)
        return self.total_time(cols) - sum(c.behind * c.count for c in cols)

    def latency(self, kind: str, axes: tuple[str, ...]) -> float:
        """The latency part of one collective: its ring steps, each at the latency of
        the link it crosses (module docstring)."""
        n = self.mesh.devices_along(axes)
        if n <= 1:
            return 0.0
        alpha = max(self.alpha[a] for a in axes)
        steps = _steps(kind, n)
        per_node = self._per_node(axes)
        if kind == Kind.COLLECTIVE_PERMUTE or per_node == 1 or all(self.levels[a] == "intra" for a in axes):
            return steps * alpha
        across = _steps(kind, -(-n // per_node))
        return across * alpha + (steps - across) * self.device.intra_latency

    def _per_node(self, axes) -> int:
        """Members of a group along `axes` on one node, where the group spans nodes as
        the device layout places it (else 1: an axis said to cross nodes against the
        layout has its members on nodes of their own)."""
        if not all(self.levels[a] == self.placed[a] for a in axes):
            return 1
        return _members_per_node(self.mesh, axes, self.device.devices_per_node)

    def total_time(self, cols) -> float:
        """Seconds for collectives `cols` in a step. Gradient reductions over the same
        axes are combined into one collective (XLA's all-reduce combiner, PyTorch's
        gradient buckets): their latency is paid once, their bytes in full."""
        total = 0.0
        combined: dict[tuple, float] = {}
        for c in cols:
            total += c.time * c.count
            if c.gradient:
                key = (c.kind, c.axes)
                combined[key] = combined.get(key, 0.0) + c.count
        for (kind, axes), n in combined.items():
            total -= (n - 1) * self.latency(kind, axes)
        return total

    def reshard(self, src: Tiling, dst: Tiling, full_bytes: float, mesh) -> list[tuple[str, tuple, float, float]]:
        """(kind, axes, bytes, seconds) of each collective turning `src` into `dst` for a
        value of `full_bytes` (unpartitioned)."""
        cur = full_bytes / src.num_shards(self.mesh)
        out = []
        # Size-1 axes move nothing: leave them out of every collective.
        steps = {t.kind: tuple(a for a in t.axes if self.sizes[a] > 1) for t in transition(src, dst, mesh)}
        for kind in _order(src, dst, permuted_dims(src, dst, mesh) if Kind.COLLECTIVE_PERMUTE in steps else {}):
            axes = steps.get(kind)
            if not axes:
                continue
            n = self.mesh.devices_along(axes)
            if kind == Kind.ALL_REDUCE:
                out.append((kind, axes, cur, self.time(kind, axes, cur)))
            elif kind == Kind.REDUCE_SCATTER:
                if self.device.reduce_scatter:
                    out.append((kind, axes, cur / n, self.time(kind, axes, cur)))
                else:
                    out.append((Kind.ALL_REDUCE, axes, cur, self.time(Kind.ALL_REDUCE, axes, cur)))
                cur /= n
            elif kind == "slice":
                cur /= n
            elif kind == Kind.ALL_TO_ALL:
                out.append((kind, axes, cur, self.time(kind, axes, cur)))
            elif kind == Kind.COLLECTIVE_PERMUTE:
                held = {a for dims in src.dims for a in dims}
                cur = cur * self.mesh.devices_along(a for a in axes if a in held) // self.mesh.devices_along(
                    a for dims in dst.dims for a in dims if a in axes)
                out.append((kind, axes, cur, self.time(kind, axes, cur)))
            else:
                cur *= n
                out.append((kind, axes, cur, self.time(kind, axes, cur)))
        return out


def per_contracted_dim(cols, groups, links) -> list:
    """`cols` (`LinkModel.reshard`'s) with an all-reduce over the axes of several
    contracted dims (`groups`: each dim's axes, in the order XLA reduces them) made one
    all-reduce per dim, each of the whole buffer (module docstring)."""
    out = []
    for kind, axes, nbytes, t in cols:
        parts = [tuple(a for a in g if a in axes) for g in groups]
        parts = [p for p in parts if p]
        if kind != Kind.ALL_REDUCE or len(parts) < 2 or {a for p in parts for a in p} != set(axes):
            out.append((kind, axes, nbytes, t))
            continue
        out += [(kind, p, nbytes, links.time(kind, p, nbytes)) for p in parts]
    return out


def _members_per_node(mesh, axes, devices_per_node: int) -> int:
    """How many devices of one group along `axes` share a node (device ids row-major
    over the mesh, last axis fastest, consecutive ids filling a node)."""
    names, sizes = list(mesh.names), mesh.sizes()
    stride, strides = 1, {}
    for a in reversed(names):
        strides[a] = stride
        stride *= sizes[a]
    ids = [0]
    for a in axes:
        ids = [i + j * strides[a] for i in ids for j in range(sizes[a])]
    return max(1, sum(1 for i in ids if i < devices_per_node))


def _steps(kind: str, n: int) -> int:
    """Ring steps of one collective of `kind` over `n` devices."""
    return 1 if kind == Kind.COLLECTIVE_PERMUTE else 2 * (n - 1) if kind == Kind.ALL_REDUCE else n - 1


#: The order of a layout change's collectives: `partir.Kind`'s, what shrinks the buffer first.
ORDER = tuple(Kind)
#: The order when a dim trades axes for fewer blocks: gathered whole, then sliced.
ORDER_SWAP = tuple(k for k in Kind if k is not Kind.SLICE) + (Kind.SLICE,)


def _order(src: Tiling, dst: Tiling, permuted) -> tuple[str, ...]:
    """`ORDER_SWAP` if some dim of `src` loses axes that `dst` does not split it by and
    gains others, not by a collective-permute (the dims `permuted`), else `ORDER`."""
    for dim, (before, after) in enumerate(zip(src.dims, dst.dims)):
        if set(before) - set(after) and set(after) - set(before) and dim not in permuted:
            return ORDER_SWAP
    return ORDER
