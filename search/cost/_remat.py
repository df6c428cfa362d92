"""What rematerialization does to the cost of a step (see `partir._remat`).

Recomputing a residual instead of keeping it

- frees it: in an unrolled program its buffer dies at its last forward read; a scan
  does not stack it at all;
- makes it again in the backward pass: a temporary from its first backward read to its
  last (in a scan, within the backward loop's body);
- keeps what it is recomputed from (its sources), which other residuals and the inputs
  are anyway; a scan's layer input that the forward loop did not stack is stacked for
  it (the lowering adds that output);
- runs its forward ops again, in the backward pass, collectives included (the
  `collectives` policy keeps what moved data, so it repeats none).

Relaxing a user's `jax.checkpoint` (`partir.relaxation`: values its backward region
reads from the forward pass instead of recomputing them)

- skips the region's ops that made them (and what only those read): no work, no
  collectives;
- keeps each forward value read until the backward reads it (a fused one: its
  sources); in a scan, the forward loop stacks it (its trips times its bytes, until the
  backward loop ends).

`RematView(program, base, donated, recomputed, reused, saved)` holds these static
facts for one set of recomputed residuals, reused values and values saved for the
recomputation (`Partitioning.saved`); the cost model keeps one per triple of sets it
meets.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import partir
from partir import Link

from ._memory import Liveness, backward_reads


class RematView:
    """The buffer structure (`liveness`) and the ops run again (`ops`) when the
    residuals `recomputed` are rematerialized; `extra` lists additional temporaries as
    `(start, end, value, scale)`, of `scale` times the value's bytes."""

    def __init__(self, program, materialization, donated, recomputed: frozenset, reused: frozenset = frozenset(),
                 saved: frozenset = frozenset()):
        rec = partir.recompute(program, recomputed, saved)
        self.ops = np.array(kernel_reruns(program, rec.ops, materialization.attention), dtype=np.int64)
        backward = program.analysis(backward_reads)
        virtual = materialization.virtual.copy()
        sources = dict(materialization.sources)
        live_op = materialization.live_op.copy()
        relax = partir.relaxation(program, reused)
        self.skipped = np.array(sorted(relax.skipped), dtype=np.int64)
        live_op[self.skipped] = False
        for o in self.skipped.tolist():
            for r in program.ops[o].results:
                if r >= 0:
                    virtual[r] = True
                    sources.pop(r, None)
        forward_only, extra, added, extend, slices, gone, copies = set(), [], set(), {}, set(), set(), set()
        stacked = partir.stacked_outputs(program)
        kernel = materialization.attention.values if materialization.attention is not None else None
        for r, srcs in rec.sources.items():
            stack = stacked.get(r)
            if kernel is not None and kernel[r]:
                gone.add(stack)  # inside the fused attention kernel: recomputed by it, never a buffer
                continue
            if stack is None:  # unrolled: freed after the forward reads, made again for the backward ones
                forward_only.add(r)
                late = [u for u in program.users[r] if backward[u]]
                if late:  # its sources stay until it is made again
                    extra.append((min(late), max(late), r, 1))
                    if virtual[r]:  # fused: the backward's fusions read its recomputed copy
                        copies.add(r)
                    for s in srcs:
                        extend[s] = max(extend.get(s, 0), min(late))
                continue
            virtual[stack] = True
            gone.add(stack)
            for op in program.ops:
                if op.link and op.primitive == Link.SCAN_XS and op.operands[0] == stack:
                    sliced = op.results[0]
                    virtual[sliced] = True
                    slices.add(sliced)
                    users = program.users[sliced]
                    if users:
                        extra.append((min(users), max(users), sliced, 1))
            trips = program.regions[program.values[r].region].trip_count or 1
            for s in srcs:
                if s not in stacked and stacked_for_it(program, s) and s not in added:
                    added.add(s)
                    extra.append((_made(program, s), len(program.ops) - 1, s, trips))  # stacked for it
        _rederived_from_copies(sources, slices)
        _rederived_in_line(program, virtual, sources, copies, backward)
        extra += _reads_kept(program, relax.reads, virtual, sources)
        mat = dataclasses.replace(materialization, virtual=virtual, sources=sources, live_op=live_op)
        self.liveness = Liveness(program, mat, donated, forward_only=forward_only, extend=extend)
        self.extra = extra
        self.carried = carried_buffers(materialization, gone, added)

    def running(self, dedup: dict) -> list:
        """The `(key, entry)` items of the cost model's reshards (`entry`: op -> ...)
        without the ops a relaxed checkpoint skips."""
        if not len(self.skipped):
            return list(dedup.items())
        skipped = set(self.skipped.tolist())
        kept = ((key, {o: x for o, x in e.items() if o not in skipped}) for key, e in dedup.items())
        return [(key, e) for key, e in kept if e]

    def work(self, work, mult) -> float:
        """Flops run again per step, net of the skipped ops, for per-op `work` run `mult`
        times per step (`mult` of ones: each loop body once, as XLA's cost analysis)."""
        return float((work * mult)[self.ops].sum()) - float((work * mult)[self.skipped].sum())

    def buffers(self, value_bytes):
        """(starts, ends, bytes) of the extra temporaries for per-device `value_bytes`."""
        return extra_buffers(self.extra, value_bytes)


