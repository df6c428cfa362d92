"""Schedules: lists of tactics applied in order, each propagated before the next.

`apply_schedule(program, mesh, [DataParallel("data"), Megatron("model")])` returns a
`Partitioned`: the final partitioning and its history, one `Step` per tactic with a
snapshot of the partitioning after it, the decisions it took and what it recognised.
Earlier tactics win conflicts, because their decisions are already in place when the
later ones propagate (PartIR's schedule semantics). A tactic that cannot apply raises
a `TacticError` naming why, and changes nothing; with `best_effort=True` it is recorded
as skipped instead.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar
from dataclasses import dataclass, field

from jax.sharding import PartitionSpec

import partir
from partir import Decision, MeshSpec, Partitioning, PartitioningError, Program


class TacticError(PartitioningError):
    """A tactic that cannot apply to this program and partitioning."""


@dataclass
class Context:
    """What tactics learn and leave for later ones in the same schedule: the Megatron
    blocks found per axis (for sequence parallelism), the parameters Megatron left whole
    per axis (with why), and the search results, in schedule order. All only grow, so
    `mark()`/`rollback()` undo what was added since a point (a search backing out of a
    state, a tactic that failed)."""

    blocks: dict = field(default_factory=dict)
    left_out: dict = field(default_factory=dict)
    search: list = field(default_factory=list)

    def mark(self) -> tuple:
        """A point to `rollback` to."""
        return _lengths(self.blocks), _lengths(self.left_out), len(self.search)

    def rollback(self, mark: tuple) -> None:
        """Forget what was added since `mark`."""
        blocks, left_out, searches = mark
        _truncate(self.blocks, blocks)
        _truncate(self.left_out, left_out)
        del self.search[searches:]

    def key(self) -> int:
        """A hash of what tactics read from the context (the blocks and the parameters
        left whole, per axis): a search that memoizes what an action does keys it by the
        partitioning's key and this."""
        return hash(tuple((a, tuple(found)) for per_axis in (self.blocks, self.left_out)
                          for a, found in per_axis.items() if found))

    def added_since(self, mark: tuple) -> tuple:
        """What was added since `mark`, for `extend` on a context at the same point."""
        (blocks, left_out, searches), out = mark, []
        for per_axis, lengths in ((self.blocks, blocks), (self.left_out, left_out)):
            kept = dict(lengths)
            out.append(tuple((a, tuple(found[kept.get(a, 0):])) for a, found in per_axis.items()
                             if len(found) > kept.get(a, 0)))
        return tuple(out) + (tuple(self.search[searches:]),)

    def extend(self, added: tuple) -> None:
        """Add what `added_since` found, again."""
        blocks, left_out, searches = added
        for per_axis, items in ((self.blocks, blocks), (self.left_out, left_out)):
            for a, found in items:
                per_axis.setdefault(a, []).extend(found)
        self.search.extend(searches)

    def copy(self) -> "Context":
        """An independent copy (for a partitioning copied at the same point)."""
        return Context({a: list(b) for a, b in self.blocks.items()}, {a: list(b) for a, b in self.left_out.items()},
                       list(self.search))

    def child(self) -> "Context":
        """An empty context for tactics applied to another program derived from this
        one's (a shallow twin): what this one holds names this program's values."""
        return Context()


def _lengths(per_axis: dict) -> tuple:
    return tuple((axis, len(found)) for axis, found in per_axis.items())


def _truncate(per_axis: dict, lengths: tuple) -> None:
    kept = dict(lengths)
    for axis in [a for a in per_axis if a not in kept]:
        del per_axis[axis]
    for axis, n in kept.items():
        del per_axis[axis][n:]


def _identify(value, where: str):
    """`value` as plain JSON data (see `Tactic.identity`)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Tactic):
        return value.identity()
    if isinstance(value, PartitionSpec):
        return {"PartitionSpec": [_identify(p, where) for p in value]}
    if isinstance(value, (tuple, list)):
        return [_identify(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _identify(v, f"{where}[{k!r}]") for k, v in value.items()}
    if callable(getattr(value, "to_dict", None)):  # e.g. a search.DeviceSpec
        return {type(value).__name__: _identify(value.to_dict(), where)}
    raise TacticError(f"{where} is a {type(value).__name__} ({value!r}), which a tactic's identity cannot hold: "
                      "use None, numbers, strings, tuples, dicts with string keys, PartitionSpecs, tactics "
                      "or objects with a to_dict() method")


class Tactic:
    """Base class: a tactic rewrites a partitioning through `tile`/`replicate`/`pin`
    actions. `apply` returns the partitioning to continue with (it may be a new one,
    e.g. after `Partitioning.detach`) and notes for the history.

    `identity()` says which tactic it is (plan cache keys); `str()` is for people."""

    #: The tactic shards what is stored (parameters, gradients, optimizer state) for
    #: memory, not how ops compute: ZeRO and FSDP. See `applied_order`.
    stores: ClassVar[bool] = False
    #: The tactic chooses which dims of weights the ops compute split (Megatron, sequence
    #: and expert parallelism), so it needs those dims free of other axes.
    splits_weights: ClassVar[bool] = False

    def axes_named(self) -> tuple[str, ...]:
        """The mesh axes the tactic's settings name (`axis`, `axes`)."""
        out = []
        for name in ("axis", "axes"):
            value = getattr(self, name, None)
            out += [value] if isinstance(value, str) else [a for a in value or () if isinstance(a, str)]
        return tuple(out)

    def apply(self, part: Partitioning, ctx: Context) -> tuple[Partitioning, list[str]]:
        """Apply to `part`; raise `TacticError` if it cannot."""
        raise NotImplementedError

    def identity(self) -> dict:
        """What makes this tactic the one it is, as JSON data: the class name and every
        dataclass field that takes part in comparison (settings such as a progress
        callback do not). Equal tactics have equal identities; serialise it with
        `json.dumps(..., sort_keys=True)` for a canonical key."""
        if not dataclasses.is_dataclass(self):
            raise TacticError(f"{type(self).__name__} is not a dataclass: override Tactic.identity()")
        name = type(self).__name__
        return {"tactic": name, "fields": {f.name: _identify(getattr(self, f.name), f"{name}.{f.name}")
                                           for f in dataclasses.fields(self) if f.compare}}

    def __str__(self) -> str:
        # Required fields by position; others only where they differ from the default.
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                parts.append(repr(value))
            elif f.repr and value != f.default:
                parts.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(parts)})"


