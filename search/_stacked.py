"""Searching a step over unrolled layers on its stacked form (`partir.stack_layers`).

The stacked form holds each sequence of L alike layers as `[L, ...]` stacks, as the
scanned form of the model does: the layers' passes are layer scans and each layer's
update outside them runs once on the stacks. An episode on it costs what one on the
scanned form costs (Llama-3 8B: 705 ops against the scanned form's 693 and the unrolled
program's 13547), and its costs are the deep program's own at depth L, nothing
extrapolated.

A group action of the program `tile(group, dim, axis)` is the same tile of the group's
stacks on `dim + 1` (a stack's dim 0, the layer, is never split: every layer's array is
one dim lower); a group of inputs outside the layers is the same inputs. Macros apply to
the stacked form as they do to a scanned program. After the search the plan is applied
to the program, and every input's tiling is checked against its stack's one dim lower
(`StackedState.mismatch`); where they differ the search runs again on twins or on the
program, saying why.
"""

from __future__ import annotations

from dataclasses import replace

from partir import Partitioning, PartitioningError, stack_layers
from tactics import Group

from ._actions import Action
from ._state import SearchState
from ._twins import TWIN_MIN_LAYERS, layer_counts


class StackedState:
    """The search state of a program over unrolled layers, kept as a `SearchState` on its
    stacked form (`inner`, whose groups are the program's `groups` with each layer input
    replaced by its stack). `layered[g]`: does group g hold stacks (its tiles then move
    one dim up)? `stack_of` maps each program input to its stacked form's input, and
    `stacks` are the stacked form's inputs that stack `layers` layers."""

    #: Not searched on twins (the result's `twins`).
    depths = None

    def __init__(self, inner: SearchState, layered: tuple[bool, ...], stack_of: dict[int, int],
                 stacks: frozenset[int], layers: int, followers: dict[int, tuple[int, ...]]):
        self.inner, self.layered, self.stack_of, self.stacks, self.layers = inner, layered, stack_of, stacks, layers
        self.followers = followers
        self._hidden = frozenset(f for fs in followers.values() for f in fs)
        self.axes = inner.axes

    @property
    def mesh(self):
        """The mesh the plan is for."""
        return self.inner.mesh

    @property
    def memory_limit(self) -> float:
        """Bytes per device a plan may peak at."""
        return self.inner.memory_limit

    @property
    def device(self):
        """The device the state is priced on."""
        return self.inner.device

    @property
    def deepest_part(self):
        """The stacked form's partitioning (every kind of layer, its scans and attentions,
        in the scanned form's ops): the macros are found on it."""
        return self.inner.part

    def key(self) -> int:
        """The stacked form's key."""
        return self.inner.key()

    def mark(self):
        """A point to `rollback` to."""
        return self.inner.mark()

    def rollback(self, mark) -> None:
        """Undo every action since `mark`."""
        self.inner.rollback(mark)

    def _down(self, action: Action) -> Action:
        """`action` on the stacked form: a tile of a layer group one dim up."""
        if action.kind == "tile" and self.layered[action.group]:
            return Action.tile(action.group, action.dim + 1, action.axis)
        return action

    def apply(self, action: Action) -> bool:
        """Apply `action` (a program's action) to the stacked form; False, and nothing
        changed, if it cannot apply."""
        return self.inner.apply(self._down(action))

    def actions(self) -> list[Action]:
        """The program's tile actions that would change the stacked form (never a split of
        a stack's layer dim)."""
        out = []
        for a in self.inner.actions():
            if a.kind == "tile" and a.group in self._hidden:
                continue
            if a.kind == "tile" and self.layered[a.group]:
                if a.dim == 0:
                    continue
                a = Action.tile(a.group, a.dim - 1, a.axis)
            out.append(a)
        return out

    def program_actions(self, actions) -> tuple[Action, ...]:
        """The plan `actions` for the program: each tile of a group followed by the same
        tile of the groups on its stacks (`followers`)."""
        out = []
        for a in actions:
            out.append(a)
            if a.kind == "tile":
                out += [Action.tile(f, a.dim, a.axis) for f in self.followers.get(a.group, ())]
        return tuple(out)

    def plan(self, result):
        """`result` (the search's) with its plan and alternatives as `program_actions`."""
        return replace(result, actions=self.program_actions(result.actions),
                       alternatives=tuple((self.program_actions(a), t, p) for a, t, p in result.alternatives))

    def evaluate(self) -> tuple[float, float]:
        """The modeled `(step time, peak memory)` of the stacked form (the program's)."""
        return self.inner.evaluate()

    def evaluate_parts(self):
        """`evaluate` before overlap is applied (`SearchState.evaluate_parts`)."""
        return self.inner.evaluate_parts()

    def exact_peak(self) -> float:
        """The stacked form's exact modeled peak memory."""
        return self.inner.exact_peak()

    def compute_time(self) -> float:
        """The stacked form's modeled compute time."""
        return self.inner.compute_time()

    def mismatch(self, part, actions) -> str | None:
        """After `actions` were applied to the program's `part` (and the stacked form is at
        its root), the first program input whose tiling is not its stack's one dim lower
        (or, outside the layers, its stacked form's input's), or None."""
        mark = self.mark()
        try:
            for a in actions:
                self.apply(a)
            spart = self.inner.part
            for v in part.program.inputs:
                s = self.stack_of[v]
                want = spart.tiling(s)
                if s in self.stacks:
                    if want.dims[0] or want.partial:
                        return part.program.name(v)
                    want = type(want)(want.dims[1:])
                if part.tiling(v) != want:
                    return part.program.name(v)
            return None
        finally:
            self.rollback(mark)

    def describe(self) -> str:
        """What is searched, for the history."""
        return (f"searched on the stacked form of the {self.layers}-layer program (each layer input an [L, ...] "
                "stack, as a layer scan's), costs the program's at its depth")


