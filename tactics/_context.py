"""Context parallelism: the sequence split over an axis through attention too."""

from __future__ import annotations

from dataclasses import dataclass

import partir

from . import _checks as check
from ._base import Context, Tactic, TacticError
from ._roles import roles

#: How attention computes on a split sequence. 'allgather': each device keeps its block
#: of queries and all-gathers the keys and values (MaxText's context parallelism),
#: expressed through layouts alone, so both lowerings realise it. 'ring': the keys and
#: values stay split, and the dots reading them whole take them block by block as the
#: blocks rotate round the axis (`partir.Partitioning.ring`; shard_map lowering only).
STRATEGIES = ("allgather", "ring")


@dataclass(frozen=True)
class ContextParallel(Tactic):
    """Split the sequence dim of every activation over `axis`, attention included.

    The sequence is the dim that the queries and keys of the program's self-attentions
    run along (`partir.attentions`, found from the dataflow: `jax.nn.dot_product_attention`
    and hand-written softmax attention alike), and every dim the factor rules tie to it
    (the tokens', the positions', the activations'). The batch inputs are split along it;
    each attention's keys and values are kept whole over `axis` (`strategy='allgather'`):
    every device computes the scores of its block of queries against the whole sequence,
    and the backward pass reduce-scatters the keys' and values' gradients. A causal mask
    made of iotas follows the split as XLA partitions the iotas, so the numbers are the
    unsplit program's.

    Split in contiguous blocks, a causal sequence gives the device holding its first
    block the least unmasked work and the one holding the last the most. `balance`
    lays the tokens out in another order first (`partir.BALANCES`: 'zigzag', each
    device two chunks from opposite ends; 'striped', every n-th token): the inputs
    along the sequence are permuted on the way in, the outputs back on the way out, and
    the iotas along it (rotary positions, causal masks) hold the permuted positions, so
    the numbers are still the unsplit program's (`Partitioning.reorder`). The order is
    made for every axis that splits the sequence when the tactic applies, an earlier
    ContextParallel's and its own (context parallelism over two mesh axes), and
    replaces an earlier one's order for fewer of them: each device of all of them holds
    its share of the work. (A ContextParallel without `balance` after a balanced one
    leaves the order as it was, made for fewer devices than split the sequence.)

    `strategy='ring'` moves the same data in a ring instead (`partir.Partitioning.ring`):
    the keys and values stay split along the sequence at rest, and each dot that reads
    them whole (`Q K^T` and `P V`, and in the backward pass `dO V^T` and `dS K`) runs
    as a collective matmul over `axis`: every device computes with the block it holds
    while `jax.lax.ppermute` passes the block on, so no device holds more of them than
    its own block, the one it computes with and the one in flight. The keys' and values' gradients (`dS^T Q`, `P^T dO`) are summed
    round the ring the other way (a matmul-reduce-scatter).

    The shard_map lowering runs each attention of a ring plan blockwise with an online
    softmax (always: there is no switch on the tactic): per key block, the block of
    scores, the program's own scale and mask on it, and a running max and sum per
    query row (flash attention's); the forward keeps the output and the row
    log-sum-exp, the backward recomputes each block's weights, so no device holds a
    whole row of scores. It does so where `partir.online_attentions` matches the
    attention op by op, at the top level and in layer scans (each checkpointed layer's
    forward and its rerun; without checkpoint, the output and log-sum-exp stacked
    across the scan pair in the place of the weights); any other (a softmax written
    otherwise, dropout on the weights, a plan with a Remat tactic or pipelines) keeps
    the program's softmax round the ring, listed in the tactic's notes and warned of
    when lowered.
    `partir.lower(..., backend='shard_map', online_softmax=False)` keeps it for all.
    XLA's partitioner cannot be made to emit the ring from layouts: the plan lowers
    with `lowering='shard_map'` only (the `jit` lowering refuses it before any work).
    """

    axis: str
    strategy: str = "allgather"
    balance: str | None = None

    def __post_init__(self):
        check.text("ContextParallel axis", self.axis, example="axis='context'", error=TacticError)
        check.one_of("ContextParallel strategy", self.strategy, STRATEGIES, error=TacticError)
        check.one_of("ContextParallel balance", self.balance, (None, *partir.BALANCES), error=TacticError)

    def apply(self, part, ctx: Context):
        prog = part.program
        found = partir.attentions(prog)
        if not found:
            raise TacticError(f"{self}: found no self-attention (a batched Q K^T whose softmax weights a second dot "
                              "reads, queries and keys along one sequence); context parallelism splits one")
        classes = partir.dim_classes(prog)
        sequence = {classes.label(a.key, a.key_dim) for a in found}
        inputs = _sequence_inputs(part, classes, sequence, self.axis)
        if self.balance is not None:
            if len(sequence) != 1:
                raise TacticError(f"{self}: the attentions run along {len(sequence)} different sequences; a "
                                  "balanced token order lays out one")
            _balance(part, inputs[0], self.axis, self.balance, str(self))
        laid = set()  # keys and values this tactic laid out (a recomputed attention shares them)
        for a in found:
            for v, d in ((a.key, a.key_dim), (a.value, a.value_dim)):
                if v in laid:
                    continue
                if self.axis in part.tiling(v).axes():
                    raise TacticError(f"{self}: {prog.name(v)} is already split over {self.axis!r}; the keys and "
                                      "values of attention are laid out over the context axis by this tactic: "
                                      "apply ContextParallel first")
                if self.strategy == "ring":  # kept split at rest, and read whole round the ring
                    for u, e in _linked(prog, classes, v, d):
                        _split_at_rest(part, u, e, self.axis, str(self))
                        part.ring(u, e, self.axis, source=str(self))
                        laid.add(u)
                else:
                    part.pin(v, axes=(self.axis,), source=str(self))
                laid.add(v)
        for a in found:
            # The keys' gradients split along the sequence, but as boundaries: each is
            # summed over the queries (a reduce-scatter), and propagation from them
            # would otherwise reach the softmax's gradient first and split it by keys.
            for v, d in a.key_grads:
                _split_at_rest(part, v, d, self.axis, str(self))
                if self.strategy == "ring":
                    part.ring(v, d, self.axis, source=str(self))
        for v, d in inputs:
            part.tile(v, d, self.axis, source=str(self))
        unsplit = [a for a in found if self.axis not in part.factor_tiling(a.score)[_query_factor(prog, a)]]
        if unsplit:
            names = ", ".join(prog.name(a.scores) for a in unsplit)
            raise TacticError(f"{self}: the queries of {names} are not split over {self.axis!r} after propagation "
                              "(an earlier tactic holds that axis on their path); apply ContextParallel first")
        masked = sum(a.masked for a in found)
        moved = "rotated round a ring" if self.strategy == "ring" else "gathered"
        notes = [f"attentions: {len(found)} ({masked} causal), keys and values {moved} over {self.axis!r}",
                 "sequence split on: " + ", ".join(f"{prog.name(v)} dim {d}" for v, d in inputs)]
        if self.balance is not None:
            notes.append(f"tokens laid out {self.balance!r}: inputs and iotas along the sequence permuted")
        if self.strategy == "ring":
            notes += _online_notes(part)
        return part, notes


