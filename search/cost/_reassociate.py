"""Sums of reduced values reduced once, as XLA:GPU compiles them.

XLA:GPU's collective optimizations (`gpu_compiler.cc`, the "collective-optimizations"
pipeline) run `AllReduceReassociate` and `ReduceScatterReassociate`: where an add reads
two all-reduces (or two reduce-scatters) of the same kind, groups and shape, each read
by that add alone, it becomes one collective of the add of their operands,

    add(all-reduce(a), all-reduce(b))  ->  all-reduce(add(a, b)),

and a chain of adds, visited operands first, becomes one collective of the whole sum.
Tensor parallelism makes such sums in every layer's backward: the input's gradient is
the sum of the partial gradients of every projection reading it (query, key and value;
the MLP's gate and up), each all-reduced over the model axis where its dot made it.
Reassociated, a layer's backward reduces two buffers over the model axis instead of
five, as Megatron-LM's fused QKV and gate/up projections do.

XLA:CPU does not (measured on the 8-device CPU mesh: the three query, key and value
gradients of a Megatron layer leave their loop body in one tuple all-reduce, then are
added), so the `cpu` preset keeps every reduction, as `compare_with_xla` sees them;
`DeviceSpec.reassociate` says which backend does what. Only the step's time follows
it: the reduced buffers are made all the same, so the memory model keeps them.
"""

from __future__ import annotations

import heapq

from partir import Kind

#: The primitives XLA's reassociation looks through: a sum's adds (`add_any` is the
#: sum of cotangents autodiff writes).
SUMS = ("add", "add_any")
#: The collectives it merges: a sum of reductions (their reduction is an add).
MERGED = (Kind.ALL_REDUCE, Kind.REDUCE_SCATTER)


def sum_parents(prog) -> dict[int, int]:
    """Value -> the result of the add that is its only reader (values read by nothing
    else: XLA merges a collective read by the add alone)."""
    out = {}
    for v, users in enumerate(prog.users):
        if len(users) == 1 and prog.ops[users[0]].primitive in SUMS:
            r = prog.ops[users[0]].results
            if len(r) == 1 and r[0] >= 0 and prog.values[r[0]].shape == prog.values[v].shape:
                out[v] = r[0]
    return out


def absorbed(prog, moves, parents: dict[int, int]) -> set:
    """Keys of `moves` ((key, {op: (value, collectives, buffer)})) whose one collective
    another's takes over: per tree of adds whose leaves are all reductions made alike
    (kind, axes, bytes, trips) of dots' partial sums, every leaf's but the first's (in
    program order)."""
    sig: dict[int, tuple] = {}  # a value reduced once -> its collective's (kind, axes, bytes, trips)
    first: dict[int, tuple] = {}  # such a value -> (op, key) of the reduction it keeps
    for key, e in moves:
        if key[0] != "made":
            continue
        v, cols, _ = e[min(e)]
        # A dot's partial result is a sum (a reduce's may be a max, which no add merges).
        if len(cols) == 1 and cols[0].kind in MERGED and v in parents and prog.ops[min(e)].primitive == "dot_general":
            c = cols[0]
            sig[v], first[v] = (c.kind, c.axes, c.bytes, c.count), (min(e), key)
    sums: dict[int, list] = {}
    for v in sig:
        sums.setdefault(parents[v], []).append(v)
    todo = [(prog.producer[r], r) for r in sums]
    heapq.heapify(todo)
    out: set = set()
    while todo:  # the adds in program order: a sum's operands are settled before it
        _, r = heapq.heappop(todo)
        members = sums[r]
        operands = [v for v in prog.ops[prog.producer[r]].operands if v >= 0]
        if len(members) < len(operands) or len({sig[v] for v in members}) != 1:
            continue
        kept = sorted(first[v] for v in members)
        out.update(k for _, k in kept[1:])
        if r in parents:  # the sum is one reduction now: it may join the add reading it
            sig[r], first[r] = sig[members[0]], kept[0]
            if parents[r] not in sums:
                heapq.heappush(todo, (prog.producer[parents[r]], parents[r]))
            sums.setdefault(parents[r], []).append(r)
    return out
