"""The exact baseline: every state reachable through the search's actions, costed.

With `max_depth`, the optimum among plans of at most that many actions.

A depth-first walk over the same action space and cost model as the tree search, with
a table of states already seen (the partitioning's hash), so each distinct plan is
costed once however many action orders reach it. It is exponential in the number of
groups and meant for small problems, to measure how far the tree search is from the
optimum of its own cost model; `max_states` guards against a problem too large.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from partir import PartitioningError

from ._actions import Action, apply_action, valid_actions


@dataclass(frozen=True)
class ExactResult:
    """The optimum: its actions, step time, peak memory, and how many states were costed."""

    actions: tuple[Action, ...]
    step_time: float
    memory_peak: float
    fits: bool
    states: int
    elapsed: float


def exhaustive(part, model, groups, axes, *, memory_limit: float | None = None, max_depth: int | None = None,
               max_states: int = 20_000, macros=(), source: str = "exact") -> ExactResult:
    """The best plan over all states reachable from `part` (left unchanged) in at most
    `max_depth` actions (any number when None), tiles and the given macro tactics: the
    fastest that fits the memory limit, or the smallest peak if none does."""
    limit = model.memory_limit if memory_limit is None else memory_limit
    start = time.perf_counter()
    seen: set[int] = set()
    best = [None]

    def consider(actions):
        t, peak = model.evaluate()
        key = (peak > limit, peak if peak > limit else t)
        if best[0] is None or key < best[0][0]:
            best[0] = (key, tuple(actions), t, peak)

    depth_of: dict[int, int] = {}

    def visit(actions):
        key = part.key()
        # A state is expanded again only when reached in fewer actions than before
        # (depth-limited search must not miss what a shorter path could still reach).
        if key in depth_of and depth_of[key] <= len(actions):
            return
        if key not in depth_of:
            seen.add(key)
            if len(seen) > max_states:
                raise PartitioningError(f"more than {max_states} states: too large for exhaustive search")
            consider(actions)
        depth_of[key] = len(actions)
        if max_depth is not None and len(actions) >= max_depth:
            return
        for a in valid_actions(part, groups, axes) + [Action.macro(m) for m in macros]:
            mark = part.mark()
            if apply_action(part, groups, a, source):
                visit(actions + [a])
            part.rollback(mark)

    visit([])
    (_, actions, t, peak) = best[0]
    return ExactResult(actions, t, peak, peak <= limit, len(seen), time.perf_counter() - start)
