"""The stacked form of a step over unrolled layers: what a search prices in place of the
unrolled program, at the size of the scanned form.

`roll_layers` keeps the unrolled program's inputs, one array per layer and parameter, so
the per-layer work outside the layers (an optimizer's update of each parameter and its
moments) stays unrolled: on Llama-3 8B 4770 of the rolled step's 5797 ops. The stacked
form takes each sequence of L alike layers in the arguments as one pytree of `[L, ...]`
stacks (as a `jax.lax.scan` over stacked layers takes them), runs the layers' passes as
the rolled step's scans on those stacks, and what is left of each layer outside the
passes (its *chain*: the equations reading one layer's values, and values all layers
share such as the step count) once, as layer 0's chain under `jax.vmap` over the stacks.
The outputs in a sequence of layers come back stacked alike.

The chains must be alike: layer l's k-th chain equation is layer 0's (primitive,
params, shapes), reads the same positions of its own layer's values (an input of the
same path, the passes' output at the same position, its chain's value at the same
position) and the same shared values, and runs between the same passes. Anything else
(an equation reading several layers' values, such as a global gradient norm's sum) is
refused, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
from jax.extend.core import Literal, jaxpr_as_fun

from ._errors import PartitioningError
from ._layers import is_layers, layer_positions
from ._roll import CARRY, CONST, STACK, UnlikeLayers, _closed, _dropped, _feeds, _pass, _read, _reads, _run, _same, _scan, \
    _show, _used_outside, _weight_copies

#: Fewest alike layers a sequence holds to be stacked (as `roll_layers` rolls).
MIN_LAYERS = 2


def _refusal(why: str) -> str:
    return (f"cannot stack the unrolled layers: {why}; write the layers as a jax.lax.scan over stacked parameters "
            "(scan_layers=True in the examples)")


def _refuse(why: str):
    raise PartitioningError(_refusal(why))


@dataclass(frozen=True)
class StackedLeaf:
    """One flat input or output of the stacked form: its `name`, `arg` (the argument it is
    in; outputs: 0) and `members`, the unrolled program's flat positions it stands for,
    in layer order (one position for a leaf outside every sequence of layers)."""

    name: str
    arg: int
    members: tuple[int, ...]

    @property
    def stacked(self) -> bool:
        """Does the leaf stack the layers of a sequence?"""
        return len(self.members) > 1


@dataclass(frozen=True)
class Stacked:
    """A stacked form: its `program`, and its flat `inputs` and `outputs` (`StackedLeaf`s)
    against the unrolled program's."""

    program: object
    inputs: tuple[StackedLeaf, ...]
    outputs: tuple[StackedLeaf, ...]


def stack_layers(program) -> Stacked:
    """The stacked form of `program` (lifted from a step over a sequence of alike layers):
    each sequence's inputs and outputs as `[L, ...]` stacks named by the layers' path with
    `[:]` for the layer index (`params['layers'][:]['mlp']['w1']`), the layers' passes as
    layer scans and their per-layer remainder run once on the stacks. Refused
    (`PartitioningError`, naming the first difference) where the layers are not alike."""
    from ._lift import _build

    if program.origin is None:
        _refuse("the program was not lifted from a function (it keeps no arguments to find the layers in)")
    origin = program.origin
    dyn = tuple(a for i, a in enumerate(origin.args) if i not in origin.static_argnums)
    flat_in = jax.tree_util.tree_flatten_with_path(dyn)[0]
    if len(flat_in) != len(program.inputs):
        _refuse("the program's inputs do not match its arguments")
    args = [n[:len(n) - len(jax.tree_util.keystr(p[1:]))] for n, (p, _) in zip(program.input_names, flat_in)]
    ins, in_tree, avals = _leaves(dyn, lambda k, path: (args[k], 1, path[0].idx))
    results = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in program.closed_jaxpr.jaxpr.outvars]
    outs, out_tree, _ = _leaves(jax.tree.unflatten(program.out_tree, results), lambda k, path: ("out", 0, 0))
    counts = {len(leaf.members) for leaf in ins + outs if leaf.stacked}
    if not any(leaf.stacked for leaf in ins):
        _refuse("the step takes no sequence of two or more alike layers (a list or tuple of pytrees of one "
                "structure)")
    if len(counts) > 1:
        _refuse(f"its sequences of alike layers are of different lengths ({sorted(counts)})")
    try:
        closed = _stacked_jaxpr(program.closed_jaxpr, ins, outs, avals)
    except UnlikeLayers as e:  # found by the pass-finding helpers it shares with rolling
        raise PartitioningError(_refusal(e.why)) from e
    prog = _build(closed, in_tree, out_tree, [leaf.name for leaf in ins], [leaf.arg for leaf in ins],
                  [leaf.name for leaf in outs], None)
    return Stacked(prog, ins, outs)


