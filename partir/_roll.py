"""Rolling unrolled layers into layer scans: the train step of a program whose layers are
a Python sequence of alike pytrees rewritten as the scan form `jax.lax.scan` over
stacked layers would give, so that what runs on layer scans (pipelines) runs on it.

The layers are found in the traced jaxpr from the dataflow. Layer l's parameters
(`partir._layers`: the inputs under a sequence of alike layers) are first read by an
equation of its forward pass, and again, later, by one of its backward pass; the L
forward passes follow one another at a fixed period of equations, and the backward
passes too, in reverse. Each pass is cut into L contiguous *regions* of one period
each (`_pass` tries every offset of the cut against the first read), and the regions
must be isomorphic: the same primitives, params and shapes at each position, reading
the same positions of their own region, the same outer value (a constant of the loop),
the previous region's value at one position (a carry), or one value per layer (a
stacked input: a layer's parameter, or for the backward pass a value its layer's
forward region made or read). Anything else refuses the roll, naming the first
difference. The rolled step evaluates the original equations (their names kept, so a
transposed one is still seen as backward): the outer ones as they were, the first
region as the body of a `lax.scan` over the per-layer values stacked on a leading
[L] dim; the backward scan reads the forward scan's stacked outputs and the same
stacks of parameters; what the rest of the step reads of a region (the gradients) is
cut from the stacked outputs one layer at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, DebugInfo, Jaxpr, Literal, jaxpr_as_fun

from ._errors import PartitioningError
from ._ir import _source

#: How a region's outer value is fed to the scan body (`Slot.kind`): the same value for
#: every layer, the previous region's value, one value per layer stacked on [L].
CONST, CARRY, STACK = "const", "carry", "stack"


@dataclass(frozen=True)
class Slot:
    """One outer value the template region reads (`var`: the template's own), and how
    (`kind`): `values` the per-region values in execution order, `made` the
    (equation, result) position of the previous region's value for a carry."""

    var: object
    kind: str
    values: tuple
    made: tuple = ()


@dataclass(frozen=True)
class Loop:
    """Isomorphic regions of a pass: `starts` (execution order), `period` equations each,
    `layers` the layer each runs, `slots` what the body reads, `carries` the template's
    (equation, result) positions passed on, `outs` those read outside the loop."""

    starts: tuple[int, ...]
    period: int
    layers: tuple[int, ...]
    slots: tuple[Slot, ...]
    carries: tuple[tuple[int, int], ...]
    outs: tuple[tuple[int, int], ...]

    @property
    def span(self) -> tuple[int, int]:
        """[first, end) equation indices of the loop's regions."""
        return min(self.starts), max(self.starts) + self.period

    def var_at(self, eqns, r: int, pos) -> object:
        """The variable region `r` (execution order) makes at position `pos`."""
        return eqns[self.starts[r] + pos[0]].outvars[pos[1]]


class UnlikeLayers(PartitioningError):
    """The unrolled layers are not alike where rolling them (or stacking them,
    `partir.stack_layers`, which finds their passes with this module's helpers) needs
    them to be: `why` names the first difference, and the message says what to do."""

    def __init__(self, why: str):
        super().__init__(f"cannot roll the unrolled layers into a layer scan: {why}; write the layers as a "
                         "jax.lax.scan over stacked parameters (scan_layers=True in the examples), or leave the "
                         "pipeline out")
        self.why = why


def _refuse(why: str):
    raise UnlikeLayers(why)


def roll_layers(program):
    """`program` (lifted from a step over unrolled layers) with its layers rolled into a
    forward layer scan and, where it differentiates them, a backward scan: the same
    inputs, outputs and names, `Program.rolled` naming the scans. Refused
    (`PartitioningError`, naming the first difference) where the layers' passes are
    not alike."""
    from ._layers import input_layers
    from ._lift import _build

    where = {v: k for k, v in enumerate(program.inputs)}
    layer_of = {where[v]: layer for v, layer in input_layers(program).items()}
    closed, rolled = roll_jaxpr(program.closed_jaxpr, layer_of)
    return _build(closed, program.in_tree, program.out_tree, program.input_names, program.input_args,
                  program.output_names, program.origin, rolled, _stack_names(program, closed))


def _stack_names(program, closed: ClosedJaxpr) -> dict:
    """The stacks of the layers' inputs named as their layers' path with the layer index
    `[:]` (`params['layers'][:]['mlp']['w1']`): a plan file names them so, not by the
    roll's source line."""
    from ._layers import layer_keys

    keys = layer_keys(program, 2) or {}
    index = {v: k for k, v in enumerate(closed.jaxpr.invars)}
    out = {}
    for eqn in closed.jaxpr.eqns:
        first = eqn.invars[0] if eqn.primitive.name == "stack" and eqn.invars else None
        if isinstance(first, Literal) or first not in index:
            continue
        arg, path, at = keys.get(program.inputs[index[first]], (None, (), None))
        if at is not None:
            out[eqn.outvars[0]] = f"{arg}{jax.tree_util.keystr(path[1:at])}[:]{jax.tree_util.keystr(path[at + 1:])}"
    return out


def roll_jaxpr(closed: ClosedJaxpr, layer_of: dict[int, int]) -> tuple[ClosedJaxpr, tuple[int, ...]]:
    """`closed` with its unrolled layers rolled into a forward layer scan and, where the
    program differentiates them, a backward scan, and the top-level equation indices of
    those scans; `layer_of` maps the index of each input of a layer to its layer."""
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    params = {v: layer_of[k] for k, v in enumerate(jaxpr.invars) if k in layer_of}
    count = len(set(params.values()))
    if count < 2:
        _refuse("the step takes fewer than two alike layers (a list or tuple of pytrees of one structure)")
    fwd = _pass(eqns, params, count, 0, reverse=False, outvars=jaxpr.outvars)
    end = fwd.span[1]
    # The backward pass may read a layer's parameters as the forward made them from them
    # alone (a mixed-precision step's bfloat16 copies), not the parameters themselves.
    made = _weight_copies(eqns[:end], params)
    bwd = _pass(eqns, made, count, end, reverse=True, outvars=jaxpr.outvars) \
        if any(_reads(e, made) for e in eqns[end:]) else None
    rolled = _rolled(closed, fwd, bwd)
    # The rolled step runs the outer equations as they were: the scans made are the
    # first after as many as the original holds before each loop.
    scans = [i for i, e in enumerate(rolled.jaxpr.eqns) if e.primitive.name == "scan"]
    before = _scans_in(eqns[:fwd.span[0]])
    made = (before,) if bwd is None else (before, before + 1 + _scans_in(eqns[end:bwd.span[0]]))
    return rolled, tuple(scans[k] for k in made)


def _weight_copies(eqns, params: dict) -> dict:
    """`params` (variable -> layer) with the values `eqns` make from one layer's
    parameters alone (casts, transposes of its weights), mapped to that layer."""
    out = dict(params)
    for e in eqns:
        layers = {out.get(v) for v in e.invars if not isinstance(v, Literal)}
        if len(layers) == 1 and None not in layers:
            out.update(dict.fromkeys(e.outvars, layers.pop()))
    return out


def _scans_in(eqns) -> int:
    return sum(e.primitive.name == "scan" for e in eqns)


def _reads(eqn, params) -> set:
    return {params[v] for v in eqn.invars if not isinstance(v, Literal) and v in params}


def _pass(eqns, params, count: int, begin: int, *, reverse: bool, outvars) -> Loop:
    """The loop of one pass (forward from `begin`, or the backward pass after it)."""
    first: dict[int, int] = {}
    for i in range(begin, len(eqns)):
        for layer in _reads(eqns[i], params):
            first.setdefault(layer, i)
    what = "backward" if reverse else "forward"
    if len(first) != count:
        missing = min(set(range(count)) - set(first))
        _refuse(f"the {what} pass never reads layer {missing}'s parameters")
    order = sorted(range(count), key=lambda layer: first[layer])
    if order != (list(range(count))[::-1] if reverse else list(range(count))):
        _refuse(f"the {what} pass does not run the layers in order ({order})")
    starts = [first[layer] for layer in order]
    periods = {b - a for a, b in zip(starts, starts[1:])}
    if len(periods) != 1:
        _refuse(f"the layers' {what} passes are of different lengths ({sorted(periods)} equations apart): "
                "they are not alike")
    period = periods.pop()
    if period == 0:
        _refuse(f"the {what} pass reads every layer's parameters in one equation ({eqns[starts[0]].primitive}), "
                "not one layer after another")
    found, problem = [], "no cut"
    # Where each variable is made, once for every cut tried (most fail within a few equations).
    where = {v: (i, o) for i in range(begin, len(eqns)) for o, v in enumerate(eqns[i].outvars)}
    for shift in range(min(period, starts[0] - begin + 1)):
        try:
            found.append(_loop(eqns, tuple(s - shift for s in starts), period, tuple(order), outvars, where))
        except _Mismatch as e:
            problem = problem if shift else str(e)
    if not found:
        _refuse(f"the layers' {what} passes differ: {problem}")
    # Every cut found computes the step; the one passing on fewest values is the layer
    # boundary (the residual stream alone), the first tried (the latest cut) of those.
    return min(found, key=lambda loop: len(loop.carries))


class _Mismatch(Exception):
    """A cut whose regions are not isomorphic (the reason)."""


class _Defs:
    """Where the regions at `starts` make each variable: `get(r, v)` is the (equation,
    result) position of `v` in region r, None when another equation makes it; `where`
    maps each variable to the (equation, result) that makes it."""

    def __init__(self, where: dict, starts, period: int):
        self.where, self.starts, self.period = where, starts, period

    def get(self, r: int, v):
        at = self.where.get(v)
        if at is None or not self.starts[r] <= at[0] < self.starts[r] + self.period:
            return None
        return at[0] - self.starts[r], at[1]

    def anywhere(self, v) -> bool:
        """Does one of the regions make `v`?"""
        return any(self.get(r, v) is not None for r in range(len(self.starts)))


def _loop(eqns, starts, period, layers, outvars, where) -> Loop:
    """The `Loop` of regions at `starts`, or `_Mismatch`."""
    regions = [eqns[s:s + period] for s in starts]
    defs = _Defs(where, starts, period)
    template = regions[0]
    ext: dict = {}  # template var -> per-region vars
    for t, e in enumerate(template):
        _same_eqn(e, [reg[t] for reg in regions], t, layers)
        for a, x in enumerate(e.invars):
            ins = [reg[t].invars[a] for reg in regions]
            if isinstance(x, Literal):
                if not all(isinstance(y, Literal) and y.aval == x.aval and _same(y.val, x.val) for y in ins):
                    raise _Mismatch(f"equation {t} ({_show(e)}) reads a different constant in another layer")
                continue
            if defs.get(0, x) is not None:
                if any(defs.get(r, v) != defs.get(0, x) for r, v in enumerate(ins)):
                    raise _Mismatch(f"equation {t} ({_show(e)}) reads different values of its layer in different "
                                    "layers")
                continue
            seen = ext.setdefault(x, ins)
            if seen != ins:
                raise _Mismatch(f"equation {t} ({_show(e)}) reads one value in a layer where another reads two")
    slots = tuple(_slot(x, vals, defs) for x, vals in ext.items())
    carries = tuple(s.made for s in slots if s.kind == CARRY)
    inside = {id(e) for reg in regions for e in reg}
    used = _used_outside(eqns, inside, outvars)
    # The last region's carries leave as the scan's final carry, not stacked.
    outs = tuple(sorted({(t, o) for r, reg in enumerate(regions) for t, e in enumerate(reg)
                         for o, v in enumerate(e.outvars)
                         if v in used and not (r == len(regions) - 1 and (t, o) in carries)}))
    return Loop(tuple(starts), period, layers, slots, carries, outs)


def _slot(x, vals, defs) -> Slot:
    if all(v is vals[0] for v in vals):
        return Slot(x, CONST, tuple(vals))
    made = {defs.get(r - 1, v) for r, v in enumerate(vals) if r}
    if len(made) == 1 and None not in made and not defs.anywhere(vals[0]):
        return Slot(x, CARRY, tuple(vals), made.pop())
    if any(defs.anywhere(v) for v in vals):
        raise _Mismatch(f"a layer reads a value another layer made ({x.aval}) other than as the previous "
                        "layer's output")
    return Slot(x, STACK, tuple(vals))


def _used_outside(eqns, inside: set, outvars) -> set:
    used = {v for e in eqns if id(e) not in inside for v in e.invars if not isinstance(v, Literal)}
    return used | {v for v in outvars if not isinstance(v, Literal)}


def _same_eqn(e, others, t: int, layers) -> None:
    for o, layer in zip(others[1:], layers[1:]):
        if o.primitive != e.primitive or len(o.invars) != len(e.invars) or \
                [v.aval for v in o.outvars] != [v.aval for v in e.outvars] or not _same(o.params, e.params):
            raise _Mismatch(f"equation {t} of layer {layers[0]}'s is {_show(e)}, of layer {layer}'s {_show(o)}")


def _show(eqn) -> str:
    """An equation for people: its primitive, where the user's code made it, its results."""
    return f"{eqn.primitive}{_source(eqn)} {' '.join(str(v.aval) for v in eqn.outvars)}"


def _same(a, b) -> bool:
    """Are two equation params the same (jaxprs compared by structure)?"""
    if a is b:
        return True
    if isinstance(a, ClosedJaxpr) and isinstance(b, ClosedJaxpr):
        return _same_jaxpr(a.jaxpr, b.jaxpr) and len(a.consts) == len(b.consts) and \
            all(x is y for x, y in zip(a.consts, b.consts))
    if isinstance(a, Jaxpr) and isinstance(b, Jaxpr):
        return _same_jaxpr(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and type(a) is type(b):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # an array param: compared by identity only
        return False


def _same_jaxpr(a: Jaxpr, b: Jaxpr) -> bool:
    if (len(a.eqns), len(a.invars), len(a.outvars), len(a.constvars)) != \
            (len(b.eqns), len(b.invars), len(b.outvars), len(b.constvars)):
        return False
    names = dict(zip(a.constvars + a.invars, b.constvars + b.invars))

    def same_atom(x, y):
        if isinstance(x, Literal) or isinstance(y, Literal):
            return isinstance(x, Literal) and isinstance(y, Literal) and x.aval == y.aval and _same(x.val, y.val)
        return names.get(x) is y and x.aval == y.aval

    for e, f in zip(a.eqns, b.eqns):
        if e.primitive != f.primitive or len(e.invars) != len(f.invars) or len(e.outvars) != len(f.outvars) or \
                not all(same_atom(x, y) for x, y in zip(e.invars, f.invars)) or not _same(e.params, f.params):
            return False
        names.update(zip(e.outvars, f.outvars))
    return all(same_atom(x, y) for x, y in zip(a.outvars, b.outvars))


@dataclass(frozen=True)
class _Feed:
    """Where the backward scan's stacked input comes from: the forward scan's stacked
    output at `out` (an (equation, result) position), the forward's stacked input
    `stack` (a slot index), the forward's carry in `echo` (a slot index), or stacked
    from outer values (all None)."""

    out: tuple | None = None
    stack: int | None = None
    echo: int | None = None

    @property
    def outer(self) -> bool:
        """Stacked from outer values (nothing of the forward scan's)?"""
        return self.out is None and self.stack is None and self.echo is None


def _feeds(eqns, fwd: Loop, bwd: Loop) -> list:
    """Per stacked slot of the backward loop, its `_Feed` (refused where the layers'
    backward passes read what their forward passes made in different ways)."""
    made = {v for s in fwd.starts for e in eqns[s:s + fwd.period] for v in e.outvars}
    out = []
    for slot in bwd.slots:
        if slot.kind != STACK:
            out.append(None)
            continue
        feeds = {_feed(eqns, fwd, layer, v) for layer, v in zip(bwd.layers, slot.values)}
        if len(feeds) != 1:
            _refuse(f"the layers' backward passes read their forward values differently ({slot.var.aval})")
        feed = feeds.pop()
        if feed.outer and any(v in made for v in slot.values):
            _refuse(f"a layer's backward pass reads another layer's forward value ({slot.var.aval})")
        out.append(feed)
    return out


def _feed(eqns, fwd: Loop, layer: int, v) -> _Feed:
    r = fwd.layers.index(layer)
    for pos in fwd.outs:
        if fwd.var_at(eqns, r, pos) is v:
            return _Feed(out=pos)
    for k, slot in enumerate(fwd.slots):
        if slot.values[r] is v and slot.kind == STACK:
            return _Feed(stack=k)
        if slot.values[r] is v and slot.kind == CARRY:
            return _Feed(echo=k)
    return _Feed()


def _rolled(closed: ClosedJaxpr, fwd: Loop, bwd: Loop | None) -> ClosedJaxpr:
    """The step of `closed` with `fwd` (and `bwd`) run as scans, traced anew."""
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    feeds = _feeds(eqns, fwd, bwd) if bwd is not None else []
    echoes = tuple(sorted({f.echo for f in feeds if f is not None and f.echo is not None}))
    # What the outer equations read of the regions, cut from the stacked outputs (the
    # backward scan reads the forward's stacked, never cut).
    inside = {id(e) for loop in (fwd, bwd) if loop is not None for s in loop.starts for e in eqns[s:s + loop.period]}
    wanted = _used_outside(eqns, inside, jaxpr.outvars)
    if bwd is not None:  # what the backward scan reads as it is (a forward value all its layers read)
        wanted |= {s.values[0] for s in bwd.slots if s.kind in (CONST, CARRY)}
    # The forward's stacked outputs: what the backward scan reads, and what the outer
    # equations do (a stacked output nothing reads would still be made whole).
    fed = {f.out for f in feeds if f is not None and f.out is not None}
    fwd = replace(fwd, outs=tuple(p for p in fwd.outs if p in fed or any(
        fwd.var_at(eqns, r, p) in wanted for r in range(len(fwd.starts) - (p in fwd.carries)))))

    def step(*args):
        env = dict(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, args))
        lo, hi = fwd.span
        _run(eqns[:lo], env)
        stacks = _stacks(fwd, fwd.slots, env)
        ys, echoed = _scan(eqns, fwd, env, stacks, echoes, wanted)
        if bwd is None:
            _run(eqns[hi:], env)
        else:
            blo, bhi = bwd.span
            _run(eqns[hi:blo], env)
            given = {k: _given(f, ys, stacks, echoed) for k, f in enumerate(feeds) if f is not None and not f.outer}
            _scan(eqns, bwd, env, {**_stacks(bwd, bwd.slots, env, skip=given), **given}, (), wanted)
            _run(eqns[bhi:], env)
        return [x.val if isinstance(x, Literal) else env[x] for x in jaxpr.outvars]

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
    return jax.make_jaxpr(step)(*avals)


def _given(feed: _Feed, ys: dict, stacks: dict, echoed: dict):
    if feed.out is not None:
        return ys[feed.out]
    return stacks[feed.stack] if feed.stack is not None else echoed[feed.echo]


def _stacks(loop: Loop, slots, env, skip=()) -> dict:
    """Slot index -> the per-layer values of a stacked slot, stacked in layer order."""
    out = {}
    for k, slot in enumerate(slots):
        if slot.kind == STACK and k not in skip:
            by_layer = sorted(zip(loop.layers, slot.values), key=lambda p: p[0])
            out[k] = jnp.stack([_read(env, v) for _, v in by_layer])
    return out


def _read(env, x):
    return x.val if isinstance(x, Literal) else env[x]


def _run(eqns, env) -> None:
    """Evaluate `eqns` (their names kept) on `env`, adding what they make."""
    if not eqns:
        return
    made = {v for e in eqns for v in e.outvars}
    free = list(dict.fromkeys(x for e in eqns for x in e.invars if not isinstance(x, Literal) and x not in made))
    outs = [v for e in eqns for v in e.outvars if not _dropped(v)]
    vals = jaxpr_as_fun(_closed(free, outs, eqns))(*[env[x] for x in free])
    env.update(zip(outs, vals))


def _closed(invars, outvars, eqns) -> ClosedJaxpr:
    """The equations `eqns` of the traced step as a jaxpr of their own."""
    info = DebugInfo("roll_layers", "the step's layers", tuple(f"in[{k}]" for k in range(len(invars))),
                     tuple(f"out[{k}]" for k in range(len(outvars))))
    return ClosedJaxpr(Jaxpr((), list(invars), list(outvars), list(eqns), debug_info=info), ())


def _dropped(v) -> bool:
    return type(v).__name__ == "DropVar"


def _scan(eqns, loop: Loop, env, stacks: dict, echoes: tuple, wanted: set):
    """Run `loop` as a scan on `env` (binding what the rest of the step reads of its
    regions that is `wanted`); (its stacked outputs by position, its echoed carries in
    by slot index)."""
    first = loop.starts[0]
    template = eqns[first:first + loop.period]
    consts = [s for s in loop.slots if s.kind == CONST]
    carries = [s for s in loop.slots if s.kind == CARRY]
    stacked = [k for k, s in enumerate(loop.slots) if s.kind == STACK]
    outs = [template[t].outvars[o] for t, o in loop.carries + loop.outs] + [loop.slots[k].var for k in echoes]
    body = jaxpr_as_fun(_closed([s.var for s in consts + carries] + [loop.slots[k].var for k in stacked], outs,
                                template))
    const_vals = [_read(env, s.values[0]) for s in consts]
    nc = len(carries)

    def step(carry, xs):
        got = body(*const_vals, *carry, *xs)
        return tuple(got[:nc]), tuple(got[nc:])

    init = tuple(_read(env, s.values[0]) for s in carries)
    final, ys = jax.lax.scan(step, init, tuple(stacks[k] for k in stacked), reverse=loop.layers[0] > loop.layers[-1])
    last = len(loop.starts) - 1
    for c, pos in enumerate(loop.carries):
        env[loop.var_at(eqns, last, pos)] = final[c]
    by_pos = dict(zip(loop.outs, ys[:len(loop.outs)]))
    for r, layer in enumerate(loop.layers):
        for pos, y in by_pos.items():
            var = loop.var_at(eqns, r, pos)
            if var not in env and var in wanted:
                env[var] = jax.lax.index_in_dim(y, layer, keepdims=False)
    return by_pos, dict(zip(echoes, ys[len(loop.outs):]))