@dataclass(frozen=True)
class Step:
    """One tactic's effect: the partitioning after it (a snapshot), the decisions it
    took, what it recognised (`notes`), or why it was skipped."""

    tactic: Tactic
    partitioning: Partitioning
    decisions: tuple[Decision, ...]
    notes: tuple[str, ...]
    skipped: str | None = None


@dataclass(frozen=True)
class Partitioned:
    """The result of a schedule: the final partitioning, the history of steps, and the
    context the tactics shared (e.g. `context.search` holds search results)."""

    program: Program
    partitioning: Partitioning
    history: tuple[Step, ...]
    context: Context = field(default_factory=Context)

    @property
    def mesh(self) -> MeshSpec:
        """The mesh the program is partitioned over."""
        return self.partitioning.mesh

    def lower(self, mesh=None, **options):
        """Lower the final partitioning (see `partir.lower`)."""
        return partir.lower(self.partitioning, mesh, **options)

    def describe(self, decisions: bool = True) -> str:
        """One block per step: the tactic, its notes and (optionally) its decisions."""
        lines = []
        for i, s in enumerate(self.history):
            head = f"{i + 1}. {s.tactic}" + (f"  [skipped: {s.skipped}]" if s.skipped else "")
            lines.append(head)
            lines += [f"     {n}" for n in s.notes]
            prog = self.program
            for d in s.decisions if decisions else ():
                what = f"tile dim {d.dim} over {d.axis}" if d.action == "tile" else d.action
                lines.append(f"     - {prog.name(d.value)}: {what}")
        return "\n".join(lines)


def applied_order(schedule) -> list[tuple[Tactic, str | None]]:
    """The schedule in the order it is applied, each tactic with a note when it moved.

    A tactic that shards storage (`stores`: ZeRO, FSDP) written before one that splits
    weights for compute on another axis (`splits_weights`: Megatron, ...) is applied
    after it: tilings grow in decision order, so the storage split taken first would
    hold the dims the compute split needs (an FSDP-split bias `[d_ff]` leaves Megatron no
    way to split the MLP over another axis). Practitioners write FSDP+TP in both orders,
    and both then give the one plan. Tactics on the same axis keep their order (there the
    two truly compete for the axis)."""
    out = [(t, None) for t in schedule]
    i = 0
    while i < len(out):
        t, _ = out[i]
        later = [j for j in range(i + 1, len(out)) if out[j][0].splits_weights
                 and not set(out[j][0].axes_named()) & set(t.axes_named())]
        if t.stores and later:
            last = later[-1]
            note = f"applied after {out[last][0]}, as if written after it: the dims it splits stay free for it"
            out.insert(last + 1, (t, note))
            del out[i]
            continue
        i += 1
    return out


def apply_schedule(program: Program, mesh: MeshSpec, schedule, *, best_effort: bool = False,
                   start: Partitioning | None = None) -> Partitioned:
    """Apply `schedule` (tactics, in `applied_order`) to a fresh partitioning of
    `program` on `mesh` (or to a copy of `start`). Raises the first `TacticError` unless
    `best_effort`."""
    part = start.copy() if start is not None else Partitioning(program, mesh)
    for t in schedule:
        if not isinstance(t, Tactic):
            raise TacticError(f"schedule entries must be tactics (Shard, DataParallel, Megatron, ...), got {t!r}")
    ctx = Context()
    history = []
    for tactic, moved in applied_order(schedule):
        before = len(part.decisions)
        mark, ctx_mark = part.mark(), ctx.mark()
        try:
            new, notes = tactic.apply(part, ctx)
            partir.check_pipelines(new)  # a tactic after a Pipeline may leave it no whole microbatches
        except PartitioningError as e:
            part.rollback(mark)
            ctx.rollback(ctx_mark)
            if not best_effort:
                raise TacticError(f"{tactic}: {e}") from e
            history.append(Step(tactic, part.copy(), (), (), skipped=str(e)))
            continue
        part = new
        # The step's decisions are those its `apply` added (a detached partitioning
        # replays the earlier ones first, one for one), whichever tactic it delegated to.
        notes = [moved, *notes] if moved else notes
        history.append(Step(tactic, part.copy(), tuple(part.decisions[before:]), tuple(notes)))
    return Partitioned(program, part, tuple(history), ctx)