def _leaves(tree, base):
    """`(leaves, treedef, avals)` of `tree` with each outermost sequence of alike layers
    replaced by one pytree of `[L, ...]` stacks: its `StackedLeaf`s (in the stacked tree's
    order), treedef and leaf shapes. `base(k, path)` gives leaf k's name prefix, how many
    path entries that prefix names, and its argument."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    groups: dict[str, list] = {}
    args: dict[str, int] = {}
    for k, ((path, _), at) in enumerate(zip(flat, layer_positions(tree, [p for p, _ in flat], MIN_LAYERS))):
        prefix, skip, arg = base(k, path)
        name = prefix + jax.tree_util.keystr(path[skip:]) if at is None else \
            prefix + jax.tree_util.keystr(path[skip:at]) + "[:]" + jax.tree_util.keystr(path[at + 1:])
        groups.setdefault(name, []).append((0 if at is None else path[at].idx, k))
        args[name] = arg
    leaves = tuple(StackedLeaf(name, args[name], tuple(k for _, k in sorted(members)))
                   for name, members in groups.items())
    stacked, treedef = jax.tree_util.tree_flatten(_stack_tree(tree))
    if len(leaves) != len(stacked):
        _refuse("its sequences of layers do not stack to one array per leaf of a layer")
    return leaves, treedef, stacked


def _stack_tree(tree):
    """`tree` with each outermost sequence of alike layers as one pytree of stacks."""
    if is_layers(tree, MIN_LAYERS):
        return jax.tree.map(lambda *xs: jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype), *tree)
    kids, node = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)
    if jax.tree_util.treedef_is_leaf(node):
        return tree
    return node.unflatten([_stack_tree(c) for c in kids])


def _stacked_jaxpr(closed, ins, outs, avals):
    """The stacked step (`stack_layers`), traced: `ins` and `outs` its flat inputs and
    outputs against `closed`'s, `avals` its inputs' shapes."""
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    lanes: dict = {}  # an unrolled variable of one layer -> (its position, its layer)
    for leaf in ins:
        if leaf.stacked:
            lanes.update({jaxpr.invars[k]: (("in", leaf.name), layer) for layer, k in enumerate(leaf.members)})
    count = len(next(leaf for leaf in ins if leaf.stacked).members)
    loops = _loops(eqns, {v: layer for v, (_, layer) in lanes.items()}, jaxpr.outvars)
    feeds = _feeds(eqns, *loops) if len(loops) == 2 else []
    loops = _trimmed(eqns, jaxpr.outvars, loops, feeds)
    for x, loop in enumerate(loops):
        last = len(loop.starts) - 1
        lanes.update({loop.var_at(eqns, r, pos): (("loop", x, pos), layer) for r, layer in enumerate(loop.layers)
                      for pos in loop.outs if not (r == last and pos in loop.carries)})
    shared, chain = _chains(eqns, loops, lanes, count)
    sources = []
    for x, loop in enumerate(loops):
        sources.append(_sources(loop, lanes, feeds if x else (), sources[0] if x else ()))
    out_srcs = [_out_source(jaxpr.outvars, leaf, lanes) for leaf in outs]
    echoes = tuple(sorted({f.echo for f in feeds if f is not None and f.echo is not None}))

    def step(*args):
        env = dict(zip(jaxpr.constvars, closed.consts))
        stacks: dict = {}
        for leaf, a in zip(ins, args):
            if leaf.stacked:
                stacks[("in", leaf.name)] = a
            else:
                env[jaxpr.invars[leaf.members[0]]] = a
        echoed: dict = {}
        for seg in range(len(loops) + 1):
            _run(shared[seg], env)
            _vmapped(chain[seg], env, stacks, lanes, count)
            if seg == len(loops):
                break
            xs = {k: _fed(src, env, stacks, echoed) for k, src in enumerate(sources[seg]) if src is not None}
            ys, got = _scan(eqns, loops[seg], env, xs, () if seg else echoes, frozenset())
            stacks.update({("loop", seg, pos): y for pos, y in ys.items()})
            echoed = echoed or got
        return [stacks[src[1]] if src[0] == "stack" else _read(env, src[1]) for src in out_srcs]

    return jax.make_jaxpr(step)(*avals)


def _loops(eqns, params: dict, outvars) -> tuple:
    """The layers' forward pass and, where the step differentiates them, backward pass
    (`Loop`s, found as `roll_layers` finds them)."""
    count = len(set(params.values()))
    fwd = _pass(eqns, params, count, 0, reverse=False, outvars=outvars)
    end = fwd.span[1]
    made = _weight_copies(eqns[:end], params)
    if not any(_reads(e, made) for e in eqns[end:]):
        return (fwd,)
    return fwd, _pass(eqns, made, count, end, reverse=True, outvars=outvars)


def _trimmed(eqns, outvars, loops, feeds) -> tuple:
    """`loops` with the forward's stacked outputs cut to what is read of them: by the
    backward pass as a stack, or outside both passes (as `roll_layers` makes them)."""
    inside = {id(e) for loop in loops for s in loop.starts for e in eqns[s:s + loop.period]}
    wanted = _used_outside(eqns, inside, outvars)
    if len(loops) == 2:
        wanted |= {s.values[0] for s in loops[1].slots if s.kind in (CONST, CARRY)}
    fed = {f.out for f in feeds if f is not None and f.out is not None}
    fwd = loops[0]
    fwd = replace(fwd, outs=tuple(p for p in fwd.outs if p in fed or any(
        fwd.var_at(eqns, r, p) in wanted for r in range(len(fwd.starts) - (p in fwd.carries)))))
    return (fwd, *loops[1:])


def _lane(v, lanes):
    return None if isinstance(v, Literal) else lanes.get(v)


def _chains(eqns, loops, lanes: dict, count: int) -> tuple[list, list]:
    """`(shared, chain)`: per stretch between the passes, the equations outside them that
    read no layer's values, and layer 0's chain equations (checked alike in every
    layer); binds each chain value's lane in `lanes`."""
    spans = [loop.span for loop in loops]
    shared: list[list] = [[] for _ in range(len(loops) + 1)]
    chains: dict[int, list] = {}
    for i, e in enumerate(eqns):
        if any(lo <= i < hi for lo, hi in spans):
            continue
        seg = sum(i >= hi for _, hi in spans)
        layers = {lane[1] for lane in (_lane(v, lanes) for v in e.invars) if lane is not None}
        if not layers:
            shared[seg].append(e)
            continue
        if len(layers) > 1:
            _refuse(f"{_show(e)} outside the layers' passes reads the values of layers {sorted(layers)} (a sum "
                    "over layers, such as a global gradient norm, is not one layer's update)")
        layer = layers.pop()
        t = len(chains.setdefault(layer, []))
        chains[layer].append((seg, e))
        lanes.update({v: (("chain", t, o), layer) for o, v in enumerate(e.outvars)})
    if chains and sorted(chains) != list(range(count)):
        _refuse(f"only layers {sorted(chains)} of {count} have equations outside their passes")
    for layer, other in sorted(chains.items())[1:]:
        _alike(chains[0], other, layer, lanes)
    return shared, [[e for s, e in chains.get(0, ()) if s == seg] for seg in range(len(loops) + 1)]


