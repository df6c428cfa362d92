"""Weights a pipelined stage gathers once a pass instead of once per microbatch.

Inside a pipelined layer scan the plan's moves run per microbatch per tick. A stacked
input of the scan that is the same for every microbatch (a layer's weight) and that the
layers read only gathered over some axes of the plan (FSDP: split over `data` at rest,
read whole by the dots) would be gathered again at every tick, although it never
changes during the loop (or a cast or broadcast of it: a float32 master weight cast to
the compute dtype inside the layer, a norm's [D] scale broadcast to [1, 1, D] for the
product reading it, which the stage then casts or broadcasts once too). `gathered_inputs` names
those body inputs and the layout the layers read them in (`Gathered`); the lowerings
gather the stage's block of all its layers to that layout once, before the tick loop,
and the body reads the gathered copy (the backward
scan, a loop of its own, gathers its inputs again before it, as Megatron and MaxText
re-gather for the backward pass rather than keep the forward's copy live across the
head); the cost model charges that gather once a pass, on the stage's layers.

The weight may reach its readers through a call inside the layers: the user's
`jax.checkpoint` of a layer (whose backward scan reads the weights in the
checkpoint's recomputation), a `jit`. A call runs once per tick as the ops around it
do, so a `Link.CALL_IN` that moves nothing (`call_link`) hands the gathered copy on as
it is (`Gathered.via`), and casts inside the callee are run once on the stage's block
as those outside it are.

Only where it is plainly right: every reader is an op of the region the chain of
casts and calls ends in (not a nested region of another kind, whose boundary moves the
value as its link says), all read it in one layout,
that layout keeps a leading part of each dim's axes (the move is gathers alone), the
plan relaxes no user checkpoint inside the layers (reading forward values in the
backward ticks), and the schedule is not the circular one over contiguous blocks
(which exchanges the stacked inputs for its chunks after their moves). Otherwise the
value moves per microbatch as before.

Where the layers recompute (`Remat`), the backward ticks' recomputation reads the
weights the stage gathered before the backward loop (its slice of the same stack, as
the backward body holds it), or the forward's gathered block where the backward body
reads none of that stack (a norm scale, broadcast once: `StageRemat` saves the block
gathered), and a residual it remakes from such a chain is held as the chain's end is
(`ScanLayout.recomputed`). A recomputed residual's stacked placeholder is no weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._nested import Link
from ._tiling import Tiling

#: Ops a stage may run on its whole block of a weight once before its tick loop rather
#: than in every tick: elementwise casts of one operand (a float32 master weight cast to
#: the compute dtype inside the layer), whose result is the same whatever the block.
CASTS = ("convert_element_type", "copy", "copy_p", "reduce_precision")
#: Ops a stage may likewise run once on its block, per layer (`jax.vmap` over the layer
#: dim): a broadcast of the weight to the rank of the activation it scales (a layer
#: norm's [D] scale made [1, 1, D]), whose new dims no plan splits. FSDP splits the
#: scale and so the broadcast's result, which the product then gathers: in every tick,
#: unless the stage broadcasts once and gathers the broadcast.
BROADCASTS = ("broadcast_in_dim",)


@dataclass(frozen=True)
class Gathered:
    """A stacked input of a pipelined scan that its stage gathers once before the tick
    loop: body input `input`, cast or broadcast by `ops` (op ids, in order: `CASTS`,
    `BROADCASTS`) into `value`
    (`input` itself when `ops` is empty), which the layers read in `layout`. `via`:
    (the value handed to a call, the callee's input it enters) of each `Link.CALL_IN`
    the chain crosses on the way (`call_link`), in order; both held in `layout` too."""

    input: int
    value: int
    layout: Tiling
    ops: tuple[int, ...] = ()
    via: tuple[tuple[int, int], ...] = ()


def call_link(ext, op) -> bool:
    """Is `op` (an op of a pipelined body) a `Link.CALL_IN` or `Link.CALL_OUT` that
    moves nothing: reads its operand at rest, makes its result at rest, in one layout?
    The call runs once per tick like the ops around it, so what a stage holds once a
    pass (a gathered weight, a gradient accumulated whole) crosses it as it is."""
    if not op.link or op.primitive not in (Link.CALL_IN, Link.CALL_OUT):
        return False
    (u,), (w,) = op.operands, op.results
    if u < 0 or w < 0:
        return False
    have = ext.tiling(u)
    if ext.tiling(w) != have:
        return False
    slots, partial, _ = ext.op_layout(op.id)
    return not partial and all(tuple(dims) == have.dims for _, _, _, dims in slots)


def gathered_inputs(ext, call, in_dims, residuals, per_microbatch: bool) -> tuple:
    """The `Gathered` stacked inputs of the pipelined scan `call` (see the module
    docstring); `ext` is the microbatched partitioning, `in_dims` the body inputs'
    microbatch dims (`ScanLayout.in_dims`); `residuals`: stacked inputs left as they are
    (1F1B's residuals, which it keeps in its ring of microbatches rather than as stacked
    blocks); `per_microbatch`: gather none early."""
    if per_microbatch:
        return ()
    prog = ext.program
    body = prog.regions[call.body]
    first = len(call.consts) + len(call.carry)
    out = []
    for v, dim, outer in zip(body.invars[first:], in_dims[first:], call.xs):
        if v < 0 or dim is not None or outer in residuals:
            continue
        u, region, ops, via = _chain(ext, v, call.body)
        need = _read_layout(ext, u, region)
        if need is not None and need != ext.tiling(u).dims and _gathers_only(ext.tiling(u).dims, need):
            out.append(Gathered(v, u, Tiling(need), ops, via))
    return tuple(out)


def _chain(ext, v: int, region: int) -> tuple:
    """(the value `v` is made into by a chain of `CASTS` and `BROADCASTS`, each the one
    reader of what the previous made, reading it at rest and keeping its layout, and of
    `Link.CALL_IN`s into calls that move nothing (`call_link`); the region it is in;
    the chain's op ids, links aside; its links as `Gathered.via`)."""
    prog, ops, via = ext.program, [], []
    while len(prog.users[v]) == 1:
        op = prog.ops[prog.users[v][0]]
        if op.link:
            if op.primitive != Link.CALL_IN or not call_link(ext, op):
                break
            via.append((v, op.results[0]))
            v, region = op.results[0], prog.values[op.results[0]].region
            continue
        outs = [r for r in op.results if r >= 0]
        if (op.region != region or len(outs) != 1 or _read_layout(ext, v, region) != ext.tiling(v).dims
                or not _keeps_layout(op, ext.tiling(v).dims, ext.tiling(outs[0]).dims)):
            break
        ops.append(op.id)
        v = outs[0]
    return v, region, tuple(ops), tuple(via)


def _keeps_layout(op, have, made) -> bool:
    """Does `op`, a cast or a broadcast, make from its operand's dim tiling `have` the
    same tiling of its dims (`made`), the broadcast's new dims whole?"""
    if op.primitive in CASTS:
        return made == have
    if op.primitive not in BROADCASTS:
        return False
    kept = tuple(op.eqn.params["broadcast_dimensions"])
    return (tuple(made[d] for d in kept) == tuple(have)
            and all(not axes for d, axes in enumerate(made) if d not in kept))

def _read_layout(ext, v: int, region: int):
    """The one dim tiling every reader of `v` reads it in, all of them ops of `region`
    (None when a reader is a link or elsewhere, or two read it differently); but for
    the link stacking it as a per-layer output (a weight kept for the backward pass: the
    body gives it at rest, cut from the gathered block, which moves nothing)."""
    prog, seen = ext.program, set()
    for o in prog.users[v]:
        op = prog.ops[o]
        if op.link and op.primitive == Link.SCAN_YS:
            continue
        if op.link or op.region != region:
            return None
        for layout in (ext.block_layout(o), ext.op_layout(o)):
            seen.update(dims for side, k, _, dims in layout[0] if side == "operand" and op.operands[k] == v)
    return next(iter(seen)) if len(seen) == 1 else None


def _gathers_only(have, need) -> bool:
    """Is moving dim tiling `have` to `need` gathers alone (each dim of `need` a
    leading part of the same dim of `have`)?"""
    return all(tuple(h[:len(n)]) == tuple(n) for h, n in zip(have, need))
