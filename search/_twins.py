"""Shallow twins: searching a deep model for the price of a shallow one.

A train step over L structurally identical layers (a list or tuple of L alike pytrees
in its arguments, e.g. `params['layers']` and the same list in the optimizer state)
unrolls into L copies of the same ops. The search decides each group of alike inputs
with one action. The first few and last few layers may form groups of their own
(nothing upstream needs the first layer's input gradient; a final norm or head follows
the last), but every middle layer ends up with the same tilings and the same cost, so
every cost of the deep program is affine in L:

    C(L) = C(d) + (L - d) * (C(d + 1) - C(d))

for the modeled step time, its compute part, and the peak memory (the peak is where
parameters, optimizer state and the activations kept for the backward pass are all
live, each one layer's worth larger per layer), where d counts the first layers, one
middle layer and the last layers. So the search traces twins of the program with those
sequences cut to d and d + 1 layers (from the function and abstract arguments that
`lift` keeps), applies every action to both, and scores the extrapolated cost: an
episode costs the same at 48 layers as at 8, and the search scales with the number of
distinct layer kinds, not of layers. The plan it returns is a list of group actions,
which the caller applies to the deep program.

Twins stand in only where that is sound, else the search runs on the program itself and
the history says why: the deep program's op, value and input counts must be the same
affine function of L (the layers are unrolled copies and nothing else grows with L);
its layers' inputs must group as first layers, one run of alike middle layers, last
layers; the twins' input groups must match the deep program's, group for group, by
member names (else the twins get one more middle layer, once); earlier tactics'
decisions must be on inputs, and replaying them on the twins (each layer onto the twin
layer that stands for it) must reproduce every input's tiling.
"""

from __future__ import annotations

import warnings

import jax

from partir import Partitioning, PartitioningError, lift
from partir._layers import children, is_layers, layer_keys  # noqa: F401
from tactics import input_groups, roles

from .cost._achieved import TimeParts
from ._state import PairedStates, SearchState, doubtful

#: Fewest alike layers for which twins are used.
TWIN_MIN_LAYERS = 8
#: How many more middle layers than one the twins may get when the shallow ones do not
#: group their inputs as the program does.
EXTRA_MIDDLE = 1
#: The twin that takes each action at once, the other following only to be priced
#: (`TwinState`): 0, the shallower, as the tree search walks many more actions than it
#: prices states and the shallower twin walks them on fewer ops (Llama-3 8B: 1007
#: against 1425; its search took 4% less CPU than led by the deeper twin).
LEAD = 0


def _is_layers(tree) -> bool:
    return is_layers(tree, TWIN_MIN_LAYERS)


def layer_counts(tree) -> set[int]:
    """Lengths of the sequences of alike layers in `tree` (outermost ones only)."""
    if _is_layers(tree):
        return {len(tree)}
    node = children(tree)
    return set().union(*map(layer_counts, node[1])) if node else set()


def truncate(tree, depth: int):
    """`tree` with every sequence of alike layers cut to its first `depth` layers."""
    if _is_layers(tree):
        return type(tree)(tree[:depth])
    node = children(tree)
    return node[0]([truncate(c, depth) for c in node[1]]) if node else tree


def _twin_layer(i: int, layers: int, depth: int, head: int, tail: int) -> int:
    """The layer of a `depth`-layer twin that stands for layer `i` of `layers`: the `head`
    first and `tail` last layers for their own kind, every middle layer for the twin's
    last middle layer (the first middle ones for themselves)."""
    if i >= layers - tail:
        return depth - (layers - i)
    return min(i, depth - tail - 1)


def _layer_keys(prog) -> dict[int, tuple] | None:
    """For each input: (argument name, pytree path, position in the path of the index
    into the outermost sequence of alike layers, or None); None if the inputs do not
    match the arguments."""
    return layer_keys(prog, TWIN_MIN_LAYERS)


