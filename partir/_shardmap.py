"""The `shard_map` lowering: the plan as the program each device runs, with explicit
collectives exactly where the plan moves data.

`lower(part, mesh, backend="shard_map")` runs the jaxpr region by region inside
`jax.shard_map` over the plan's mesh. Every value lives as its block under its at-rest
tiling. Before an op, each operand is moved from there to the layout the op reads it
in; the op runs on blocks (`partir._local`); after it, each result is moved from the
layout it comes out in (partial over the axes of split reduction factors) to its
at-rest tiling. Every move is the collectives `transition` names, run by
`partir._spmd.move` in the order and on the buffers the cost model charges, so the
compiled program holds the collectives the model lists. A value moved to one layout is
moved once per pass (forward or backward) in a region, as the model counts it.

Values made from scalars (broadcast constants, iotas, masks made of them: `free`) are
never moved: they are made whole from the scalars and each reader takes its block.
Nested jaxprs (calls, `jax.checkpoint`, `scan`, `while`, `cond`) are evaluated by their
`partir._nested` entries with this interpreter for their bodies; a value crossing a
region boundary is moved as the link op joining the two sides says.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from ._errors import PartitioningError
from ._lower import LAYOUT_ONLY, jit_with_layouts, register_backend
from ._lower_hooks import made_in_forward
from ._local import LocalOp, bind_local
from ._nested import evaluate_nested, split_operands
from ._partitioning import Partitioning
from ._spmd import move
from ._tiling import Tiling


@register_backend("shard_map")
def lower_shard_map(part: Partitioning, mesh, *, free=None, donate_argnums=()):
    """`jax.jit` of a `jax.shard_map` running the plan per device. `free` lists the values
    that may be made in any layout instead of moved (value ids or a boolean mask; by
    default those `Program.rematerializable` names); pass the cost model's
    (`search._fusion.materialization(program).from_scalars`) to lower exactly what it
    charges."""
    prog = part.program
    interp = _Interpreter(part, _free_mask(prog, free))
    in_specs = tuple(part.tiling(v).spec() for v in prog.inputs)
    out_specs = tuple(part.tiling(v).spec() if v >= 0 else jax.sharding.PartitionSpec() for v in prog.outputs)
    body = jax.shard_map(lambda *xs: tuple(interp.top(xs)), mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)

    def run(*args):
        return jax.tree_util.tree_unflatten(prog.out_tree, body(*jax.tree_util.tree_leaves(args)))

    return jit_with_layouts(run, part, mesh, donate_argnums)


def _free_mask(prog, free) -> list[bool]:
    n = len(prog.values)
    if free is None:
        return [prog.rematerializable(v) for v in range(n)]
    arr = np.asarray(list(free))
    if arr.dtype == bool:
        if arr.shape != (n,):
            raise PartitioningError(f"free= is a mask of {arr.size} entries; the program has {n} values")
        return arr.tolist()
    ids = set(arr.astype(int).tolist())
    return [v in ids for v in range(n)]


class _Frame:
    """One run of one region: its values' blocks at rest (`env`), the values made whole
    (`whole`), and the moves made so far (one per value, layout and pass)."""

    def __init__(self, interp: "_Interpreter", rid: int):
        self.interp = interp
        self.region = region = interp.prog.regions[rid]
        self.env, self.whole, self.moved = {}, {}, {}
        self.last = None  # the latest value the backward pass made here
        jaxpr = region.jaxpr
        self.vid = dict(zip(jaxpr.constvars, region.constvars))
        self.vid.update(zip(jaxpr.invars, region.invars))
        for eqn, vids in zip(jaxpr.eqns, region.eqn_results):
            self.vid.update((var, v) for var, v in zip(eqn.outvars, vids) if v >= 0)

    def id_of(self, var) -> int:
        return -1 if isinstance(var, Literal) else self.vid[var]

    def read(self, var, need: Tiling | None = None, backward: bool = False, again: bool = False, after=None):
        """`var`'s block in layout `need` (at rest when None). A forward value moved
        `again` by the backward pass is moved in a form XLA does not merge with the
        forward's move, after `after` (a value the backward pass made) when given: it is
        then not kept moved in between either, as the model charges it."""
        if isinstance(var, Literal):
            return var.val
        interp, v = self.interp, self.vid[var]
        rest = interp.part.tiling(v)
        need = rest if need is None else need
        if var in self.whole:
            key = (v, need.dims, "whole")
            if key not in self.moved:
                self.moved[key] = move(self.whole[var], Tiling.replicated(need.rank), need, interp.mesh)
            return self.moved[key]
        if need.dims == rest.dims:
            return self.env[var]
        key = (v, need.dims, backward)
        if key not in self.moved:
            x = self.env[var]
            if after is not None:
                x, _ = jax.lax.optimization_barrier((x, after))
            self.moved[key] = move(x, rest, need, interp.mesh, again=again)
        return self.moved[key]


class _Interpreter:
    """Runs the program's regions on one device's blocks (see the module docstring)."""

    def __init__(self, part: Partitioning, free: list[bool]):
        self.part, self.prog, self.mesh = part, part.program, part.mesh
        self.free = free
        self.backward = self.prog.backward

    def top(self, args) -> list:
        return self.region(0, list(args))

    def region(self, rid: int, args, whole=None) -> list:
        """The blocks of region `rid`'s outputs at rest, from its inputs' blocks at rest
        (`args`) and the inputs also given whole (`whole`: input position -> array)."""
        frame = _Frame(self, rid)
        region, jaxpr = frame.region, frame.region.jaxpr
        for var, c in zip(jaxpr.constvars, region.consts):
            frame.whole[var] = jnp.asarray(c)
        frame.env.update(zip(jaxpr.invars, args))
        for k, x in (whole or {}).items():
            frame.whole[jaxpr.invars[k]] = x
        for i, eqn in enumerate(jaxpr.eqns):
            with jax.named_scope(str(eqn.source_info.name_stack) or "_"):
                if i in region.children:
                    self._nested(frame, i, eqn)
                else:
                    self._op(frame, eqn, region.eqn_ops[i])
        return [jnp.asarray(frame.read(x)) for x in jaxpr.outvars]

    # -- ops ---------------------------------------------------------------------------
    def _op(self, frame: _Frame, eqn, oid: int) -> None:
        part, op = self.part, self.prog.ops[oid]
        if self._made_whole(frame, eqn, op):
            return
        slots, partial, kind = part.op_layout(oid)
        need = {k: Tiling(d) for side, k, _, d in slots if side == "operand"}
        made = {k: d for side, k, _, d in slots if side == "result"}
        backward = self.backward[oid]
        after = self._anchor(frame, eqn, op) if backward else None
        operands = []
        for k, (x, v) in enumerate(zip(eqn.invars, op.operands)):
            again = backward and v >= 0 and self.forward(v)
            operands.append(frame.read(x, need.get(k), backward, again, after if again else None))
        if eqn.primitive.name in LAYOUT_ONLY:
            outs = operands  # the identity: the plan's layouts replace the program's requests
        else:
            local = LocalOp(eqn, tuple(need.get(k) for k in range(len(eqn.invars))),
                            tuple(Tiling(made[k]) if k in made else None for k in range(len(eqn.outvars))),
                            tuple(tuple(getattr(x.aval, "shape", ())) for x in eqn.invars),
                            tuple(tuple(getattr(x.aval, "shape", ())) for x in eqn.outvars), self.mesh)
            outs = bind_local(local, operands)
        for k, (var, v) in enumerate(zip(eqn.outvars, op.results)):
            if v >= 0:
                frame.env[var] = move(outs[k], Tiling(made[k], partial, kind), part.tiling(v), self.mesh)
        if backward and outs:
            frame.last = outs[0]

    def forward(self, v: int) -> bool:
        """Is value `v` made by the forward pass (or an input)?"""
        return made_in_forward(self.prog, v)

    def _anchor(self, frame: _Frame, eqn, op):
        """A value of the backward pass that op `op` reads (else the latest one made)."""
        for x, v in zip(eqn.invars, op.operands):
            if v >= 0 and x in frame.env and not self.forward(v):
                return frame.env[x]
        return frame.last

    def _made_whole(self, frame: _Frame, eqn, op) -> bool:
        """Make a value from scalars whole (where all it is made from is whole or a
        scalar): its readers each take their block, and nothing is moved."""
        if not all(v < 0 or self.free[v] for v in op.results) or not any(v >= 0 for v in op.results):
            return False
        if not all(isinstance(x, Literal) or x in frame.whole or not getattr(x.aval, "shape", ()) for x in eqn.invars):
            return False
        args = [frame.whole[x] if not isinstance(x, Literal) and x in frame.whole else frame.read(x)
                for x in eqn.invars]
        outs = eqn.primitive.bind(*args, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        frame.whole.update((var, o) for var, v, o in zip(eqn.outvars, op.results, outs) if v >= 0)
        return True

    # -- region boundaries ------------------------------------------------------------
    def link(self, src: int, dst: int) -> int | None:
        """The link op carrying value `src` to value `dst`, if there is one."""
        for o in self.prog.users[src]:
            op = self.prog.ops[o]
            if op.link and op.results[0] == dst:
                return o
        return None

    def cross(self, x, src: int, dst: int, *, to_made: bool = False):
        """`x`, a block of value `src` at rest, as a block of `dst` at rest, moved as the
        link op between them says (a direct move without one). With `to_made`, stop at
        the layout the link makes (for a scan's per-iteration outputs, whose stacked
        value is moved to rest after the loop). Ranks are fitted to `x` (a stacked
        `[L, ...]` value has the layer dim first, never split)."""
        if src < 0 or dst < 0:
            return x
        part, rank = self.part, jnp.ndim(x)
        o = self.link(src, dst)
        if o is None:
            return x if to_made else move(x, _fit(part.tiling(src), rank), _fit(part.tiling(dst), rank), self.mesh)
        slots, partial, kind = part.op_layout(o)
        (need,) = [d for side, _, _, d in slots if side == "operand"]
        (made,) = [d for side, _, _, d in slots if side == "result"]
        x = move(x, _fit(part.tiling(src), rank), _fit(Tiling(need), rank), self.mesh)
        made = _fit(Tiling(made, partial, kind), rank)
        return x if to_made else move(x, made, _fit(part.tiling(dst), rank), self.mesh)

    def _nested(self, frame: _Frame, i: int, eqn) -> None:
        region = frame.region
        children, results = region.children[i], region.eqn_results[i]
        ins = [frame.id_of(x) for x in eqn.invars]
        operands = [frame.read(x) for x in eqn.invars]
        whole = {k: frame.whole[x] for k, x in enumerate(eqn.invars) if not isinstance(x, Literal) and x in frame.whole}
        boundary = _BOUNDARIES.get(eqn.primitive.name, _call)
        outs = boundary(self, eqn, children, ins, results, operands, whole)
        for var, v, o in zip(eqn.outvars, results, outs):
            if v >= 0:
                frame.env[var] = o

    def rest(self, v: int) -> Tiling:
        return self.part.tiling(v)


def _fit(t: Tiling, rank: int) -> Tiling:
    """`t` for an array of `rank` dims: a stacked value's unsplit layer dim added or
    dropped."""
    if t.rank == rank:
        return t
    if t.rank == rank - 1:
        return Tiling(((),) + t.dims, t.partial, t.reduce_kind)
    if t.rank == rank + 1 and not t.dims[0]:
        return Tiling(t.dims[1:], t.partial, t.reduce_kind)
    raise PartitioningError(f"cannot fit layout {t} to a rank-{rank} block at a region boundary")


# -- how each nested primitive's values cross into and out of its bodies ----------------


def _call(interp: _Interpreter, eqn, children, ins, results, operands, whole) -> list:
    """Calls, `jax.checkpoint` and `cond` branches: each body takes the last operands
    (a cond's first is its branch index) and gives the results."""
    prog = interp.prog

    def run(child, args):
        r = prog.regions[child]
        src = ins[len(ins) - len(r.invars):]
        first = len(ins) - len(r.invars)
        args = [interp.cross(a, u, w) for a, u, w in zip(args, src, r.invars)]
        given = {k - first: x for k, x in whole.items() if k >= first}
        outs = interp.region(child, args, given)
        return [interp.cross(y, u, v) for y, u, v in zip(outs, r.outvars, results)]

    return evaluate_nested(eqn, children, operands, run)


def _scan(interp: _Interpreter, eqn, children, ins, results, operands, whole) -> list:
    """Constants, the initial carry and the stacked inputs are moved into the body's
    layouts before the loop; the carry goes round in the body's layout; per-iteration
    outputs are stacked, then moved to rest."""
    (child,) = children
    body = interp.prog.regions[child]
    g, w = split_operands(eqn, ins), split_operands(eqn, list(body.invars))
    x = split_operands(eqn, operands)
    entering = [interp.cross(a, u, v) for a, u, v in zip(x.consts + x.carry + x.xs, g.consts + g.carry + g.xs,
                                                         w.consts + w.carry + w.xs)]
    nk = len(g.carry)
    given = {k: a for k, a in whole.items() if k < len(g.consts)}

    def run(c, args):
        outs = interp.region(c, args, given)
        ov = body.outvars
        carry = [interp.cross(y, u, v) for y, u, v in zip(outs[:nk], ov[:nk], w.carry)]
        return carry + [interp.cross(y, u, v, to_made=True) for y, u, v in zip(outs[nk:], ov[nk:], results[nk:])]

    outs = evaluate_nested(eqn, children, entering, run)
    final = [move(y, interp.rest(v), interp.rest(r), interp.mesh) if r >= 0 else y
             for y, v, r in zip(outs[:nk], w.carry, results[:nk])]
    return final + [_stacked_to_rest(interp, y, u, r) for y, u, r in zip(outs[nk:], body.outvars[nk:], results[nk:])]


def _stacked_to_rest(interp: _Interpreter, y, inner: int, outer: int):
    if outer < 0 or inner < 0:
        return y
    o = interp.link(inner, outer)
    if o is None:
        made = _fit(interp.rest(inner), jnp.ndim(y))
    else:
        slots, partial, kind = interp.part.op_layout(o)
        (dims,) = [d for side, _, _, d in slots if side == "result"]
        made = Tiling(dims, partial, kind)
    return move(y, made, interp.rest(outer), interp.mesh)


def _while(interp: _Interpreter, eqn, children, ins, results, operands, whole) -> list:
    """Constants are moved into their body's layouts and the carry into the body's before
    the loop; the condition reads the carry in its own layout."""
    cid, bid = children
    cond, body = interp.prog.regions[cid], interp.prog.regions[bid]
    g, x = split_operands(eqn, ins), split_operands(eqn, operands)
    cn, bn = len(g.cond_consts), len(g.body_consts)
    carry_w = body.invars[bn:]
    entering = ([interp.cross(a, u, v) for a, u, v in zip(x.cond_consts, g.cond_consts, cond.invars[:cn])]
                + [interp.cross(a, u, v) for a, u, v in zip(x.body_consts, g.body_consts, body.invars[:bn])]
                + [interp.cross(a, u, v) for a, u, v in zip(x.carry, g.carry, carry_w)])
    given = {cid: {k: a for k, a in whole.items() if k < cn},
             bid: {k - cn: a for k, a in whole.items() if cn <= k < cn + bn}}

    def run(c, args):
        if c == cid:
            carry = [move(a, interp.rest(u), interp.rest(v), interp.mesh) for a, u, v in
                     zip(args[cn:], carry_w, cond.invars[cn:])]
            return interp.region(c, list(args[:cn]) + carry, given[cid])
        outs = interp.region(c, args, given[bid])
        return [interp.cross(y, u, v) for y, u, v in zip(outs, body.outvars, carry_w)]

    outs = evaluate_nested(eqn, children, entering, run)
    return [move(y, interp.rest(v), interp.rest(r), interp.mesh) if r >= 0 else y
            for y, v, r in zip(outs, carry_w, results)]


#: Nested primitives whose bodies are not simply called on the operands.
_BOUNDARIES = {"scan": _scan, "while": _while}