def _alike(first, other, layer: int, lanes) -> None:
    """Refuse unless layer `layer`'s chain (`other`) is layer 0's (`first`)."""
    if len(first) != len(other):
        _refuse(f"layer 0 has {len(first)} equations outside its passes, layer {layer} {len(other)}")
    for t, ((s, e), (so, o)) in enumerate(zip(first, other)):
        if so != s or o.primitive != e.primitive or len(o.invars) != len(e.invars) or \
                [v.aval for v in o.outvars] != [v.aval for v in e.outvars] or not _same(o.params, e.params):
            _refuse(f"equation {t} outside layer 0's passes is {_show(e)}, of layer {layer}'s {_show(o)}")
        for x, y in zip(e.invars, o.invars):
            if not _same_atom(x, y, lanes):
                _refuse(f"equation {t} outside layer 0's passes ({_show(e)}) reads a different value in layer "
                        f"{layer}")


def _same_atom(x, y, lanes) -> bool:
    if isinstance(x, Literal) or isinstance(y, Literal):
        return isinstance(x, Literal) and isinstance(y, Literal) and x.aval == y.aval and _same(x.val, y.val)
    a, b = lanes.get(x), lanes.get(y)
    return (a is None and b is None and x is y) or (a is not None and b is not None and a[0] == b[0])


