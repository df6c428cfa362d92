"""Attention as the fused kernel users run on GPU and TPU.

On a backend with `DeviceSpec.fused_attention` (cuDNN's fused attention behind
`jax.nn.dot_product_attention` on H100/A100, splash attention on TPU),

    scores = Q K^T  ->  mask, softmax  ->  P V

and the gradients of all of it run as two kernels (forward, backward) that keep the
`[B, H, S, S]` scores in on-chip memory, tile by tile: no score-shaped value is ever a
buffer, none of the elementwise passes over them reads or writes HBM, and the backward
kernel recomputes `Q K^T` (it keeps only the output and the row statistics). The
program itself keeps its XLA form (on the `cpu` preset, where XLA:CPU runs it so,
nothing here applies).

`attention_region(program, from_scalars)` reads that structure from the regions
`partir.kernel_region` finds in the lifted program, whatever wrote it
(`jax.nn.dot_product_attention`'s XLA path or a hand-written softmax attention look
alike there): the score dots, the values reached from them, and the kernel's dots
(the score dots and every dot reading a region value), priced at the kernel's own rate.
A region that a mask made of iotas enters (`partir.is_mask`: a `select_n` on a
predicate made from scalars) is taken as causal: the kernel skips the blocks above the diagonal.

`causal_imbalance(part)`: split along its queries into contiguous blocks over `n`
devices, a causal attention gives the device holding the last block the most tiles
(all of them up to the diagonal) and the first the fewest; the step waits for the last.
With `t` key tiles, `q = t / n` query tiles per device, the last computes
`1 - (q - 1) / (2 t)` of its rows' tiles where the whole sequence averages
`(t + 1) / (2 t)`: the kernel's time on a device is the average's times their ratio,
`(2 t - q + 1) / (t + 1)` (about `2 - 1/n` on long sequences). In a balanced token order
(`Partitioning.reorder`) each device's queries are counted where the order puts them:
the average when the order was made for the devices that split it, more when it was
made for fewer (a sequence split over two axes, balanced for one).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from partir import attentions, dim_classes, is_mask, kernel_region, order_axes, token_order

#: The kernels' tile along the key axis (flash attention and cuDNN use 64-128 on
#: H100; splash 128-512 on TPU): a causal kernel computes the diagonal tiles whole.
CAUSAL_BLOCK = 128


@dataclass(frozen=True, eq=False)
class AttentionRegion:
    """Per value: `values[v]`, inside the kernel (never a buffer). Per op: `ops[o]`,
    runs inside the kernel (no time of its own); `dots[o]`, a matmul of the kernel;
    `work[o]`, the fraction of a kernel dot's flops computed (causal masking skips
    tiles); `recompute[o]`, the fraction of a forward score dot's flops the backward
    kernel spends again."""

    values: np.ndarray
    ops: np.ndarray
    dots: np.ndarray
    work: np.ndarray
    recompute: np.ndarray

    @property
    def found(self) -> bool:
        """Whether the program has attention the kernel takes."""
        return bool(self.dots.any())


def attention_region(program, from_scalars) -> AttentionRegion:
    """The fused attention kernels of `program` (module docstring); `from_scalars[v]`
    says which values are made from scalars alone (`Materialization.from_scalars`)."""
    found = kernel_region(program)
    in_region, kernel_ops, dots, score = found.values, found.ops, found.dots, found.score
    causal = _causal_fraction(program, in_region, kernel_ops, from_scalars)
    work = np.where(dots, causal, 1.0)
    backward = np.asarray(program.backward, dtype=bool)
    recompute = np.where(score & ~backward, causal, 0.0)
    return AttentionRegion(in_region, kernel_ops, dots, work, recompute)


def _causal_fraction(program, in_region, kernel_ops, from_scalars) -> float:
    """The fraction of score tiles a causal kernel computes, or 1 when no mask made of
    iotas enters the region. With n key blocks, n (n + 1) / 2 of n^2 tiles."""
    keys = 0
    for op in program.ops:
        if kernel_ops[op.id] and is_mask(program, op, from_scalars):
            keys = max(keys, program.values[op.results[0]].shape[-1])
    if not keys:
        return 1.0
    blocks = max(1, math.ceil(keys / CAUSAL_BLOCK))
    return (blocks + 1) / (2 * blocks)


def causal_imbalance(part) -> float:
    """How much longer the busiest device's causal kernels run than the average's, for
    `part`'s split of the attentions' queries and the order its sequence is laid out in
    (module docstring); 1 where none is causal or split. Attentions split alike in every
    layer: the largest."""
    prog = part.program
    classes = dim_classes(prog)
    worst = 1.0
    for a in attentions(prog):
        if not a.masked:
            continue
        rule = prog.ops[a.score].rule
        (f,) = rule.results[0][a.score_query_dim]
        n = part.mesh.devices_along(part.factor_tiling(a.score)[f])
        length = prog.values[a.scores].shape[a.score_query_dim]
        order = part.orders.get(classes.label(a.key, a.key_dim))
        parts = None if order is None else part.mesh.devices_along(order_axes(order[0]))
        if n > 1 and length % n == 0 and (order is None or length % (2 * parts) == 0):
            worst = max(worst, _busiest(length, n, order and order[1], parts))
    return worst


@functools.lru_cache(maxsize=64)
def _busiest(length: int, n: int, balance, parts) -> float:
    """The busiest of `n` devices' causal tiles over the average's, each holding a
    contiguous block of the sequence laid out in `balance`'s order for `parts` (the
    original order for None): a query computes the key tiles up to its own."""
    order = np.arange(length) if balance is None else token_order(length, parts, balance)
    tiles = (order // CAUSAL_BLOCK + 1).reshape(n, length // n).sum(axis=1)
    return float(tiles.max() / tiles.mean())
