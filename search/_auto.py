"""`AutomaticPartition`: the search as a tactic."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from tactics import FSDP, Context, DataParallel, Megatron, Tactic, TacticError, roles

from ._actions import apply_action, input_groups
from ._cost import CostModel
from ._mcts import SearchResult, mcts
from ._state import SearchState
from ._twins import twin_state


@dataclass(frozen=True)
class AutomaticPartition(Tactic):
    """Find how to split what earlier tactics left open, over `axes` (all mesh axes by
    default), by Monte Carlo tree search on the cost model of `device`.

    Actions tile groups of inputs (parameters and batch; optimizer state follows its
    parameter); `group=False` decides every input on its own. With `macros=True` (the
    default) the search may also apply `DataParallel`, `Megatron` or `FSDP` on an axis
    as one action, as Automap's inductive tactics do; `macros=False` leaves it single
    tiles only. `memory_limit` (bytes per device;
    the device's HBM by default) is a hard constraint. Stops at `budget_s` seconds,
    after `max_episodes`, or on convergence; `progress(episodes, best step time,
    elapsed)` is called as it goes. The result is kept in `result` of the schedule's
    context (`Context.search[...]`).

    A model with a list of 8 or more alike layers in its arguments is searched on two
    shallow twins with costs extrapolated to its depth (`search._twins`), so
    the search takes no longer for 48 layers than for 8; the first note of the history
    says whether it was, and why not.
    """

    axes: tuple[str, ...] | None = None
    budget_s: float = 30.0
    memory_limit: float | None = None
    seed: int = 0
    device: object = "h100"
    group: bool = True
    macros: bool = True
    max_episodes: int | None = None
    progress: Callable | None = field(default=None, compare=False, repr=False)

    def apply(self, part, ctx: Context):
        start = time.perf_counter()
        prog = part.program
        axes = tuple(part.mesh.names) if self.axes is None else tuple(self.axes)
        for a in axes:
            part.mesh.size(a)
        if self.budget_s <= 0:
            raise TacticError(f"budget_s must be positive, got {self.budget_s}")
        r = roles(prog)
        groups = input_groups(prog, r.params + r.batch, group=self.group)
        macros = ()
        if self.macros:
            # FSDP without ZeRO's trial Megatron: the search tries both orders itself.
            macros = tuple(m for a in axes if part.mesh.size(a) > 1
                           for m in (DataParallel(a), Megatron(a), FSDP(a, leave_room=False)))
        state, why = None, "group=False decides layers one by one"
        if self.group:
            state, why = twin_state(part, groups, axes, device=self.device, memory_limit=self.memory_limit,
                                    source=str(self))
        while True:
            if state is None:
                state = SearchState(part, CostModel(part, self.device, memory_limit=self.memory_limit), groups,
                                    axes, str(self))
            result: SearchResult = mcts(state, budget_s=self.budget_s, seed=self.seed,
                                        max_episodes=self.max_episodes, macros=macros, progress=self.progress,
                                        start=start)
            mark = part.mark()
            for action in result.actions:
                apply_action(part, groups, action, str(self))
            differs = state.mismatch(part, result.actions)
            if differs is None:
                break
            # The twins did not foresee the program: e.g. a plain chain of matmuls whose
            # group tile alternates column and row splits from layer to layer, which one
            # middle layer cannot show. Search the program itself, with a budget of its own.
            part.rollback(mark)
            state, why, start = None, f"the twins' plan splits {differs} differently in the program", None
        ctx.search[str(self)] = (result, groups)
        st = result.stats
        notes = [state.describe() + (f" ({why})" if why else ""),
                 f"{len(groups)} groups over axes {', '.join(axes)}; {st.episodes} episodes, {st.states} states, "
                 f"{st.cache_hits} cache hits in {st.elapsed:.1f} s ({st.stopped})",
                 f"modeled step {result.step_time * 1e3:.3f} ms vs {result.root_step_time * 1e3:.3f} ms before"
                 + ("" if result.fits else " (does not fit the memory limit)")]
        notes += [f"action: {a.describe(groups)}" for a in result.actions]
        return part, notes

    def __str__(self) -> str:
        axes = "all axes" if self.axes is None else ", ".join(self.axes)
        return f"AutomaticPartition({axes}, seed={self.seed})"
