"""How values cross into and out of nested bodies under the `shard_map` lowering.

A value entering or leaving a body (a call's operand, a scan's constant, carry or
stacked input, a branch's result) is a block at rest on one side and must be a block at
rest on the other. The link op joining the two (`partir.Link`) says how the plan moves
it: from the outer value's layout to the layout the link reads it in, then from the
layout the link makes to the inner value's (`cross`), which is what the cost model
charges at that link. One entry per nested primitive whose bodies are not simply
called on its operands (`BOUNDARIES`); the others are `call`s.
"""

from __future__ import annotations

import jax.numpy as jnp

from .._errors import PartitioningError
from .._nested import evaluate_nested, split_operands
from .._tiling import Tiling
from ._spmd import move


def fit(t: Tiling, rank: int) -> Tiling:
    """`t` for an array of `rank` dims: a stacked value's unsplit layer dim added or
    dropped."""
    if t.rank == rank:
        return t
    if t.rank == rank - 1:
        return Tiling(((),) + t.dims, t.partial, t.reduce_kind)
    if t.rank == rank + 1 and not t.dims[0]:
        return Tiling(t.dims[1:], t.partial, t.reduce_kind)
    raise PartitioningError(f"cannot fit layout {t} to a rank-{rank} block at a region boundary")


def _placeholder(interp, x, v: int) -> bool:
    """Is `x` what a scan stacks instead of a residual it no longer keeps (a scalar per
    iteration, or a blockwise attention's saved rows, `SavedRows`, as the device
    made them: `OnlineRings.unmoved`), standing for value `v`?"""
    if v in interp.online.unmoved:
        return True
    if interp.remat is not None and v in interp.remat.scans.placeholders:
        return True
    return jnp.ndim(x) == 0 and interp.prog.values[v].rank > 0


def cross(interp, x, src: int, dst: int, *, to_made: bool = False):
    """`x`, a block of value `src` at rest, as a block of `dst` at rest, moved as the link
    op between them says (a direct move without one). With `to_made`, stop at the layout
    the link makes (for a scan's per-iteration outputs, whose stacked value is moved to
    rest after the loop). Ranks are fitted to `x` (a stacked `[L, ...]` value has the
    layer dim first, never split). Where a pipeline holds both in one layout
    (`Interpreter.held`: the link is a call's that moves nothing), `x` as it is."""
    if src < 0 or dst < 0 or _placeholder(interp, x, src):
        return x
    if src in interp.held and interp.held[src] == interp.held.get(dst):
        return x  # (a pipeline holds both alike: a weight gathered once, a gradient accumulated whole)
    part, rank, mesh = interp.part, jnp.ndim(x), interp.move_mesh
    o = interp.link(src, dst)
    if o is None:
        return x if to_made else move(x, fit(part.tiling(src), rank), fit(part.tiling(dst), rank), mesh)
    slots, partial, kind = part.op_layout(o)
    (need,) = [d for side, _, _, d in slots if side == "operand"]
    (made,) = [d for side, _, _, d in slots if side == "result"]
    x = move(x, fit(part.tiling(src), rank), fit(Tiling(need), rank), mesh)
    made = fit(Tiling(made, partial, kind), rank)
    return x if to_made else move(x, made, fit(part.tiling(dst), rank), mesh)


def call(interp, eqn, children, ins, results, operands, whole) -> list:
    """Calls, `jax.checkpoint` and `cond` branches: each body takes the last operands
    (a cond's first is its branch index) and gives the results."""
    prog = interp.prog

    def run(child, args):
        r = prog.regions[child]
        first = len(ins) - len(r.invars)
        args = [cross(interp, a, u, w) for a, u, w in zip(args, ins[first:], r.invars)]
        given = {k - first: x for k, x in whole.items() if k >= first}
        outs = interp.region(child, args, given)
        return [cross(interp, y, u, v) for y, u, v in zip(outs, r.outvars, results)]

    return evaluate_nested(eqn, children, operands, run)


