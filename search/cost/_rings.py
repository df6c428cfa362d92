"""What a ring costs (`partir.ring_moves`: context parallelism's `strategy='ring'`).

A dot that reads a value round a ring over `n` devices (a gather ring) or completes
it round one (a scatter ring) moves it by `n - 1` collective-permutes of one block
each, the block of the value at rest (the shard the ring rotates, or the partial sum
it passes on), where the layouts alone would all-gather or reduce-scatter it. The
compiled program holds those permutes one by one, and so does the model.

Each permute runs beside one block of the dot (the dot's time over `n`): on a
backend that overlaps (`DeviceSpec.overlap`), a permute's seconds up to the block's
hide behind it, and a ring exposes `max(0, permute - block)` per step plus one step's
latency (the first block's send starts with the ring, and nothing hides its start).
The block's time is the dot's matmul roofline on its shards (the fused attention
kernel's rate where the device runs one). XLA:CPU runs collectives in line: nothing
hides there.

Memory: no gathered (or whole partial) buffer, but `RING_BLOCKS` blocks beside the
value's own shard while the ring runs.
"""

from __future__ import annotations

from partir import Kind, Reshard

from ._comm import CollectiveCost

#: Blocks a ring holds beyond the value's own shard: the one it computes with (or the
#: partial sum it adds to) and the one in flight.
RING_BLOCKS = 2


def ring_signature(ring) -> tuple | None:
    """What of a `partir.RingMove` an op's price depends on (the op's memo key), or None."""
    return None if ring is None else (ring.kind, ring.slot, ring.dim, ring.axis)


def is_ring_reshard(ring, r) -> bool:
    """Is reshard point `r` the move that `ring` makes instead?"""
    side = "operand" if ring.kind == "gather" else "result"
    return r.side == side and r.index == ring.slot


def ring_collectives(model, o: int, ring, r, div: float, eff: float):
    """(collectives, buffer bytes, reshard left) of dot `o` moving value `r.value` round
    `ring` instead of reshard point `r`: the `n - 1` permutes, the blocks the ring holds,
    and what of `r` the ring does not do (a result partial over other axes too), or
    None. `div` is the number of devices the dot's work is split over, `eff` its matmul
    efficiency on its shards."""
    part, dev = model.part, model.device
    mesh = part.mesh
    n = mesh.size(ring.axis)
    axes = (ring.axis,)
    block = float(model._nbytes[r.value]) / part.tiling(r.value).num_shards(mesh)
    t = model.links.time(Kind.COLLECTIVE_PERMUTE, axes, block)
    flops = float(model._flops[o] + model._trans[o]) / div / n
    if model._kernel[o]:
        step = flops * float(model._kernel_work[o]) / (model._peak[o] * dev.attention_efficiency)
    else:
        step = flops / (model._peak[o] * eff * dev.matmul_efficiency)
    # Per permute: what the block dot hides, less a share of the one latency a ring exposes.
    behind = max(0.0, min(t, step) - model.links.latency(Kind.COLLECTIVE_PERMUTE, axes) / (n - 1))
    cols = tuple(CollectiveCost(Kind.COLLECTIVE_PERMUTE, axes, block, t, o, r.value, float(model._mult[o]),
                                behind=behind) for _ in range(n - 1))
    left = None
    if ring.kind == "scatter":
        made = ring.made(r.src)
        if made != r.dst:
            left = Reshard(r.op, r.value, r.side, r.index, made, r.dst)
    return cols, RING_BLOCKS * block, left
