"""Weights a pipelined stage gathers once a pass instead of once per microbatch.

Inside a pipelined layer scan the plan's moves run per microbatch per tick. A stacked
input of the scan that is the same for every microbatch (a layer's weight) and that the
layers read only gathered over some axes of the plan (FSDP: split over `data` at rest,
read whole by the dots) would be gathered again at every tick, although it never
changes during the loop. `gathered_inputs` names those body inputs and the layout the
layers read them in; the lowerings gather the stage's block of all its layers to that
layout once, before the tick loop, and the body reads the gathered copy (the backward
scan, a loop of its own, gathers its inputs again before it, as Megatron and MaxText
re-gather for the backward pass rather than keep the forward's copy live across the
head); the cost model charges that gather once a pass, on the stage's layers.

Only where it is plainly right: every reader is an op of the body itself (not a nested
region, whose boundary moves the value as its link says), all read it in one layout,
that layout keeps a leading part of each dim's axes (the move is gathers alone), the
plan recomputes nothing inside the layers (a recomputation reads forward values in the
backward ticks), and the schedule is not the circular one (which exchanges the stacked
inputs for its chunks after their moves). Otherwise the value moves per microbatch as
before.
"""

from __future__ import annotations

from ._tiling import Tiling


def gathered_inputs(ext, call, in_dims, residuals, per_microbatch: bool) -> tuple:
    """(body input id, `Tiling` the layers read it in) of each stacked input of the
    pipelined scan `call` that a stage gathers once before its tick loop (see the
    module docstring); `ext` is the microbatched partitioning, `in_dims` the body
    inputs' microbatch dims (`ScanLayout.in_dims`); `residuals`: stacked inputs left as
    they are (1F1B's residuals, which it keeps in its ring of microbatches rather than
    as stacked blocks); `per_microbatch`: gather none early."""
    if per_microbatch:
        return ()
    prog = ext.program
    body = prog.regions[call.body]
    first = len(call.consts) + len(call.carry)
    out = []
    for v, dim, outer in zip(body.invars[first:], in_dims[first:], call.xs):
        if v < 0 or dim is not None or outer in residuals:
            continue
        need = _read_layout(ext, v, call.body)
        if need is not None and need != ext.tiling(v).dims and _gathers_only(ext.tiling(v).dims, need):
            out.append((v, Tiling(need)))
    return tuple(out)


def _read_layout(ext, v: int, region: int):
    """The one dim tiling every reader of `v` reads it in, all of them ops of `region`
    (None when a reader is a link or elsewhere, or two read it differently)."""
    prog, seen = ext.program, set()
    for o in prog.users[v]:
        op = prog.ops[o]
        if op.link or op.region != region:
            return None
        for layout in (ext.block_layout(o), ext.op_layout(o)):
            seen.update(dims for side, k, _, dims in layout[0] if side == "operand" and op.operands[k] == v)
    return next(iter(seen)) if len(seen) == 1 else None


def _gathers_only(have, need) -> bool:
    """Is moving dim tiling `have` to `need` gathers alone (each dim of `need` a
    leading part of the same dim of `have`)?"""
    return all(tuple(h[:len(n)]) == tuple(n) for h, n in zip(have, need))
