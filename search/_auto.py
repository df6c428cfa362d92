"""`AutomaticPartition`: the search as a tactic."""

from __future__ import annotations

import dataclasses
import numbers
import time
from dataclasses import dataclass, field
from typing import Callable

from tactics import Context, Tactic, TacticError, check, roles

from . import _seeds
from ._accum import AccumulatedState, two_micro_batches
from ._actions import apply_action, input_groups
from .cost import BACKENDS as LOWERINGS, DEFAULT_DEVICE, CostModel, bytes_str, get_device, time_str
from ._mcts import mcts
from ._result import SearchResult
from ._stacked import StackedState, stacked_state
from ._state import SearchState
from ._twins import TwinsDisagree, twin_state
from ._zero_root import offers_zero, zero_root


#: How many of the buffers live at the memory peak an error names.
PEAK_BUFFERS = 5


@dataclass(frozen=True)
class AutomaticPartition(Tactic):
    """Find how to split what earlier tactics left open, over `axes` (all mesh axes by
    default), by Monte Carlo tree search on the cost model of `device`.

    Actions tile groups of inputs (parameters and batch; optimizer state follows its
    parameter); `group=False` decides every input on its own. With `macros=True` (the
    default) the search may also apply `DataParallel`, `Megatron`, `FSDP` or (where the
    program has self-attention) `ContextParallel` on an axis as one action, as Automap's
    inductive tactics do; `macros=False` leaves it single
    tiles only; the macros also rematerialize activations (`Remat` with each policy)
    and add sequence parallelism after a Megatron, so memory is a decision the search
    takes jointly with the tilings. Before its tree search it scores every plan that
    gives each searched axis one role (`search.compositions`: data parallel, FSDP,
    Megatron with or without sequence parallelism, context parallelism, pipeline stages;
    with the remat policies 'dots' and 'full'), so the plans a practitioner writes are
    always among those it weighs; its best plan is then tried with the policies that
    keep some matmuls by role ('qkv', 'dots_except_mlp_in') in place of its remat, and
    keeps the fastest that fits. `memory_limit` (bytes per device; the device's HBM
    by default) is a hard constraint: when no plan the search meets fits, it raises a
    `TacticError` naming the best plan's peak, what is live at it and the smallest peak
    it reached, unless `best_effort=True` (then it returns the best plan, marked as not
    fitting). Stops at `budget_s` seconds,
    after `max_episodes`, or on convergence; `progress(episodes, best step time,
    elapsed)` is called as it goes. The `SearchResult` is appended to the schedule's
    context (`Context.search`), with how the search ran (`twins`, `why`). Macro actions
    apply with the schedule's context: a Megatron the search chose leaves its blocks
    for a later `SequenceParallel`, and its notes follow the action's in the history.
    `pipelines` lists microbatch counts the search may also pipeline a layer scan with
    (`Pipeline(axis, m)` as a macro on each searched axis; none by default): it then
    weighs stages, their bubble and their point-to-point sends against the other
    tactics on the same cost model. `lowering` is the one the plan will run under
    ('jit' or 'shard_map'; `automap` fills in its own where it is None, 'jit' when the
    tactic is applied alone): the cost model prices its collectives (`CostModel`'s
    `backend`), and under 'shard_map' context parallelism is offered as a ring too
    (`ContextParallel(strategy='ring')`, which only that lowering runs). `device` is
    the cost model's device (a preset name or a `DeviceSpec`); `automap` fills in the
    plan's where it is None, and its memory limit where `memory_limit` is None; alone,
    None is the default preset and its HBM.

    A model with a list of 8 or more alike layers in its arguments is searched on its
    stacked form (`search._stacked`: the layers' inputs as `[L, ...]` stacks, as a
    layer scan takes them, costs the program's own), else, where the layers do not
    stack, on two shallow twins with costs extrapolated to its depth (`search._twins`),
    so the search takes no longer for 48 layers than for 8; the result's `twins` and
    `why` (and the first note of the history) say which it was, and why not the others.

    `grad_accum` is how many micro-batches a step the program (the train step of one)
    runs with gradient accumulation: above 1, plans are chosen by the accumulated step,
    each time term extrapolated as P(1) + (grad_accum - 1) (P(2) - P(1) + R) from the
    step on one and on two micro-batches and R, the collectives run again every
    micro-batch though the batch does not grow them (FSDP's parameter gathers and
    gradient reduce-scatters), overlap applied after (`search.accumulated_step`), as a
    run pays its per-micro-batch work that many times and its gradient all-reduce and
    update once; memory is one micro-batch's with a gradient accumulator (`CostModel`'s
    `grad_accum`). Where the program itself is searched
    (not twins), it starts from a partitioning detached for ZeRO-1 and offers
    `ZeRO(axis, stage=1)` as a macro (`search._zero_root`): the parameters whole and
    gathered once a step, the optimizer state sharded, against FSDP's gathers every
    micro-batch; the tactic says which the plan chose.

    `donate_argnums` lists the arguments (positions among the non-static ones) the plan
    will be called with donated, as `jax.jit`'s: the cost model then lets an updated
    output reuse its donated input's buffer (`CostModel`'s `donate_argnums`), so the
    memory limit is held against the peak the plan will have when run so; `automap`
    fills in its own where it is left at ().
    """

    axes: tuple[str, ...] | None = None
    budget_s: float = 30.0
    memory_limit: float | None = None
    seed: int = 0
    device: object = None
    group: bool = True
    macros: bool = True
    max_episodes: int | None = None
    best_effort: bool = False
    pipelines: tuple[int, ...] = ()
    lowering: str | None = None
    grad_accum: int = 1
    donate_argnums: tuple[int, ...] = ()
    progress: Callable | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        # Checked when made, not when the search starts: and normalised (a list of axes
        # to a tuple, budgets and limits to floats) so that equal settings are equal
        # identities in plan cache keys.
        where = "AutomaticPartition "
        for name, value in (("axes", check.axis_names(where + "axes", self.axes, error=TacticError)),
                            ("budget_s", check.number(where + "budget_s", self.budget_s, example="budget_s=30",
                                                      error=TacticError)),
                            ("memory_limit", check.number(where + "memory_limit", self.memory_limit, optional=True,
                                                          example="memory_limit=80e9 (bytes per device)",
                                                          error=TacticError)),
                            ("seed", check.number(where + "seed", self.seed, integer=True, sign="any",
                                                  example="seed=0", error=TacticError)),
                            ("max_episodes", check.number(where + "max_episodes", self.max_episodes, integer=True,
                                                          optional=True, example="max_episodes=200",
                                                          error=TacticError)),
                            ("grad_accum", check.number(where + "grad_accum", self.grad_accum, integer=True,
                                                        example="grad_accum=32 (micro-batches a step)",
                                                        error=TacticError))):
            object.__setattr__(self, name, value)
        if not isinstance(self.pipelines, (tuple, list)):
            raise TacticError(f"AutomaticPartition pipelines={self.pipelines!r}: give microbatch counts as a tuple, "
                              "e.g. pipelines=(4, 8), or () for none")
        object.__setattr__(self, "donate_argnums", _positions(self.donate_argnums))
        object.__setattr__(self, "pipelines", tuple(
            check.number(where + "pipelines", m, integer=True, example="pipelines=(4, 8)", error=TacticError)
            for m in self.pipelines))
        if self.lowering not in (None, *LOWERINGS):
            raise TacticError(f"AutomaticPartition lowering={self.lowering!r}: choose one of {LOWERINGS}, or None "
                              "for the one the plan runs under")
        get_device(self.priced_on)  # an unknown device fails now, not after the search
        if self.progress is not None and not callable(self.progress):
            raise TacticError(f"AutomaticPartition progress={self.progress!r} is not callable: pass "
                              "a function (episodes, best step time, elapsed) or None")

    def apply(self, part, ctx: Context):
        start = time.perf_counter()
        part, axes, groups, two, (state, why), macros = self._space(part, ctx)
        seeds = _seeds.compositions(macros)
        while True:
            try:
                result: SearchResult = mcts(state, budget_s=self.budget_s, seed=self.seed,
                                            max_episodes=self.max_episodes, macros=macros, progress=self.progress,
                                            start=start, seeds=seeds)
            except TwinsDisagree as e:
                # The shallower twin refused an action the deeper one took: the twins do
                # not stand for the program. Search it itself, with a budget of its own.
                why = str(e)
                state, start = self._program_state(part, groups, axes, ctx, two), None
                continue
            if isinstance(state, StackedState):
                result = state.plan(result)
            mark, ctx_mark = part.mark(), ctx.mark()
            said = self._apply_plan(part, groups, result.actions, ctx)
            differs = state.mismatch(part, result.actions)
            if differs is None:
                break
            # The twins did not foresee the program: e.g. a plain chain of matmuls whose
            # group tile alternates column and row splits from layer to layer, which one
            # middle layer cannot show. Search the program itself, with a budget of its own.
            part.rollback(mark)
            ctx.rollback(ctx_mark)
            if isinstance(state, StackedState):
                # The stacked form's plan splits a layer's array otherwise than its stack:
                # search again on twins (or the program), with a budget of their own.
                why = f"the stacked form's plan splits {differs} otherwise than its stack"
                state, _ = self._twins_or_program(part, groups, axes, ctx, why)
                start = None
                continue
            why = f"the twins' plan splits {differs} differently in the program"
            state, start = self._program_state(part, groups, axes, ctx, two), None
        result = dataclasses.replace(result, groups=tuple(groups), twins=state.depths, why=why or "")
        costs = _ExactCosts(self._model)  # each plan on the program is costed once
        result, said = self._fitting(part, groups, result, ctx, said, (mark, ctx_mark), costs)
        self._check_fits(part, result, costs)
        ctx.search.append(result)
        st = result.stats
        notes = [state.describe() + (f" ({why})" if why else ""),
                 f"{len(groups)} groups over axes {', '.join(axes)}; {st.episodes} episodes, {st.states} states, "
                 f"{st.cache_hits} cache hits in {st.elapsed:.1f} s ({st.stopped})" + _unscored(st),
                 f"modeled step {result.step_time * 1e3:.3f} ms vs {result.root_step_time * 1e3:.3f} ms before"
                 + ("" if result.fits else " (does not fit the memory limit)")]
        unsplit = self._why_replicated(part, groups, result, costs)
        return part, notes + ([unsplit] if unsplit else []) + said

    def search_space(self, part, ctx: Context):
        """What this search walks from `part`: `(state, macros)`, the search state
        (shallow twins where they are sound, else `part` itself, with `ctx` for the
        macros) and the macro tactics; e.g. for `exhaustive` to walk the same space."""
        *_, (state, _), macros = self._space(part, ctx)
        return state, macros

    def _space(self, part, ctx):
        """`(part, axes, groups, two, (state, why not on twins), macros)` of a search from
        `part`: the partitioning searched (`part`, or where the program itself is searched
        with gradient accumulation, `part` detached so that ZeRO-1 is a macro:
        `search._zero_root`), the axes searched, the input groups, it on two
        micro-batches (None without gradient accumulation), the search state and the
        macro tactics."""
        axes, groups = self._setup(part)
        two = two_micro_batches(part, str(self)) if self.grad_accum > 1 else None
        state, why = self._state(part, groups, axes, ctx, two)
        root = zero_root(part, self.grad_accum, self.macros) if state.depths is None else None
        if root is not None:
            part, two = root, two_micro_batches(root, str(self))
            state = self._state(part, groups, axes, ctx, two)[0]  # (why not on twins: as before)
        return part, axes, groups, two, (state, why), self._macros(state, axes)

    def _state(self, part, groups, axes, ctx, two=None):
        """`(state, why not on twins)`: twins where they are sound, else `part` itself;
        with `two` (`part`'s plan on two micro-batches), the accumulated step's state
        over both."""
        state, why = self._one_state(part, groups, axes, ctx, stacked=two is None)
        if two is None:
            return state, why
        # Both micro-batch counts on twins (or the programs): their states take the same actions.
        other = self._one_state(two, groups, axes, ctx.child(), stacked=False)[0]
        return AccumulatedState(state, other, self.grad_accum), why

    def _one_state(self, part, groups, axes, ctx, stacked=True):
        """`(state, why not on the stacked form or twins)`: a step over unrolled layers on
        its stacked form (`search._stacked`; not with pipelines, which the search would
        offer on its layer scans, nor beside a second micro-batch), else on shallow
        twins, else `part` itself."""
        if not self.group:
            return self._program_state(part, groups, axes, ctx), "group=False decides layers one by one"
        why = "pipelines are searched on the program's own layer scans" if self.pipelines else None
        if stacked and not self.pipelines:
            state, why = stacked_state(part, groups, axes, model=self._model, source=str(self), ctx=ctx.child())
            if state is not None:
                return state, None
        return self._twins_or_program(part, groups, axes, ctx, why)

    def _twins_or_program(self, part, groups, axes, ctx, not_stacked):
        """`(state, why)`: twins where sound, else `part` itself; `why` says why not the
        stacked form (`not_stacked`) and, on the program, why not twins."""
        state, why = twin_state(part, groups, axes, model=self._model, source=str(self), ctx=ctx)
        if state is not None:
            return state, None if not_stacked is None else f"not stacked: {not_stacked}"
        return self._program_state(part, groups, axes, ctx), why

    def _program_state(self, part, groups, axes, ctx, two=None):
        state = SearchState(part, self._model(part), groups, axes, str(self), ctx)
        if two is None:
            return state
        return AccumulatedState(state, SearchState(two, self._model(two), groups, axes, str(self), ctx.child()),
                                self.grad_accum)

    def _setup(self, part):
        """The axes searched and the input groups; checks the settings."""
        axes = tuple(part.mesh.names) if self.axes is None else tuple(self.axes)
        for a in axes:
            part.mesh.size(a)
        args = max(part.program.input_args, default=-1) + 1
        if any(i >= args for i in self.donate_argnums):
            raise TacticError(f"AutomaticPartition donate_argnums={self.donate_argnums}: the program takes {args} "
                              f"arguments (positions 0 to {args - 1} among the non-static ones); donate only those")
        r = roles(part.program)
        groups = input_groups(part.program, r.params + r.batch, group=self.group)
        return axes, groups

    def _macros(self, state, axes) -> tuple:
        """The macro tactics the search offers (`search.macros`), found on the deepest
        program the `state` searches (`deepest_part`): on twins the deeper twin, which
        has the program's kinds of layers, attentions and scans in a fraction of its
        ops (on the program itself, finding the layers and attentions of Llama-3 8B's
        32 took 0.4 s)."""
        if not self.macros:
            return ()
        return _seeds.macros(state.deepest_part, axes, self.pipelines, ring=self.backend == "shard_map",
                             zero=offers_zero(state.deepest_part))

    def _fitting(self, part, groups, result, ctx, said, marks, costs):
        """`(result, notes)` of a plan that fits the program exactly: the searched one,
        else the first runner-up that does (the search's peaks are estimates, extrapolated
        on twins), else the searched one again; `fits` is the exact verdict, against the
        device's HBM where no `memory_limit` was given (the limit the search held)."""
        if costs.fits(part):
            return dataclasses.replace(result, fits=True), said
        for actions, step, peak in result.alternatives:
            part.rollback(marks[0])
            ctx.rollback(marks[1])
            alt_said = self._apply_plan(part, groups, actions, ctx)
            if costs.fits(part):
                return dataclasses.replace(result, actions=actions, step_time=step, memory_peak=peak, fits=True), \
                    alt_said
        part.rollback(marks[0])
        ctx.rollback(marks[1])
        return dataclasses.replace(result, fits=False), self._apply_plan(part, groups, result.actions, ctx)

    def _why_replicated(self, part, groups, result, costs) -> str | None:
        """Why a search that splits nothing kept everything replicated, from the best
        split it found (the first runner-up): its modeled step against the replicated
        one, the compute it saves and the communication it adds (or the memory)."""
        if result.actions or not result.alternatives or part.decisions:
            return None
        actions, _, _ = result.alternatives[0]
        trial = part.copy()
        self._apply_plan(trial, groups, actions, Context())
        split = self._model(trial).cost(top=0)
        whole = costs.cost(part)
        what = ", ".join(a.describe(groups) for a in actions)
        head = (f"kept everything replicated: the best split found ({what}) models {time_str(split.step_time)} "
                f"against {time_str(whole.step_time)} replicated")
        if split.step_time < whole.step_time and not split.fits:
            return f"{head} but peaks at {bytes_str(split.memory_peak)}, over the limit"
        saved = whole.compute_time - split.compute_time
        added = split.step_time - split.compute_time - (whole.step_time - whole.compute_time)
        n = sum(c.count for c in split.collectives)
        return (f"{head}: it saves {time_str(max(saved, 0.0))} of compute ({time_str(whole.compute_time)} -> "
                f"{time_str(split.compute_time)}; fixed per-op costs do not shrink with the work) and its {n:.0f} "
                f"collectives add {time_str(added)}, so at this size splitting does not pay (a larger model or "
                "batch does)")

    @property
    def priced_on(self):
        """The device the search prices plans on (`device`, else the default preset)."""
        return DEFAULT_DEVICE if self.device is None else self.device

    @property
    def backend(self) -> str:
        """The lowering the search prices plans under (`lowering`, else 'jit')."""
        return self.lowering or "jit"

    def _model(self, part) -> CostModel:
        """The cost model of `part` on the search's device, limit and lowering."""
        return CostModel(part, self.priced_on, memory_limit=self.memory_limit, backend=self.backend,
                         donate_argnums=self.donate_argnums, grad_accum=self.grad_accum)

    def _check_fits(self, part, result, costs) -> None:
        """A plan over the memory limit is an error, unless the caller asked for the best
        effort. The search scores memory fast (`CostModel.evaluate`); the verdict is the
        exact one (`CostModel.exact_peak`, XLA's buffer assignment emulated)."""
        if costs.fits(part) or self.best_effort:
            return
        cost = costs.cost(part)
        live = ", ".join(f"{n} ({bytes_str(b)})" for n, b in cost.memory_at_peak[:PEAK_BUFFERS])
        raise TacticError(
            f"no plan found fits {bytes_str(cost.memory_limit)} per device: the best one peaks at "
            f"{bytes_str(cost.memory_peak)} (live there: {live}); the smallest peak any plan reached was "
            f"{bytes_str(result.stats.min_peak)}. Use more devices, a larger memory_limit, or "
            "best_effort=True to take the best plan anyway")

    def _apply_plan(self, part, groups, actions, ctx) -> list[str]:
        """Apply the searched plan to the program's `part` with the schedule's context
        (so that e.g. a Megatron's blocks are there for a later SequenceParallel); the
        notes that say what each action did."""
        notes = []
        for action in actions:
            said = []
            apply_action(part, groups, action, str(self), ctx, notes=said)
            notes.append(f"action: {action.describe(groups)}")
            notes += [f"  {n}" for n in said]
        return notes

    def __str__(self) -> str:
        axes = "all axes" if self.axes is None else ", ".join(self.axes)
        accum = f", grad_accum={self.grad_accum}" if self.grad_accum > 1 else ""
        donated = f", donate_argnums={self.donate_argnums}" if self.donate_argnums else ""
        return f"AutomaticPartition({axes}, seed={self.seed}{accum}{donated})"


