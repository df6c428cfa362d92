"""The search's action space: `tile(group, dim, axis)` on groups of program inputs.

Inputs that play the same role in structurally identical layers form one group
(`tactics.input_groups`), decided by one action, so the search scales with the number
of distinct layer kinds, not of layers. Optimizer state is not offered: it shares its
parameter's tiling class, so it follows the parameter (sharding it apart is what the
`FSDP`/`ZeRO` macro actions do).
"""

from __future__ import annotations

from dataclasses import dataclass

from partir import PartitioningError, check_pipelines
from tactics import Group, input_groups  # noqa: F401  (re-exported for the search API)


#: The kinds of search action.
KINDS = ("tile", "macro", "stop")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of the search, of a `kind`: `tile` (split every input of group `group`
    on `dim` over mesh `axis`), `macro` (apply a whole `tactic`) or `stop`. Build them
    with `Action.tile`, `Action.macro` and `Action.stop` (or `STOP`)."""

    kind: str
    group: int | None = None
    dim: int | None = None
    axis: str | None = None
    tactic: object = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Action kind {self.kind!r} is not one of {', '.join(KINDS)}")

    @classmethod
    def tile(cls, group: int, dim: int, axis: str) -> Action:
        """Split every member of input group `group` on `dim` over `axis`."""
        return cls("tile", group, dim, axis)

    @classmethod
    def macro(cls, tactic) -> Action:
        """Apply `tactic` (e.g. `Megatron("model")`) as one action."""
        return cls("macro", tactic=tactic)

    @classmethod
    def stop(cls) -> Action:
        """Stop here: the plan is what has been applied so far."""
        return cls("stop")

    def describe(self, groups) -> str:
        """Readable form, e.g. `tile params['layers'][*]['mlp']['w1'] dim 1 over model`."""
        if self.kind == "macro":
            return str(self.tactic)
        if self.kind == "stop":
            return "stop"
        return f"tile {groups[self.group].label} dim {self.dim} over {self.axis}"


STOP = Action.stop()


def valid_actions(part, groups, axes) -> list[Action]:
    """The tile actions that would change the state: the group's first member does not
    use the axis yet, the dim stays divisible, the axis is not pinned away, and some op
    can compute along the dim split (not the layer dim of a scan's stacked parameters,
    which every iteration would gather)."""
    prog = part.program
    sizes = part.mesh.sizes()
    blocked = prog.analysis(_blocked_inputs)
    out = []
    for gi, g in enumerate(groups):
        v = g.members[0]
        val = prog.values[v]
        t = part.tiling(v)
        used = t.axes()
        for axis in axes:
            if axis in used or sizes[axis] == 1:
                continue
            for d in range(val.rank):
                if d in blocked.get(v, ()) and val.rank > 1:
                    continue
                if val.shape[d] % part.mesh.devices_along((axis, *t.dims[d])) == 0:
                    out.append(Action.tile(gi, d, axis))
    return out


def _blocked_inputs(program) -> dict:
    """Per input, the dims a link into a loop body blocks (a scan's stacked layer dim)."""
    out: dict[int, set] = {}
    for v in program.inputs:
        for o in program.users[v]:
            op = program.ops[o]
            if op.link and op.rule.blocked:
                out.setdefault(v, set()).update(
                    d for d, fs in enumerate(op.rule.operands[0]) if any(f in op.rule.blocked for f in fs))
    return out


def apply_action(part, groups, action: Action, source: str, ctx, notes: list | None = None) -> bool:
    """Apply `action` to `part` (every member of its group); False, and nothing changed,
    if it cannot apply. A macro's tactic applies with `ctx` (the schedule's context, or
    a twin's), and its notes are appended to `notes` when given."""
    if action.kind == "stop":
        raise ValueError("the stop action does not apply to a partitioning")
    mark, ctx_mark = part.mark(), ctx.mark()
    try:
        if action.kind == "macro":
            after, said = action.tactic.apply(part, ctx)
            if after is not part:
                raise TypeError(f"{action.tactic} returned a new partitioning (it detaches values): "
                                "only tactics that act in place can be search macros")
            if part.mark() == mark:
                ctx.rollback(ctx_mark)
                return False
            check_pipelines(part)  # a later action may leave a pipeline no whole microbatches
            if notes is not None:
                notes.extend(said)
            return True
        done = False
        for v in groups[action.group].members:
            if action.axis in part.tiling(v).dims[action.dim]:
                continue
            try:
                part.tile(v, action.dim, action.axis, source=source)
                done = True
            except PartitioningError:
                if not done:
                    raise
        check_pipelines(part)
        return done
    except PartitioningError:
        part.rollback(mark)
        ctx.rollback(ctx_mark)
        return False