def _sources(loop, lanes, feeds, fwd_sources) -> list:
    """Per slot of `loop`, where its stack comes from: `("stack", lane position)`, the
    forward pass's carry in (`("echo", slot)`), per-layer outer values to stack
    (`("outer", values in layer order)`); None for a slot all layers share."""
    out = []
    for k, slot in enumerate(loop.slots):
        feed = feeds[k] if feeds else None
        if slot.kind != STACK:
            if _lane(slot.values[0], lanes) is not None:
                _refuse(f"a layer pass reads one layer's value ({slot.var.aval}) as one all layers share")
            out.append(None)
        elif feed is not None and feed.out is not None:
            out.append(("stack", ("loop", 0, feed.out)))
        elif feed is not None and feed.stack is not None:
            out.append(fwd_sources[feed.stack])
        elif feed is not None and feed.echo is not None:
            out.append(("echo", feed.echo))
        else:
            out.append(_stack_source(loop, slot, lanes))
    return out


def _stack_source(loop, slot, lanes):
    found = [_lane(v, lanes) for v in slot.values]
    if all(f is None for f in found):
        return "outer", tuple(v for _, v in sorted(zip(loop.layers, slot.values), key=lambda p: p[0]))
    if any(f is None or f[0] != found[0][0] or f[1] != layer for f, layer in zip(found, loop.layers)):
        _refuse(f"a layer pass reads its layers' values ({slot.var.aval}) from different places")
    return "stack", found[0][0]


def _fed(src, env, stacks, echoed):
    if src[0] == "stack":
        return stacks[src[1]]
    if src[0] == "echo":
        return echoed[src[1]]
    return jnp.stack([_read(env, v) for v in src[1]])


def _out_source(outvars, leaf, lanes):
    """Where output `leaf` of the stacked step comes from: `("stack", lane position)` or
    `("var", the unrolled output)`."""
    found = [_lane(outvars[k], lanes) for k in leaf.members]
    if not leaf.stacked:
        if found[0] is not None:
            _refuse(f"output {leaf.name} is one layer's value outside any sequence of layers")
        return "var", outvars[leaf.members[0]]
    if any(f is None or f[0] != found[0][0] or f[1] != layer for layer, f in enumerate(found)):
        _refuse(f"the layers' outputs {leaf.name} are not each layer's value at one position")
    return "stack", found[0][0]


def _vmapped(eqns, env, stacks: dict, lanes: dict, count: int) -> None:
    """Run layer 0's chain `eqns` for every layer at once: `jax.vmap` over the stacks of
    the layers' values they read (values all layers share unmapped), binding the stacks
    of what they make."""
    if not eqns:
        return
    made = {v for e in eqns for v in e.outvars}
    free = list(dict.fromkeys(x for e in eqns for x in e.invars if not isinstance(x, Literal) and x not in made))
    outs = [v for e in eqns for v in e.outvars if not _dropped(v)]
    mapped = [x in lanes for x in free]
    fn = jax.vmap(jaxpr_as_fun(_closed(free, outs, eqns)), in_axes=[0 if m else None for m in mapped],
                  axis_size=count)
    vals = fn(*[stacks[lanes[x][0]] if m else env[x] for x, m in zip(free, mapped)])
    stacks.update({lanes[v][0]: y for v, y in zip(outs, vals)})
