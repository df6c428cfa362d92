"""Shallow twins: searching a deep model for the price of a shallow one.

A train step over L structurally identical layers (a list or tuple of L alike pytrees
in its arguments, e.g. `params['layers']` and the same list in the optimizer state)
unrolls into L copies of the same ops. The search decides each group of alike inputs
with one action (the first and last layers may form groups of their own), so every
middle layer ends up with the same tilings and the same cost, and every cost of the
deep program is affine in L:

    C(L) = C(3) + (L - 3) * (C(4) - C(3))

for the modeled step time, its compute part, and the peak memory (the peak is where
parameters, optimizer state and the activations kept for the backward pass are all
live, each one layer's worth larger per layer). So the search traces twins of the
program with those sequences cut to 3 and 4 layers (from the function and abstract
arguments that `lift` keeps), applies every action to both, and scores the
extrapolated cost: an episode costs the same at 48 layers as at 8, and the search
scales with the number of distinct layer kinds, not of layers. The plan it returns is
a list of group actions, which the caller applies to the deep program.

Twins stand in only where that is sound, else the search runs on the program itself and
the history says why: the deep program's op, value and input counts must be the same
affine function of L (the layers are unrolled copies and nothing else grows with L);
the twins' input groups must match the deep program's, group for group, by member
names; earlier tactics' decisions must be on inputs, and replaying them on the twins
(each layer onto the twin layer that stands for it) must reproduce every input's tiling.
"""

from __future__ import annotations

import warnings

import jax

from partir import Partitioning, PartitioningError, lift
from tactics import input_groups, roles

from ._cost import CostModel
from ._state import SearchState

#: Fewest alike layers for which twins are used: the twins together hold 7 layers.
TWIN_MIN_LAYERS = 8
#: Depths of the two twins. The first layer (nothing upstream needs its input's
#: gradient) and the last (a final norm or head downstream) often differ from the
#: others, so the shallower twin needs a first, a middle and a last layer; the deeper
#: one adds one middle layer, whose cost is the difference.
TWIN_DEPTHS = (3, 4)


def _alike(seq) -> bool:
    def sig(e):
        leaves, tree = jax.tree.flatten(e)
        return tree, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x)))) for x in leaves)

    first = sig(seq[0])
    return bool(first[1]) and all(sig(e) == first for e in seq[1:])


def _children(tree):
    """(rebuild, children) of a pytree node (a dict, list, named tuple, equinox module,
    any registered node); None for a leaf."""
    children, node = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)
    if jax.tree_util.treedef_is_leaf(node) and tree is not None:
        return None
    return node.unflatten, children


def _is_layers(tree) -> bool:
    return type(tree) in (list, tuple) and len(tree) >= TWIN_MIN_LAYERS and _alike(tree)


def layer_counts(tree) -> set[int]:
    """Lengths of the sequences of alike layers in `tree` (outermost ones only)."""
    if _is_layers(tree):
        return {len(tree)}
    node = _children(tree)
    return set().union(*map(layer_counts, node[1])) if node else set()


def truncate(tree, depth: int):
    """`tree` with every sequence of alike layers cut to its first `depth` layers."""
    if _is_layers(tree):
        return type(tree)(tree[:depth])
    node = _children(tree)
    return node[0]([truncate(c, depth) for c in node[1]]) if node else tree


def _twin_layer(i: int, layers: int, depth: int) -> int:
    """The layer of a `depth`-layer twin that stands for layer `i` of `layers`: the last
    for the last, the first ones for themselves, every other middle layer for the
    twin's last middle layer."""
    return depth - 1 if i == layers - 1 else min(i, depth - 2)


def _child(node, key):
    """The child of `node` at path entry `key`, or None where it cannot be told (then no
    layers below it are looked for: the names keep their indices)."""
    if isinstance(key, jax.tree_util.DictKey):
        try:
            return node[key.key]
        except (KeyError, TypeError, IndexError):
            return None
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name, None)
    return None


