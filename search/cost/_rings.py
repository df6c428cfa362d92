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

from partir import Kind, OnlineAcrossScans, Reshard, Unmatched, online_attentions, online_reason

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


# -- blockwise attention (online softmax) ---------------------------------------------------
#: Score blocks (`[.., S/n, .., S/n]`) a blockwise attention holds at once where the
#: backend runs its steps in order: the backward's recomputed logits and weights, the
#: weights' gradient and the scores' (the forward holds fewer).
ONLINE_BLOCKS = 4
#: Rows of score blocks (`n` blocks each) a blockwise attention's backward holds at once
#: on a breadth-first backend, which runs its `n` steps together: the weights' gradient
#: and the scores' of every step (measured on XLA:CPU, GPT at 512 tokens over 4 and 8
#: devices: 4.3 rows of temporaries for two layers, one row of kept weights each).
BREADTH_FIRST_ROWS = 2


class OnlineMemory:
    """What the shard_map lowering's blockwise attentions (`partir.online_attentions`)
    keep, for `CostModel` (`backend='shard_map'`): per attention the plan runs
    blockwise (`partir.online_reason`), the program's score-shaped values are no
    buffer; the row sums stand for the saved log-sum-exp (same shape, same life from
    the forward pass to the backward); `dO V^T`'s result stands for the backward's
    transient score blocks, `ONLINE_BLOCKS` of them, one step's. Across a layer scan
    pair (`partir.OnlineAcrossScans`) the score-shaped stacks are no buffer either: the
    stack in whose slot the output and log-sum-exp travel holds those, per layer. A
    forward pass alone (`partir.OnlineForward`: a layer the user checkpoints) keeps
    nothing. On a breadth-first backend (XLA:CPU, which drops the optimization barriers
    that order the steps) each step runs as soon as its blocks arrive: the backward's
    recomputed weights, all `n` blocks of them, are made as soon as the forward's
    queries and keys are there and live until the backward reads them (the weights'
    value, a row; across a scan pair, a row in the backward body, where they are
    recomputed), and the backward's `n` steps' blocks are live together."""

    def __init__(self, part, device):
        prog = part.program
        self.part, self.breadth_first = part, device.breadth_first
        self.found = [m for m in online_attentions(prog) if not isinstance(m, Unmatched)]
        self.dropped = {m.attention.score: _dropped(prog, m) for m in self.found}

    def running(self, rings) -> list:
        """The attentions the plan runs blockwise, given its ring dots `rings`."""
        return [m for m in self.found if online_reason(self.part, m, rings) is None]

    def value_bytes(self, value_bytes, rings):
        """`value_bytes` (per value, per device) as the blockwise attentions keep them."""
        running = self.running(rings)
        if not running:
            return value_bytes
        out = value_bytes.copy()
        prog, mesh = self.part.program, self.part.mesh
        for m in running:
            a = m.attention
            n = mesh.size(rings[a.score].axis)
            block = float(value_bytes[a.scores]) / n  # the scores as their dot makes them, one key block
            out[list(self.dropped[a.score])] = 0.0
            across = isinstance(m, OnlineAcrossScans)
            if across:  # the output and log-sum-exp, per layer
                rows = float(value_bytes[a.out] + value_bytes[m.row_sum])
                inner, stack, piece = m.saved
                out[[inner, piece]] = rows
                out[stack] = rows * prog.values[stack].shape[0]
            if not m.backward_dots:
                continue
            blocks = n * BREADTH_FIRST_ROWS if self.breadth_first else ONLINE_BLOCKS
            if self.breadth_first and across:  # the backward body's recomputed weights, a row
                blocks += n
            elif self.breadth_first:
                out[m.weights] = value_bytes[m.weights]
            out[prog.ops[m.grad_scores].results[0]] = block * blocks
        return out

    def recomputed(self, rings) -> list[int]:
        """The score dots whose `Q K^T` the backward pass computes again."""
        return [m.attention.score for m in self.running(rings) if m.backward_dots]


def _dropped(prog, m) -> tuple[int, ...]:
    """The values of attention `m`'s region the blockwise attention never makes (all
    but the dots' results it returns and, with a backward pass in its region, the row
    sum standing for its saved lse)."""
    kept = {r for o in (m.attention.combine, *m.backward_dots) for r in prog.ops[o].results}
    if m.backward_dots and not isinstance(m, OnlineAcrossScans):
        kept.add(m.row_sum)
    return tuple(sorted({r for o in m.ops for r in prog.ops[o].results if r >= 0} - kept))