def _edges(keys, groups, layers: int) -> tuple[int, int] | None:
    """(head, tail): how many first and last layers differ in kind from the middle ones
    (a layer's kind: the groups of its inputs, in order); None unless the middle layers
    are one contiguous run of one kind."""
    group_of = {m: gi for gi, g in enumerate(groups) for m in g.members}
    kinds = [[] for _ in range(layers)]
    for v, (_, path, at) in keys.items():
        if at is not None and v in group_of:
            kinds[path[at].idx].append(group_of[v])
    middle = kinds[layers // 2]
    same = [i for i, k in enumerate(kinds) if k == middle]
    if same != list(range(same[0], same[-1] + 1)):
        return None
    return same[0], layers - 1 - same[-1]


def _canonical_names(keys, layers: int, depth: int, head: int, tail: int) -> dict[int, str]:
    """The twin's name for each input of the deep program: its own name, with the index
    into the sequence of layers replaced by its twin layer's (`_twin_layer`)."""
    names = {}
    for v, (arg, path, at) in keys.items():
        if at is not None:
            i = _twin_layer(path[at].idx, layers, depth, head, tail)
            path = path[:at] + (jax.tree_util.SequenceKey(i),) + path[at + 1:]
        names[v] = arg + jax.tree_util.keystr(path[1:])
    return names


class TwinsDisagree(PartitioningError):
    """One twin could not follow an action the other took: the twins do not stand for
    the program (the search falls back to the program itself)."""


class TwinState(PairedStates):
    """The search state of a deep program of `layers` layers, kept as two `SearchState`s
    on its shallow twins (`depths` layers, one middle layer apart) whose groups are aligned with the deep
    program's: every action goes to both, every cost is extrapolated to `layers`.

    One twin (`LEAD`) takes each action at once; the other follows only when a state is
    priced or inspected (`_following`): the tree search walks and undoes far more
    actions than it prices states (it retraces paths, and an episode that ends on a
    state already priced prices nothing). A state is keyed by the leading twin's
    partitioning: the same actions on the same kinds of layers tile the other twin as
    they tile it, as the extrapolation itself assumes. Should the following twin refuse
    an action the leading one took, `_following` raises `TwinsDisagree`."""

    def __init__(self, twins: tuple[SearchState, SearchState], layers: int, depths: tuple[int, int],
                 names: tuple[dict, dict]):
        self.twins, self.layers, self.depths, self.names = twins, layers, depths, names
        self.pair = twins
        self.axes = twins[1].axes
        self._lead, self._follower = twins[LEAD], twins[1 - LEAD]
        self._taken: list = []  # the actions the leading twin holds, in order
        self._followed: list = []  # (action, the following twin's mark before it): a prefix of `_taken`

    @property
    def deepest_part(self):
        """The partitioning of the deepest program searched: the deeper twin's (every
        kind of layer, and more than one layer, as in the program)."""
        return self.twins[1].part

    def key(self) -> int:
        """The leading twin's key (see the class docstring)."""
        return self._lead.key()

    def mark(self):
        """A point to `rollback` to."""
        return self._lead.mark(), len(self._taken)

    def rollback(self, mark) -> None:
        """Undo every action since `mark` (in the following twin, those it followed)."""
        lead, n = mark
        self._lead.rollback(lead)
        del self._taken[n:]
        if len(self._followed) > n:
            self._follower.rollback(self._followed[n][1])
            del self._followed[n:]

    def apply(self, action) -> bool:
        """Apply `action` to the leading twin (the other follows when priced); False, and
        nothing changed, if it cannot apply."""
        if not self._lead.apply(action):
            return False
        self._taken.append(action)
        return True

    def _following(self) -> SearchState:
        """The following twin, brought to the leading twin's actions."""
        follower, followed = self._follower, self._followed
        for action in self._taken[len(followed):]:
            mark = follower.mark()
            if not follower.apply(action):
                raise TwinsDisagree(f"the {self.depths[1 - LEAD]}-layer twin cannot take "
                                    f"{action.describe(follower.groups)}, which the {self.depths[LEAD]}-layer twin "
                                    "took")
            followed.append((action, mark))
        return follower

    def _both(self) -> tuple[SearchState, SearchState]:
        """Both twins (shallower first), the following one brought to the leading one's
        actions."""
        self._following()
        return self.twins

    def _extrapolate(self, shallow: float, deeper: float) -> float:
        d0, d1 = self.depths
        return shallow + (self.layers - d0) * (deeper - shallow) / (d1 - d0)

    def actions(self):
        """The tile actions that would change the leading twin (the groups are aligned)."""
        return self._lead.actions()

    def evaluate(self) -> tuple[float, float]:
        """The deep program's modeled `(step time, peak memory)`, extrapolated. Whether
        the fast peak is close enough to the limit to need the exact one is decided on
        the extrapolated peak (each twin alone is far below it, and the fast estimate's
        per-layer gap grows with the depth)."""
        (t0, p0), (t1, p1) = (t.model.evaluate_parts() for t in self._both())
        return self._step(t0, t1), self._peak(p0, p1)

    def _peak(self, shallow: float, deeper: float) -> float:
        """The deep program's peak from the twins' fast ones, exact where doubtful."""
        peak = self._extrapolate(shallow, deeper)
        if doubtful(peak, self.memory_limit):
            peak = self._extrapolate(*(t.exact_peak() for t in self._both()))
        return peak

    def evaluate_parts(self):
        """`evaluate` before overlap is applied: `(TimeParts, peak memory)` of the deep
        program, extrapolated term by term; where the twins' computations differ, the
        extrapolated step alone (as compute: overlap is already in it)."""
        (t0, p0), (t1, p1) = (t.model.evaluate_parts() for t in self._both())
        return self._deep_parts(t0, t1), self._peak(p0, p1)

    def accumulation_parts(self):
        """`evaluate_parts` with, between them, the deep program's `TimeParts` of the
        collectives run again every micro-batch (`CostModel.accumulation_parts`),
        extrapolated alike; where the twins' computations differ, their time as exposed."""
        (t0, r0, p0), (t1, r1, p1) = (t.model.accumulation_parts() for t in self._both())
        return self._deep_parts(t0, t1), self._deep_parts(r0, r1, comm_only=True), self._peak(p0, p1)

    def _deep_parts(self, shallow, deeper, *, comm_only: bool = False):
        """The deep program's `TimeParts` from the twins', term by term; where their
        computations differ, the extrapolated step alone (as compute, or with
        `comm_only`, parts of communication alone, as exposed: overlap is already in it)."""
        if shallow.parents != deeper.parents:
            step = self._step(shallow, deeper)
            return TimeParts(0.0, step) if comm_only else TimeParts(step, 0.0)
        d0, d1 = self.depths
        return shallow.extrapolate(deeper, (self.layers - d0) / (d1 - d0))

    def _step(self, shallow, deeper) -> float:
        """The deep program's step time: each term of the twins' `TimeParts`
        extrapolated, then overlap applied at depth (hidden time does not grow with
        depth as the twins' difference says); the step itself extrapolated where the
        twins' computations differ."""
        device = self.twins[0].model.device
        if shallow.parents != deeper.parents:
            return self._extrapolate(shallow.step(device)[0], deeper.step(device)[0])
        d0, d1 = self.depths
        return shallow.extrapolate(deeper, (self.layers - d0) / (d1 - d0)).step(device)[0]

    def compute_time(self) -> float:
        """The deep program's modeled compute time, extrapolated."""
        return self._extrapolate(*(t.compute_time() for t in self._both()))

    def mismatch(self, part, actions) -> str | None:
        """After `actions` were applied to the deep program's `part` (and the twins are at
        their root), the first input whose tiling differs from its twin's under the same
        actions, or None when the twins and the program agree."""
        mark = self.mark()
        try:
            for a in actions:
                self.apply(a)
            for twin, names in zip(self._both(), self.names):
                tprog = twin.part.program
                for v in part.program.inputs:
                    if part.tiling(v) != twin.part.tiling(tprog.resolve(names[v])):
                        return part.program.name(v)
            return None
        finally:
            self.rollback(mark)

    def describe(self) -> str:
        """What is searched, for the history."""
        d0, d1 = self.depths
        return (f"searched on {d0}- and {d1}-layer twins of the {self.layers}-layer program, "
                "costs extrapolated linearly in the layer count")


def twin_state(part, groups, axes, *, model, source: str, ctx):
    """`(TwinState, None)` standing in for `part` (whose input `groups` are searched over
    `axes`), or `(None, why not)`; `model(partitioning)` is the `CostModel` the search
    prices a plan with (its device, limit, lowering and donation), made for each twin.
    Each twin's macros apply with a context of its own, `ctx.child()` (`ctx` is the
    schedule's)."""
    prog = part.program
    origin = getattr(prog, "origin", None)
    if origin is None:
        return None, "the program was not lifted from a function"
    if prog.rolled:
        return None, "its layers are rolled into layer scans (partir.roll_layers), searched on the program itself"
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
    keys = _layer_keys(prog)
    if keys is None:
        return None, "the program's inputs do not match its arguments"
    edges = _edges(keys, groups, layers)
    if edges is None:
        return None, "the layers' inputs do not group as first layers, alike middle layers, last layers"
    head, tail = edges
    progs: dict[int, object] = {}
    why = ""
    for extra in range(EXTRA_MIDDLE + 1):
        depths = (head + tail + 1 + extra, head + tail + 2 + extra)
        if sum(depths) >= layers:
            return None, why or f"{layers} layers: too few beside the twins' {depths[0]} + {depths[1]}"
        for depth in depths:
            if depth not in progs:
                args = tuple(a if i in origin.static_argnums else truncate(a, depth)
                             for i, a in enumerate(origin.args))
                try:
                    with warnings.catch_warnings():
                        # The deep program already warned about whatever the twin would.
                        warnings.simplefilter("ignore")
                        progs[depth] = lift(origin.fn, *args, static_argnums=origin.static_argnums)
                except Exception as e:  # noqa: BLE001  (any failure only means: no twins)
                    return None, f"tracing a {depth}-layer twin failed ({type(e).__name__}: {str(e).splitlines()[0]})"
        for what in ("ops", "values", "inputs"):
            n0, n1 = (len(getattr(progs[d], what)) for d in depths)
            if len(getattr(prog, what)) != n0 + (layers - depths[0]) * (n1 - n0):
                return None, f"the program's {what} do not grow linearly with its {layers} layers"
        states, names = [], []
        for depth in depths:
            canon = _canonical_names(keys, layers, depth, head, tail)
            state, why = _twin(part, groups, axes, progs[depth], canon, depth, model=model, source=source,
                               ctx=ctx.child())
            if state is None:
                break
            states.append(state)
            names.append(canon)
        else:
            return TwinState(tuple(states), layers, depths, tuple(names)), None
    return None, why


def _twin(part, groups, axes, tprog, canon, depth, *, model, source, ctx):
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
            tpart.redo(d, tprog.resolve(canon[d.value]))
    except (PartitioningError, KeyError) as e:
        return None, f"earlier decisions do not replay on the {depth}-layer twin ({e})"
    for v in prog.inputs:
        tv = tprog.resolve(canon[v])
        if part.tiling(v) != tpart.tiling(tv) or part.is_pinned(v) != tpart.is_pinned(tv):
            return None, f"earlier decisions differ between layers ({prog.name(v)})"
    return SearchState(tpart, model(tpart), aligned, axes, source, ctx), None