class _ExactCosts:
    """The exact costs of plans on the program, each state's once (a deep program's
    take a second): `fits`, the verdict, from its exact peak alone (`CostModel.exact_peak`:
    the step's time is not needed for it), and the whole `Cost` (what is live at the
    peak, the step's time) only where it is asked for, on the same model. `model` makes
    the cost model of a partitioning."""

    def __init__(self, model: Callable):
        self._model = model
        self._by_key: dict = {}  # state key -> {"model": CostModel, "peak": bytes, "cost": Cost}

    def _entry(self, part) -> dict:
        key = part.key()
        if key not in self._by_key:
            self._by_key[key] = {"model": self._model(part.copy())}
        return self._by_key[key]

    def fits(self, part) -> bool:
        """Does `part`'s exact peak fit the memory limit (`Cost.fits`)?"""
        entry = self._entry(part)
        if "peak" not in entry:
            entry["peak"] = entry["model"].exact_peak()
        return entry["peak"] <= entry["model"].memory_limit

    def cost(self, part):
        """`part`'s exact `Cost`, with the buffers live at its peak (for an error)."""
        entry = self._entry(part)
        if "cost" not in entry:
            entry["cost"] = entry["model"].cost(top=PEAK_BUFFERS)
        return entry["cost"]


def _unscored(stats) -> str:
    """What the search said of the role assignments it had no budget to score (none: "")."""
    scored, offered = stats.assignments
    if scored >= offered:
        return ""
    return (f"; its budget scored {scored} of {offered} assignments of roles to mesh axes: raise max_episodes "
            "or budget_s to score them all")


def _positions(value) -> tuple[int, ...]:
    """`donate_argnums` as a sorted tuple of distinct argument positions (so that equal
    settings are one identity in plan cache keys)."""
    fix = "give argument positions as a tuple, e.g. donate_argnums=(0, 1), or () for none"
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, (tuple, list)):
        raise TacticError(f"AutomaticPartition donate_argnums={value!r} is not a tuple: {fix}")
    return tuple(sorted({check.number("AutomaticPartition donate_argnums", i, integer=True, sign="non-negative",
                                      example="donate_argnums=(0, 1)", error=TacticError) for i in value}))
