"""What the tree search walks: a partitioning with its cost model and action space."""

from __future__ import annotations

from ._actions import Action, apply_action, valid_actions


#: The fast peak estimate is within this factor of the exact one (measured on the
#: examples: XLA's packing leaves up to ~15% gaps); above the limit by less, a plan is
#: checked exactly.
DOUBT = 1.3
#: Entries of recorded deltas (`partir.Partitioning.delta`) a search state keeps before it
#: forgets them all and records afresh: about 100 bytes each, so a few hundred MB at most.
MEMO_ENTRIES = 3_000_000


def doubtful(peak: float, limit: float) -> bool:
    """Whether a fast `peak` estimate is too close under `limit` to decide a fit."""
    return peak <= limit <= peak * DOUBT


class SearchState:
    """A partitioning being searched: `part` with its incremental `model` (a
    `CostModel` on it), the input `groups` that tile actions decide and the mesh `axes`
    they may use. Decisions are recorded under `source`; macro actions apply with `ctx`
    (the schedule's `tactics.Context`, or a twin's own), which backs out with the
    partitioning. `mcts` and `exhaustive` only talk to this interface, so `TwinState`
    (shallow twins of a deep program) can stand in for it.

    What an action did is remembered by the state it was taken in (the partitioning's
    and the context's keys): taken there again, its recorded change is replayed
    (`Partitioning.replay`) instead of running the tactic and propagation again. The
    tree search retraces its paths every episode, so most actions are replays."""

    #: The layer counts of the twins searched on (a `TwinState`'s); None: the program itself.
    depths: tuple[int, int] | None = None

    def __init__(self, part, model, groups, axes, source: str, ctx):
        self.part, self.model, self.groups, self.axes, self.source = part, model, groups, tuple(axes), source
        self.ctx = ctx
        self._memo: dict = {}
        self._memo_entries = 0

    @property
    def mesh(self):
        """The mesh the plan is for."""
        return self.part.mesh

    @property
    def memory_limit(self) -> float:
        """Bytes per device a plan may peak at."""
        return self.model.memory_limit

    @property
    def deepest_part(self):
        """The partitioning of the deepest program searched (`part`)."""
        return self.part

    def key(self) -> int:
        """A hash of the whole partitioned state (see `Partitioning.key`)."""
        return self.part.key()

    def mark(self):
        """A point to `rollback` to."""
        return self.part.mark(), self.ctx.mark()

    def rollback(self, mark) -> None:
        """Undo every action since `mark` (in the partitioning and the context)."""
        self.part.rollback(mark[0])
        self.ctx.rollback(mark[1])

    def actions(self) -> list[Action]:
        """The tile actions that would change the state (see `valid_actions`)."""
        return valid_actions(self.part, self.groups, self.axes)

    def apply(self, action: Action) -> bool:
        """Apply `action`; False, and nothing changed, if it cannot apply."""
        part, ctx = self.part, self.ctx
        before = part.key()
        key = (before, ctx.key(), action)
        done = self._memo.get(key)
        if done is not None:
            if done:
                part.replay(done[0])
                ctx.extend(done[1])
            return bool(done)
        mark, ctx_mark = part.mark(), ctx.mark()
        if not apply_action(part, self.groups, action, self.source, ctx):
            self._memo[key] = ()
            return False
        delta = part.delta(mark, before)
        if self._memo_entries + delta.size > MEMO_ENTRIES:
            self._memo.clear()
            self._memo_entries = 0
        self._memo[key] = (delta, ctx.added_since(ctx_mark))
        self._memo_entries += delta.size
        return True

    def evaluate(self) -> tuple[float, float]:
        """Modeled `(step time, peak memory)` of the current state. The fast peak is
        optimistic by the gaps XLA's packing leaves; near the memory limit, where that
        decides whether a plan fits, the exact one is taken (`CostModel.cost`)."""
        t, peak = self.model.evaluate()
        if doubtful(peak, self.model.memory_limit):
            peak = self.model.exact_peak()
        return t, peak

    def evaluate_parts(self):
        """`evaluate` before overlap is applied: `(TimeParts, peak memory)`, for the
        accumulated step to extrapolate term by term (`search._accum`)."""
        parts, peak = self.model.evaluate_parts()
        if doubtful(peak, self.model.memory_limit):
            peak = self.model.exact_peak()
        return parts, peak

    def accumulation_parts(self):
        """`evaluate_parts` with, between them, the `TimeParts` of the collectives run
        again every micro-batch of an accumulated step (`CostModel.accumulation_parts`)."""
        parts, again, peak = self.model.accumulation_parts()
        if doubtful(peak, self.model.memory_limit):
            peak = self.model.exact_peak()
        return parts, again, peak

    @property
    def device(self):
        """The device the state is priced on (its cost model's)."""
        return self.model.device

    def exact_peak(self) -> float:
        """The exact modeled peak memory of the current state (`CostModel.exact_peak`)."""
        return self.model.exact_peak()

    def compute_time(self) -> float:
        """Modeled compute time of the current state (no communication)."""
        return self.model.cost().compute_time

    def mismatch(self, part, actions) -> str | None:
        """The first input of `part` that the searched plan splits otherwise than the
        search foresaw: None, as the search ran on `part` itself."""
        return None

    def describe(self) -> str:
        """What is searched, for the history."""
        return "searched on the program itself"


class PairedStates:
    """Two search states that every action goes to, scored together: a deep program's
    shallow twins (`search._twins`), a step on one and on two micro-batches
    (`search._accum`). Subclasses set `pair` and price it."""

    pair: tuple

    @property
    def mesh(self):
        """The mesh the plan is for."""
        return self.pair[0].mesh

    @property
    def memory_limit(self) -> float:
        """Bytes per device a plan may peak at."""
        return self.pair[0].memory_limit

    @property
    def device(self):
        """The device the states are priced on."""
        return self.pair[0].device

    def key(self) -> int:
        """A hash of both states."""
        return hash(tuple(s.key() for s in self.pair))

    def mark(self):
        """A point to `rollback` to."""
        return tuple(s.mark() for s in self.pair)

    def rollback(self, mark) -> None:
        """Undo every action since `mark`."""
        for s, m in zip(self.pair, mark):
            s.rollback(m)

    def apply(self, action) -> bool:
        """Apply `action` to both states; False, and nothing changed, unless both take it."""
        mark = self.mark()
        if all([s.apply(action) for s in self.pair]):
            return True
        self.rollback(mark)
        return False
