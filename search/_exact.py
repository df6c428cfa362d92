"""The exact baseline: every state reachable through the search's actions, costed.

With `max_depth`, the optimum among plans of at most that many actions.

A depth-first walk through the same search state as the tree search (`SearchState`, or
`TwinState` for a deep model): the same actions, the same cost model. A table of states
already seen (the state's hash) costs each distinct plan once however many action
orders reach it. It is exponential in the number of
groups and meant for small problems, to measure how far the tree search is from the
optimum of its own cost model; `max_states` guards against a problem too large.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from partir import PartitioningError

from ._actions import Action


@dataclass(frozen=True)
class ExactResult:
    """The optimum: its actions, step time, peak memory, and how many states were costed."""

    actions: tuple[Action, ...]
    step_time: float
    memory_peak: float
    fits: bool
    states: int
    elapsed: float


def exhaustive(state, *, max_depth: int | None = None, max_states: int = 20_000, macros=()) -> ExactResult:
    """The best plan over all states reachable from `state` (a `SearchState` or a
    `TwinState`, left as it was) in at most `max_depth` actions (any number when None),
    its tiles and the given macro tactics: the fastest that fits its memory limit, or
    the smallest peak if none does."""
    limit = state.memory_limit
    start = time.perf_counter()
    macro_actions = [Action.macro(m) for m in macros]
    best = None
    depth_of: dict[int, int] = {}  # the fewest actions each state seen was reached in

    def visit(actions):
        nonlocal best
        key = state.key()
        # A state is expanded again only when reached in fewer actions than before
        # (depth-limited search must not miss what a shorter path could still reach).
        if key in depth_of and depth_of[key] <= len(actions):
            return
        if key not in depth_of:
            if len(depth_of) >= max_states:
                raise PartitioningError(f"more than {max_states} states: too large for exhaustive search "
                                        "(lower max_depth, or raise max_states)")
            t, peak = state.evaluate()
            rank = (peak > limit, peak if peak > limit else t)
            if best is None or rank < best[0]:
                best = (rank, tuple(actions), t, peak)
        depth_of[key] = len(actions)
        if max_depth is not None and len(actions) >= max_depth:
            return
        for a in state.actions() + macro_actions:
            mark = state.mark()
            if state.apply(a):
                visit(actions + [a])
            state.rollback(mark)

    visit([])
    _, actions, t, peak = best
    return ExactResult(actions, t, peak, peak <= limit, len(depth_of), time.perf_counter() - start)