def kernel_reruns(program, ops, attention) -> list[int]:
    """The recomputation's `ops` a backend runs again where attention is one fused
    kernel (`attention`, else None): its forward kernel runs again only to remake its
    output (the `p v` product) for a recomputation that reads it. The values inside the
    kernel (scores, probabilities) the backward pass reads are the backward kernel's to
    remake (it recomputes `q k^T`, priced with it: `_attention`), so a policy keeping
    the attention's output (torchtitan's selective op checkpointing, `every_other_dot`)
    reruns none of the kernel."""
    if attention is None or not attention.found:
        return list(ops)
    inside, ran = attention.values, set(ops)

    def of_kernel(o):
        return bool(attention.ops[o] or attention.dots[o])

    needed = set()
    stack = [o for o in ops if not of_kernel(o) or any(r >= 0 and not inside[r] for r in program.ops[o].results)]
    while stack:
        o = stack.pop()
        if o in needed:
            continue
        needed.add(o)
        stack += [program.producer[u] for u in program.ops[o].operands if u >= 0 and program.producer[u] in ran]
    return [o for o in ops if o in needed]


def carried_buffers(materialization, gone=frozenset(), stacked=frozenset()) -> list:
    """`(start, end, value, scale)` of the body buffers a scan's forward loop stacks
    for its fused residuals (`Materialization.carried`) that still need them: not when
    every such residual is recomputed (its stack is `gone`), nor when a recomputation
    stacks the buffer itself (it is in `stacked`: one stack serves both)."""
    return [c[:4] for c in materialization.carried if c[2] not in stacked and not set(c[4]) <= gone]


def extra_buffers(entries, value_bytes):
    """(starts, ends, bytes) of temporaries given as `(start, end, value, scale)`:
    `scale` times the value's per-device bytes (`value_bytes`)."""
    if not entries:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    starts, ends, values, scales = (np.array(x) for x in zip(*entries))
    return starts.astype(np.int64), ends.astype(np.int64), value_bytes[values] * scales


def _made(program, v: int) -> int:
    p = program.producer[v]
    return max(p, 0)


def _rederived_from_copies(sources: dict, slices: set) -> None:
    """What fuses into the readers of a recomputed residual's slice in the backward loop
    is re-derived from its recomputed copy (which lives across the slice's readers), as
    in line (see `Liveness`), not from the stack: `sources` drops the slices, else the
    stack's buffer would span both loops."""
    if not slices:
        return
    for v, srcs in sources.items():
        if slices.intersection(srcs):
            sources[v] = tuple(u for u in srcs if u not in slices)


def _rederived_in_line(program, virtual, sources, copies: set, backward) -> None:
    """What the backward pass fuses of a recomputed fused residual of unrolled code
    (`copies`) is re-derived from its recomputed copy, a temporary of its own, not from
    what the forward pass made it of: the sources of the backward's fused values are
    derived again from their operands with the copies left out (else the forward
    values it was made of stay live until the backward reads it, every layer's)."""
    if not copies:
        return
    changed = set(copies)
    for op in program.ops:
        if not backward[op.id] or not any(v in changed for v in op.operands):
            continue
        out: dict[int, None] = {}
        for v in op.operands:
            if v < 0 or v in copies or not program.values[v].shape:
                continue
            out.update(dict.fromkeys(sources.get(v, ()) if virtual[v] else (v,)))
        for w in op.results:
            if w >= 0 and virtual[w] and w in sources:
                sources[w] = tuple(out)
                changed.add(w)


def stacked_for_it(program, v: int) -> bool:
    """Does the forward loop stack `v`, a source of a recomputation in a scan body, for
    the backward loop to recompute from (`lowering/_recompute.ScanRemat.extra`)? Yes
    for the body's carry in (the layer input) and for what the body makes (a matmul's
    output the policy saves, `partir._remat`); not for its constants or its slices of
    stacked inputs, which the backward loop has too."""
    p = program.producer[v]
    if p < 0:
        return False
    op = program.ops[p]
    if op.link:
        return op.primitive in (Link.SCAN_CARRY_IN, Link.SCAN_CARRY_LOOP)
    return program.regions[program.values[v].region].kind == "scan"


def _reads_kept(program, reads: dict, virtual, sources: dict) -> list:
    """The forward values a relaxed checkpoint reads, kept for it (`virtual` and
    `sources` updated): in line, the read value stands for its forward rerun, which then
    lives until the read, a buffer even where XLA would fuse it into its forward readers
    (the checkpoint region reads its operands through an `optimization_barrier`); across
    a scan's two loops, the extra temporaries of the stacks the forward loop makes."""
    extra, stacked = [], set()
    ys = partir.stacked_outputs(program)
    for w, v in reads.items():
        fwd, bwd = _loop_of(program, v), _loop_of(program, w)
        if fwd < 0 or bwd < 0:
            virtual[v], sources[w] = False, (v,)
            sources.pop(v, None)
            continue
        sources.pop(w, None)
        if v not in ys and v not in stacked:  # a stacked residual is kept already
            stacked.add(v)
            end = max(o.id for o in program.ops if partir.scan_body_of(program, o.region) == bwd)
            extra.append((_made(program, v), end, v, program.regions[fwd].trip_count or 1))
    return extra


def _loop_of(program, v: int) -> int:
    return partir.scan_body_of(program, program.values[v].region)