def stacked_state(part, groups, axes, *, model, source: str, ctx):
    """`(StackedState, None)` standing in for `part` (whose input `groups` are searched
    over `axes`), or `(None, why not)`; `model(partitioning)` is the search's
    `CostModel` factory, `ctx` the context macros apply with (a child of the schedule's:
    what they record names the stacked form's values)."""
    prog = part.program
    if prog.origin is None:
        return None, "the program was not lifted from a function"
    if prog.rolled:
        return None, "its layers are rolled into layer scans (partir.roll_layers)"
    if part.detached:
        return None, "earlier tactics detached values from their tiling classes"
    if part.decisions:
        return None, "earlier tactics decided values (the stacked form replays none)"
    origin = prog.origin
    counts = layer_counts([a for i, a in enumerate(origin.args) if i not in origin.static_argnums])
    if not counts or min(counts) < TWIN_MIN_LAYERS:
        # A shallower program is searched on itself, as without twins: its episodes cost
        # little, and the plan is the program's own.
        return None, f"no sequence of {TWIN_MIN_LAYERS} or more alike layers among the arguments"
    try:
        stacked = stack_layers(prog)
    except PartitioningError as e:
        return None, str(e)
    sprog = stacked.program
    stack_of = {prog.inputs[k]: s for leaf, s in zip(stacked.inputs, sprog.inputs) for k in leaf.members}
    members = {s: {prog.inputs[k] for k in leaf.members} for leaf, s in zip(stacked.inputs, sprog.inputs)}
    layered_stacks = {s for leaf, s in zip(stacked.inputs, sprog.inputs) if leaf.stacked}
    by_stacks: dict[tuple, list[int]] = {}  # the stacks of a group -> the groups of the program on them
    for gi, g in enumerate(groups):
        stacks = tuple(sorted({stack_of[m] for m in g.members}))
        if len({s in layered_stacks for s in stacks}) != 1:
            return None, f"{g.label} groups layer inputs with inputs outside the layers"
        by_stacks.setdefault(stacks, []).append(gi)
    followers = {}
    for stacks, gis in by_stacks.items():
        held = [m for gi in gis for m in groups[gi].members]
        if sorted(held) != sorted(set().union(*(members[s] for s in stacks))):
            return None, f"{groups[gis[0]].label} holds some of its stacks' layers, others are in no group"
        # The group of most layers (the middle ones) stands for all: a stack is tiled
        # alike in every layer, so the first and last layers' groups follow it.
        lead = max(gis, key=lambda gi: (len(groups[gi].members), -gi))
        followers[lead] = tuple(gi for gi in gis if gi != lead)
    aligned = [Group(stacks, groups[gi].label) for stacks, gis in by_stacks.items() for gi in gis]
    order = [gi for gis in by_stacks.values() for gi in gis]
    aligned = [aligned[order.index(gi)] for gi in range(len(groups))]
    spart = Partitioning(sprog, part.mesh)
    layers = max(len(leaf.members) for leaf in stacked.inputs)
    layered = tuple(g.members[0] in layered_stacks for g in aligned)
    inner = SearchState(spart, model(spart), aligned, axes, source, ctx)
    return StackedState(inner, layered, stack_of, frozenset(layered_stacks), layers, followers), None