def _canonical_names(prog, depth: int) -> dict[int, str]:
    """The twin's name for each input of the deep program: its own name, with the index
    into a sequence of layers replaced by its twin layer's (`_twin_layer`)."""
    origin = prog.origin
    dyn = tuple(a for i, a in enumerate(origin.args) if i not in origin.static_argnums)
    leaves = jax.tree_util.tree_flatten_with_path(dyn)[0]
    if len(leaves) != len(prog.inputs):
        return {}
    layers: dict[int, bool] = {}
    names = {}
    for v, name, (path, _) in zip(prog.inputs, prog.input_names, leaves):
        node, canon = dyn, []
        for k in path:
            if type(node) in (list, tuple) and isinstance(k, jax.tree_util.SequenceKey):
                is_layers = layers.get(id(node))
                if is_layers is None:
                    is_layers = layers[id(node)] = _is_layers(node)
                canon.append(jax.tree_util.SequenceKey(_twin_layer(k.idx, len(node), depth)) if is_layers else k)
                node = node[k.idx]
            else:
                canon.append(k)
                node = _child(node, k)
        suffix = jax.tree_util.keystr(path[1:])
        names[v] = name[:len(name) - len(suffix)] + jax.tree_util.keystr(tuple(canon[1:]))
    return names


class TwinState:
    """The search state of a deep program of `layers` layers, kept as two `SearchState`s
    on its shallow twins (`TWIN_DEPTHS` layers) whose groups are aligned with the deep
    program's: every action goes to both, every cost is extrapolated to `layers`."""

    def __init__(self, twins: tuple[SearchState, SearchState], layers: int, names: tuple[dict, dict]):
        self.twins, self.layers, self.names = twins, layers, names
        self.axes = twins[1].axes

    def _extrapolate(self, shallow: float, deeper: float) -> float:
        d0, d1 = TWIN_DEPTHS
        return shallow + (self.layers - d0) * (deeper - shallow) / (d1 - d0)

    @property
    def mesh(self):
        """The mesh the plan is for."""
        return self.twins[0].mesh

    @property
    def memory_limit(self) -> float:
        """Bytes per device a plan may peak at."""
        return self.twins[0].memory_limit

    def key(self) -> int:
        """A hash of both twins' states."""
        return hash((self.twins[0].key(), self.twins[1].key()))

    def mark(self):
        """A point to `rollback` to."""
        return tuple(t.mark() for t in self.twins)

    def rollback(self, mark) -> None:
        """Undo every action since `mark`."""
        for t, m in zip(self.twins, mark):
            t.rollback(m)

    def actions(self):
        """The tile actions that would change the deeper twin (the groups are aligned)."""
        return self.twins[1].actions()

    def apply(self, action) -> bool:
        """Apply `action` to both twins; False, and nothing changed, unless both take it."""
        mark = self.mark()
        done = [t.apply(action) for t in self.twins]
        if all(done):
            return True
        self.rollback(mark)
        return False

    def evaluate(self) -> tuple[float, float]:
        """The deep program's modeled `(step time, peak memory)`, extrapolated."""
        (t0, p0), (t1, p1) = (t.evaluate() for t in self.twins)
        return self._extrapolate(t0, t1), self._extrapolate(p0, p1)

    def compute_time(self) -> float:
        """The deep program's modeled compute time, extrapolated."""
        return self._extrapolate(*(t.compute_time() for t in self.twins))

    def mismatch(self, part, actions) -> str | None:
        """After `actions` were applied to the deep program's `part` (and the twins are at
        their root), the first input whose tiling differs from its twin's under the same
        actions, or None when the twins and the program agree."""
        mark = self.mark()
        try:
            for a in actions:
                self.apply(a)
            for twin, names in zip(self.twins, self.names):
                tprog = twin.part.program
                for v in part.program.inputs:
                    if part.tiling(v) != twin.part.tiling(tprog.resolve(names[v])):
                        return part.program.name(v)
            return None
        finally:
            self.rollback(mark)

    def describe(self) -> str:
        """What is searched, for the history."""
        d0, d1 = TWIN_DEPTHS
        return (f"searched on {d0}- and {d1}-layer twins of the {self.layers}-layer program, "
                "costs extrapolated linearly in the layer count")