def _online_notes(part) -> list[str]:
    """Which attentions the shard_map lowering runs blockwise with an online softmax,
    and why each other one keeps the program's softmax (`partir.online_reason`)."""
    prog = part.program
    rings = partir.ring_moves(part)
    found = partir.online_attentions(prog)
    kept = []
    for m in found:
        reason = m.reason if isinstance(m, partir.Unmatched) else partir.online_reason(part, m, rings)
        if reason is not None:
            score = m.score if isinstance(m, partir.Unmatched) else m.attention.score
            kept.append(f"{prog.name(prog.ops[score].results[0])}: {reason}")
    notes = [f"online softmax (shard_map lowering): {len(found) - len(kept)} of {len(found)} attentions run "
             "blockwise, one key block at a time"]
    if kept:
        notes.append("keeping the program's softmax round the ring (whole score rows): " + "; ".join(kept))
    return notes


def _sequence_inputs(part, classes, sequence: set, axis: str) -> list[tuple[int, int]]:
    """(input, dim) of every batch input along the sequence; a clear error when there is
    none or the axis does not divide one."""
    prog = part.program
    out = [(v, d) for v in roles(prog).batch for d in range(prog.values[v].rank)
           if classes.label(v, d) in sequence]
    if not out:
        raise TacticError("ContextParallel: no batch input runs along the sequence of the attentions "
                          "(tokens [batch, sequence]); pass the sequence as an input of the step")
    size = part.mesh.size(axis)
    bad = [f"{prog.name(v)} (dim {d} of size {prog.values[v].shape[d]})" for v, d in out
           if prog.values[v].shape[d] % size]
    if bad:
        raise TacticError(f"ContextParallel({axis!r}): the {size} devices of {axis!r} do not divide the sequence of "
                          f"{', '.join(bad)}; pick an axis whose size divides the sequence length")
    return out


def _balance(part, site: tuple[int, int], axis: str, balance: str, source: str) -> None:
    """Lay the sequence that `site` (input, dim) runs along out in the `balance` order
    for every axis that will split it: those splitting it already (an earlier
    ContextParallel's), major first, then `axis`; one order, which replaces an earlier
    ContextParallel's for its axes alone, so that each device of all of them holds its
    share of the causal work."""
    v, d = site
    axes = (*part.tiling(v).dims[d], axis)
    try:
        part.reorder(v, d, axes[0] if len(axes) == 1 else axes, balance, source=source)
    except partir.PartitioningError as e:
        raise TacticError(f"{e}; a balanced ContextParallel lays the sequence out for the axes that split it "
                          f"({', '.join(axes)}), replacing only an order made for the first of them") from e


def _linked(prog, classes, v: int, dim: int) -> list[tuple[int, int]]:
    """(value, dim) of `v` along `dim` and of every value it crosses region boundaries
    as (through link ops, e.g. the stack a layer scan keeps it in for the backward pass
    and the backward body's slice of it), with the dim of each in `dim`'s class."""
    label = classes.label(v, dim)
    out, seen, stack = [], set(), [v]
    while stack:
        u = stack.pop()
        dims = classes.dims_in(u, prog.values[u].rank, label)
        if len(dims) != 1 or u in seen:
            continue  # (a value holding the sequence in two dims moves as its layouts say)
        seen.add(u)
        out.append((u, dims[0]))
        stack += [r for o in prog.users[u] if prog.ops[o].link for r in prog.ops[o].results if r >= 0]
    return out


def _split_at_rest(part, v: int, dim: int, axis: str, source: str) -> None:
    """Fix `v`'s layout as it is plus `axis` on `dim`, as a boundary (`constrain`)."""
    dims = list(part.tiling(v).dims)
    if axis in dims[dim]:
        return
    dims[dim] = dims[dim] + (axis,)
    part.constrain(v, tuple(dims), source=source)


def _query_factor(prog, a) -> int:
    """The factor of the score dot `a.score` along the queries' sequence."""
    op = prog.ops[a.score]
    (f,) = op.rule.results[0][a.score_query_dim]
    return f

