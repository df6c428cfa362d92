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

`attention_region(program, from_scalars)` finds that structure in the lifted program,
whatever wrote it (`jax.nn.dot_product_attention`'s XLA path or a hand-written softmax
attention look alike there):
- a *score dot* is a batched `dot_general` (batch dims, e.g. batch and heads) whose
  contraction is a head dim (at most `MAX_HEAD_DIM`) and whose result is larger than
  both operands: `Q K^T` forward, `dO V^T` backward;
- the *region* is every value reached from a score dot's result through ops that are
  not dots (masking, softmax, its gradient, the scan stacks and slices that carry them
  between loops); its ops run inside the kernel;
- the kernel's *dots* are the score dots and every dot reading a region value (`P V`,
  `dS K`, `dS^T Q`, `P^T dO`), priced at the kernel's own rate;
- a region that a mask made of iotas enters (`select_n` with an operand made from
  scalars) is taken as causal: the kernel skips the blocks above the diagonal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: The largest head dim the fused kernels take (cuDNN and flash attention: 256).
MAX_HEAD_DIM = 256
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


def _is_score_dot(op, vals) -> bool:
    if op.link or op.primitive != "dot_general" or op.eqn is None:
        return False
    (lc, _), (lb, _) = op.eqn.params["dimension_numbers"]
    if not lb:
        return False
    lhs, rhs, out = (vals[v] for v in (op.operands[0], op.operands[1], op.results[0]))
    contraction = math.prod(lhs.shape[d] for d in lc)
    size = math.prod(out.shape)
    return contraction <= MAX_HEAD_DIM and size > math.prod(lhs.shape) and size > math.prod(rhs.shape)


def attention_region(program, from_scalars) -> AttentionRegion:
    """The fused attention kernels of `program` (module docstring); `from_scalars[v]`
    says which values are made from scalars alone (`Materialization.from_scalars`)."""
    vals, ops = program.values, program.ops
    in_region = np.zeros(len(vals), dtype=bool)
    score = np.array([_is_score_dot(op, vals) for op in ops], dtype=bool)
    stack = [op.results[0] for op in ops if score[op.id]]
    while stack:
        v = stack.pop()
        if v < 0 or in_region[v]:
            continue
        in_region[v] = True
        for o in program.users[v]:
            op = ops[o]
            if op.primitive == "dot_general" and not op.link:
                continue
            stack += [r for r in op.results if r >= 0]
    kernel_ops = np.array([bool(op.results) and not score[op.id] and op.primitive != "dot_general"
                           and all(r < 0 or in_region[r] for r in op.results) for op in ops], dtype=bool)
    dots = score | np.array([op.primitive == "dot_general" and not op.link and any(v >= 0 and in_region[v]
                                                                                   for v in op.operands)
                             for op in ops], dtype=bool)
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
        if not kernel_ops[op.id] or op.primitive != "select_n":
            continue
        if any(v >= 0 and from_scalars[v] and program.values[v].shape for v in op.operands):
            keys = max(keys, program.values[op.results[0]].shape[-1])
    if not keys:
        return 1.0
    blocks = max(1, math.ceil(keys / CAUSAL_BLOCK))
    return (blocks + 1) / (2 * blocks)