def twin_state(part, groups, axes, *, device, memory_limit, source: str):
    """`(TwinState, None)` standing in for `part` (whose input `groups` are searched over
    `axes`), or `(None, why not)`."""
    prog = part.program
    origin = getattr(prog, "origin", None)
    if origin is None:
        return None, "the program was not lifted from a function"
    if part.detached:
        return None, "earlier tactics detached values from their tiling classes"
    if any(d.value not in prog.input_set for d in part.decisions):
        return None, "earlier tactics decided intermediate values"
    dyn = [a for i, a in enumerate(origin.args) if i not in origin.static_argnums]
    counts = layer_counts(dyn)
    if not counts:
        return None, f"no sequence of {TWIN_MIN_LAYERS} or more alike layers among the arguments"
    if len(counts) > 1:
        return None, f"sequences of alike layers of different lengths ({sorted(counts)})"
    layers = counts.pop()
    progs = []
    for depth in TWIN_DEPTHS:
        args = tuple(a if i in origin.static_argnums else truncate(a, depth) for i, a in enumerate(origin.args))
        try:
            with warnings.catch_warnings():
                # The deep program already warned about whatever the twin would.
                warnings.simplefilter("ignore")
                progs.append(lift(origin.fn, *args, static_argnums=origin.static_argnums))
        except Exception as e:  # noqa: BLE001  (any failure only means: no twins)
            return None, f"tracing a {depth}-layer twin failed ({type(e).__name__}: {str(e).splitlines()[0]})"
    for what in ("ops", "values", "inputs"):
        n0, n1 = (len(getattr(p, what)) for p in progs)
        if len(getattr(prog, what)) != n0 + (layers - TWIN_DEPTHS[0]) * (n1 - n0):
            return None, f"the program's {what} do not grow linearly with its {layers} layers"
    states, names = [], []
    for depth, tprog in zip(TWIN_DEPTHS, progs):
        canon = _canonical_names(prog, depth)
        if not canon:
            return None, "the program's inputs do not match its arguments"
        state, why = _twin(part, groups, axes, tprog, canon, depth, device=device, memory_limit=memory_limit,
                           source=source)
        if state is None:
            return None, why
        states.append(state)
        names.append(canon)
    return TwinState(tuple(states), layers, tuple(names)), None


def _twin(part, groups, axes, tprog, canon, depth, *, device, memory_limit, source):
    prog = part.program
    r = roles(tprog)
    by_first = {tprog.name(g.members[0]): g for g in input_groups(tprog, r.params + r.batch)}
    aligned = []
    for g in groups:
        tg = by_first.pop(canon[g.members[0]], None)
        if tg is None or not {tprog.name(m) for m in tg.members} <= {canon[m] for m in g.members}:
            return None, f"the {depth}-layer twin groups {g.label} differently"
        aligned.append(tg)
    if by_first:
        return None, f"the {depth}-layer twin has groups the program lacks ({', '.join(sorted(by_first))})"
    tpart = Partitioning(tprog, part.mesh)
    try:
        for d in part.decisions:
            v = tprog.resolve(canon[d.value])
            if d.action == "tile":
                tpart.tile(v, d.dim, d.axis, source=d.source)
            elif d.action == "replicate":
                if not tpart.is_pinned(v):
                    tpart.replicate(v, source=d.source)
            elif d.action == "constrain":
                tpart.constrain(v, d.tiling, source=d.source)
            else:
                tpart.pin(v, axes=d.axes, source=d.source)
    except (PartitioningError, KeyError) as e:
        return None, f"earlier decisions do not replay on the {depth}-layer twin ({e})"
    for v in prog.inputs:
        tv = tprog.resolve(canon[v])
        if part.tiling(v) != tpart.tiling(tv) or part.is_pinned(v) != tpart.is_pinned(tv):
            return None, f"earlier decisions differ between layers ({prog.name(v)})"
    model = CostModel(tpart, device, memory_limit=memory_limit)
    return SearchState(tpart, model, aligned, axes, source), None
