"""Attention in a lifted program, found from the dataflow (never from names).

Whatever wrote it (`jax.nn.dot_product_attention`'s XLA path, a hand-written softmax
attention, a library's module), attention looks alike in the lifted program:

- a *score dot* is a batched `dot_general` (batch dims, e.g. batch and heads) whose
  contraction is a head dim (at most `MAX_HEAD_DIM`) and whose result is larger than
  both operands: `Q K^T` forward, `dO V^T` backward;
- its *region* is every value reached from a score dot's result through ops that are
  not dots (scaling, masking, softmax, its gradient, the scan stacks and slices that
  carry them between loops);
- the region's *dots* are the score dots and every dot reading a region value (`P V`,
  `dS K`, `dS^T Q`, `P^T dO`).

`kernel_region(program)` gives those masks (the fused-kernel cost model reads them).
`is_mask` tells a causal mask (a select on a predicate made of iotas) from the
selects of a softmax's gradient. `attentions(program)` names, for each forward score dot, the attention it belongs to:
the dot that reads its softmax weights (`P V`), the query, key and value operands, and
which of their dims is the sequence (`Attention`). The sequence dims are told apart by
`dim_classes`: dims the factor rules tie together (the same factor, alone in its dim,
at one op) are one class, so the keys' sequence dim and the queries' are one class in
self-attention (both come from the same activations), and the tokens' sequence dim is
in it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ._graph import UnionFind, made_from_scalars

#: The largest head dim the fused kernels take (cuDNN and flash attention: 256); a
#: batched dot contracting more is no score dot.
MAX_HEAD_DIM = 256


@dataclass(frozen=True, eq=False)
class KernelRegion:
    """Per value: `values[v]`, inside an attention region. Per op: `ops[o]`, an op of
    the region (not a dot); `dots[o]`, a dot of the region (a score dot or one reading a
    region value); `score[o]`, a score dot."""

    values: np.ndarray
    ops: np.ndarray
    dots: np.ndarray
    score: np.ndarray


def is_score_dot(op, values) -> bool:
    """Is `op` a score dot (module docstring)?"""
    if op.link or op.primitive != "dot_general" or op.eqn is None:
        return False
    (lc, _), (lb, _) = op.eqn.params["dimension_numbers"]
    if not lb:
        return False
    lhs, rhs, out = (values[v] for v in (op.operands[0], op.operands[1], op.results[0]))
    contraction = math.prod(lhs.shape[d] for d in lc)
    size = math.prod(out.shape)
    return contraction <= MAX_HEAD_DIM and size > math.prod(lhs.shape) and size > math.prod(rhs.shape)


def is_mask(program, op, from_scalars) -> bool:
    """Is `op` a mask made of iotas (a causal mask), applied to scores: a `select_n`
    whose predicate `from_scalars[v]` says is made from scalars alone, and spans a
    plane (the max's gradient selects too, on a predicate computed from the scores)?"""
    if op.primitive != "select_n":
        return False
    pred = op.operands[0]
    return pred >= 0 and bool(from_scalars[pred]) and program.values[pred].rank >= 2


def kernel_region(program) -> KernelRegion:
    """The attention regions of `program` (module docstring). Kept with the program."""
    return program.analysis(_kernel_region)


def _kernel_region(program) -> KernelRegion:
    vals, ops = program.values, program.ops
    in_region = np.zeros(len(vals), dtype=bool)
    score = np.array([is_score_dot(op, vals) for op in ops], dtype=bool)
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
    return KernelRegion(in_region, kernel_ops, dots, score)


# -- dims the factor rules tie together ----------------------------------------------------
@dataclass(frozen=True, eq=False)
class DimClasses:
    """`label(v, d)`: the class of dim `d` of value `v`; dims of one class are tied by
    the factor rules (module docstring)."""

    offsets: tuple[int, ...]
    labels: tuple[int, ...]

    def label(self, v: int, d: int) -> int:
        """The class of dim `d` of value `v`."""
        return self.labels[self.offsets[v] + d]

    def dims_in(self, v: int, rank: int, label: int) -> tuple[int, ...]:
        """The dims of value `v` (of rank `rank`) in class `label`."""
        return tuple(d for d in range(rank) if self.labels[self.offsets[v] + d] == label)


def dim_classes(program) -> DimClasses:
    """The classes of dims tied by the factor rules. Kept with the program."""
    return program.analysis(_dim_classes)


def _dim_classes(program) -> DimClasses:
    offsets, n = [], 0
    for val in program.values:
        offsets.append(n)
        n += val.rank
    sets = UnionFind(n)
    for op in program.ops:
        rule = op.rule
        if rule.fixed is not None:
            continue  # a region the user partitioned by hand: every dim its own
        first: dict[int, int] = {}
        for vids, specs in ((op.operands, rule.operands), (op.results, rule.results)):
            for v, spec in zip(vids, specs):
                if v < 0:
                    continue
                for d, fs in enumerate(spec):
                    if len(fs) == 1:
                        at = offsets[v] + d
                        sets.union(first.setdefault(fs[0], at), at)
    return DimClasses(tuple(offsets), tuple(sets.labels()))


# -- the forward attentions ----------------------------------------------------------------
@dataclass(frozen=True)
class Attention:
    """One attention of the forward pass. `score` is the `Q K^T` dot (op id) making
    `scores`; `combine` the dot reading its softmax weights with `value` (`P V`, op id)
    making `out`. `query`, `key`, `value` are the value ids the two dots read; `*_dim`
    the sequence dim of each (`score_query_dim`, `score_key_dim` of the scores).
    `masked`: a mask made from scalars alone (a causal mask) enters the region.
    `key_grads`: (value, dim) of each result of a backward dot that reads the region
    along the keys' sequence (the keys' and values' gradients, `dS^T Q` and `P^T dO`),
    with the dim of the keys it runs along."""

    score: int
    combine: int
    query: int
    key: int
    value: int
    scores: int
    out: int
    query_dim: int
    key_dim: int
    value_dim: int
    score_query_dim: int
    score_key_dim: int
    out_dim: int
    masked: bool
    key_grads: tuple[tuple[int, int], ...]


def attentions(program) -> tuple[Attention, ...]:
    """The self-attentions of the forward pass, in program order (each forward score
    dot whose weights a second dot reads, and whose queries and keys run along dims of
    one class), those a user's `jax.checkpoint` computes again in the backward pass
    included. Kept with the program."""
    return program.analysis(_attentions)


def forward_like(program) -> tuple[bool, ...]:
    """Per op: does it compute the forward pass, in it or again in the backward pass (a
    rerun a user's `jax.checkpoint` recomputes)?"""
    return program.analysis(_forward_like)


def _forward_like(program) -> tuple[bool, ...]:
    from ._checkpoint import reruns_of

    reruns = reruns_of(program)
    return tuple(not b or any(r in reruns for r in op.results) for op, b in zip(program.ops, program.backward))


def _attentions(program) -> tuple[Attention, ...]:
    region = kernel_region(program)
    forward = forward_like(program)
    out = []
    for op in program.ops:
        if region.score[op.id] and forward[op.id]:
            found = _attention(program, region, op)
            if found is not None:
                out.append(found)
    return tuple(out)


def _attention(program, region, score_op) -> Attention | None:
    """The attention whose score dot is `score_op`, or None when it is not one."""
    scores = score_op.results[0]
    score_dim = _region_dims(program, region, scores)
    combine = _combine(program, region, score_dim)
    if combine is None:
        return None
    cop, p, p_dim = combine
    contracted = _contracted(cop, cop.operands.index(p), p_dim)
    if contracted is None:
        return None
    key_factor, score_key = contracted[0], p_dim[contracted[1]]
    spec = score_op.rule
    f_key = spec.results[0][score_key]
    if len(f_key) != 1:
        return None
    sides = [k for k in (0, 1) if any(f_key[0] in fs for fs in spec.operands[k])]
    if len(sides) != 1:
        return None
    k_side = sides[0]
    key = score_op.operands[k_side]
    query = score_op.operands[1 - k_side]
    key_dim = next(d for d, fs in enumerate(spec.operands[k_side]) if fs == f_key)
    classes = dim_classes(program)
    seq = classes.label(key, key_dim)
    q_free = [(d, fs) for d, fs in enumerate(spec.operands[1 - k_side])
              if len(fs) == 1 and not any(fs[0] in g for g in spec.operands[k_side])]
    q_seq = [(d, fs) for d, fs in q_free if classes.label(query, d) == seq]
    if len(q_seq) != 1:
        return None  # cross-attention, or queries along no dim of the keys' class
    query_dim, f_query = q_seq[0]
    score_query = next(d for d, fs in enumerate(spec.results[0]) if fs == f_query)
    v_side = 1 - cop.operands.index(p)
    value = cop.operands[v_side]
    value_dim = next(d for d, fs in enumerate(cop.rule.operands[v_side]) if fs == (key_factor,))
    q_in_p = next((d for d, s in p_dim.items() if s == score_query), None)
    if q_in_p is None:
        return None
    f_out = cop.rule.operands[1 - v_side][q_in_p]
    out_dim = next((d for d, fs in enumerate(cop.rule.results[0]) if fs == f_out), None)
    if out_dim is None:
        return None
    scalars = made_from_scalars(program)
    masked = any(region.ops[o] and is_mask(program, program.ops[o], scalars) for v in score_dim
                 for o in program.users[v])
    return Attention(score_op.id, cop.id, query, key, value, scores, cop.results[0], query_dim, key_dim, value_dim,
                     score_query, score_key, out_dim, masked, _key_grads(program, region, score_dim, score_key))


def _key_grads(program, region, score_dim, score_key: int) -> tuple[tuple[int, int], ...]:
    """(value, dim) of the results of the backward dots reading a value of `score_dim`
    along the scores' dim `score_key` (`Attention.key_grads`)."""
    forward = forward_like(program)
    out = []
    for v, dims in sorted(score_dim.items()):
        along = [d for d, s in dims.items() if s == score_key]
        for o in program.users[v]:
            op = program.ops[o]
            if not region.dots[o] or forward[o] or op.link or len(along) != 1:
                continue
            fs = op.rule.operands[op.operands.index(v)][along[0]]
            out += [(r, d) for r, spec in zip(op.results, op.rule.results) if r >= 0
                    for d, gs in enumerate(spec) if len(fs) == 1 and gs == fs]
    return tuple(sorted(set(out)))


def _region_dims(program, region, scores: int) -> dict[int, dict[int, int]]:
    """Per region value reached from `scores` through ops that keep its dims (each a
    single factor), which of the scores' dims each of its dims is."""
    out = {scores: {d: d for d in range(program.values[scores].rank)}}
    stack = [scores]
    while stack:
        v = stack.pop()
        for o in program.users[v]:
            op = program.ops[o]
            if not region.ops[o]:
                continue
            rule = op.rule
            for k, u in enumerate(op.operands):
                if u != v:
                    continue
                by_factor = {fs[0]: out[v][d] for d, fs in enumerate(rule.operands[k]) if len(fs) == 1 and d in out[v]}
                for r, spec in zip(op.results, rule.results):
                    if r < 0 or r in out:
                        continue
                    dims = {d: by_factor[fs[0]] for d, fs in enumerate(spec) if len(fs) == 1 and fs[0] in by_factor}
                    if dims:
                        out[r] = dims
                        stack.append(r)
    return out


def _combine(program, region, score_dim):
    """(op, weights value, its dims) of the forward dot reading a value of the region
    with a value from outside it (`P V`), or None."""
    forward = forward_like(program)
    for v in sorted(score_dim):
        for o in program.users[v]:
            op = program.ops[o]
            if op.link or op.primitive != "dot_general" or not forward[o] or region.score[o]:
                continue
            others = [u for u in op.operands if u != v]
            if len(others) == 1 and others[0] >= 0 and not region.values[others[0]]:
                return op, v, score_dim[v]
    return None


def _contracted(op, side: int, dims: dict[int, int]) -> tuple[int, int] | None:
    """(factor, dim) of the one reduction factor of dot `op` that operand `side` holds
    alone in a dim `dims` knows, or None."""
    rule = op.rule
    found = [(fs[0], d) for d, fs in enumerate(rule.operands[side]) if len(fs) == 1 and fs[0] in rule.reduction
             and d in dims]
    return found[0] if len(found) == 1 else None