def scan(interp, eqn, children, ins, results, operands, whole) -> list:
    """Constants, the initial carry and the stacked inputs are moved into the body's
    layouts before the loop; the carry goes round in the body's layout; per-iteration
    outputs are stacked, then moved to rest. A scan whose body's residuals are
    recomputed runs as `_recompute.ScanRemat` says."""
    (child,) = children
    body = interp.prog.regions[child]
    g, w = split_operands(eqn, ins), split_operands(eqn, list(body.invars))
    x = split_operands(eqn, operands)
    entering = [cross(interp, a, u, v) for a, u, v in zip(x.consts + x.carry + x.xs, g.consts + g.carry + g.xs,
                                                          w.consts + w.carry + w.xs)]
    nk = len(g.carry)
    given = {k: a for k, a in whole.items() if k < len(g.consts)}

    def run(c, args):
        outs = interp.region(c, args, given)
        ov = body.outvars
        carry = [cross(interp, y, u, v) for y, u, v in zip(outs[:nk], ov[:nk], w.carry)]
        return carry + [cross(interp, y, u, v, to_made=True) for y, u, v in zip(outs[nk:], ov[nk:], results[nk:])]

    outs = None
    if interp.remat is not None:
        outs = interp.remat.scans.evaluate(eqn, children, split_operands(eqn, entering), run, interp.values)
    if outs is None:
        outs = evaluate_nested(eqn, children, entering, run)
    final = [move(y, interp.rest(v), interp.rest(r), interp.move_mesh) if r >= 0 else y
             for y, v, r in zip(outs[:nk], w.carry, results[:nk])]
    return final + [_stacked_to_rest(interp, y, u, r) for y, u, r in zip(outs[nk:], body.outvars[nk:], results[nk:])]


def _stacked_to_rest(interp, y, inner: int, outer: int):
    if outer < 0 or inner < 0 or _placeholder(interp, y, outer):
        return y
    o = interp.link(inner, outer)
    if o is None:
        made = fit(interp.rest(inner), jnp.ndim(y))
    else:
        slots, partial, kind = interp.part.op_layout(o)
        (dims,) = [d for side, _, _, d in slots if side == "result"]
        made = Tiling(dims, partial, kind)
    return move(y, made, interp.rest(outer), interp.move_mesh)


def while_loop(interp, eqn, children, ins, results, operands, whole) -> list:
    """Constants are moved into their body's layouts and the carry into the body's before
    the loop; the condition reads the carry in its own layout."""
    cid, bid = children
    cond, body = interp.prog.regions[cid], interp.prog.regions[bid]
    g, x = split_operands(eqn, ins), split_operands(eqn, operands)
    cn, bn = len(g.cond_consts), len(g.body_consts)
    carry_w = body.invars[bn:]
    entering = ([cross(interp, a, u, v) for a, u, v in zip(x.cond_consts, g.cond_consts, cond.invars[:cn])]
                + [cross(interp, a, u, v) for a, u, v in zip(x.body_consts, g.body_consts, body.invars[:bn])]
                + [cross(interp, a, u, v) for a, u, v in zip(x.carry, g.carry, carry_w)])
    given = {cid: {k: a for k, a in whole.items() if k < cn},
             bid: {k - cn: a for k, a in whole.items() if cn <= k < cn + bn}}

    def run(c, args):
        if c == cid:
            carry = [move(a, interp.rest(u), interp.rest(v), interp.move_mesh) for a, u, v in
                     zip(args[cn:], carry_w, cond.invars[cn:])]
            return interp.region(c, list(args[:cn]) + carry, given[cid])
        outs = interp.region(c, args, given[bid])
        return [cross(interp, y, u, v) for y, u, v in zip(outs, body.outvars, carry_w)]

    outs = evaluate_nested(eqn, children, entering, run)
    return [move(y, interp.rest(v), interp.rest(r), interp.move_mesh) if r >= 0 else y
            for y, v, r in zip(outs, carry_w, results)]


#: Nested primitives whose bodies are not simply called on the operands.
BOUNDARIES = {"scan": scan, "while": while_loop}
