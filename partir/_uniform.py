"""Dims along which a value holds the same entries: what a pipelined stage need not
carry whole into its tick loops.

A causal mask reaches the layers as a constant broadcast to the whole batch (JAX's
`dot_product_attention` and-s an all-true `[B, N, T, S]` with the `[T, S]` triangle;
its gradient's `select_n` wants it in full), so a stage would hold the mask of all its
microbatches through both tick loops, although every row of the batch is the same
`[T, S]` plane. `uniform_dims` says, from the program alone, which dims of a value are
such copies; the lowerings pass a stage's tick loops one row along them and broadcast
it per tick (`partir/lowering/_shardmap_pipeline.py`, `thin_consts`), and the memory
model counts no whole buffer for it (`search/cost/_tick_buffers.py`).

Only what is plainly so: a dim a `broadcast_in_dim` adds or expands from size 1, kept
through elementwise ops whose other operands are uniform along it too (or scalars), and
through call boundaries, which rename values without moving them. Anything else is
taken as varying.
"""

from __future__ import annotations

from ._nested import Link

#: Elementwise primitives a mask is built from (comparisons, logic, selects,
#: arithmetic, casts): a dim along which every array operand is uniform is uniform in
#: the result. A primitive not listed makes its result varying along every dim.
ELEMENTWISE = frozenset({
    "and", "or", "not", "xor", "select_n", "eq", "ne", "lt", "le", "gt", "ge",
    "add", "sub", "mul", "neg", "max", "min", "convert_element_type",
})

#: Links that pass a value unchanged across a region boundary (same shape both sides).
_RENAMES = (Link.CALL_IN, Link.CALL_OUT)


def uniform_dims(prog, v: int) -> frozenset[int]:
    """The dims of value `v` of program `prog` along which all its entries are equal
    (see the module docstring); its size-1 dims among them."""
    memo: dict[int, frozenset[int]] = {}
    return _uniform(prog, v, memo)


def _uniform(prog, v: int, memo: dict) -> frozenset[int]:
    if v in memo:
        return memo[v]
    shape = tuple(prog.values[v].shape)
    ones = frozenset(d for d, n in enumerate(shape) if n == 1)
    memo[v] = ones  # (no cycle reaches here: values are made before they are read)
    p = prog.producer[v]
    op = prog.ops[p] if p >= 0 else None
    found = frozenset()
    if op is None:
        pass
    elif op.link:
        src = op.operands[0] if op.operands else -1
        if op.primitive in _RENAMES and src >= 0 and tuple(prog.values[src].shape) == shape:
            found = _uniform(prog, src, memo)
    elif op.primitive == "broadcast_in_dim":
        found = _broadcast(prog, op, shape, memo)
    elif op.primitive in ELEMENTWISE:
        found = frozenset(range(len(shape)))
        for u in op.operands:
            if u >= 0 and prog.values[u].shape:
                found &= _uniform(prog, u, memo) if tuple(prog.values[u].shape) == shape else frozenset()
    memo[v] = found | ones
    return memo[v]


def _broadcast(prog, op, shape, memo) -> frozenset[int]:
    """The uniform dims of the result (of `shape`) of `broadcast_in_dim` op `op`: the
    dims it adds, those it expands from size 1, and those its operand is uniform along."""
    src = op.operands[0]
    kept = tuple(int(d) for d in op.eqn.params["broadcast_dimensions"])
    if src < 0:
        return frozenset(range(len(shape)))
    have = _uniform(prog, src, memo)
    src_shape = tuple(prog.values[src].shape)
    out = set(d for d in range(len(shape)) if d not in kept)
    out.update(d for k, d in enumerate(kept) if src_shape[k] == 1 or k in have)
    return frozenset(out)
