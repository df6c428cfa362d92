"""ZeRO / FSDP: shard optimizer state, gradients and parameters over the data axis."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from partir import PartitioningError

from . import _checks as check
from ._base import Context, Tactic, TacticError
from ._roles import roles

#: ZeRO's stages: what is sharded over the axis (see `ZeRO`).
STAGES = (1, 2, 3)


def _pick_dim(part, v: int, axis: str, avoid=frozenset()) -> int | None:
    """The dim of input `v` to split over `axis`: one the axis divides together with the
    axes already on it, preferring dims nothing splits yet, then dims tensor
    parallelism would not want (`avoid`: (input, dim) pairs), then the largest; never,
    while another dim will do, a dim some op cannot split (the layer dim of parameters
    stacked for a scan: every iteration would gather its slice)."""
    val = part.program.values[v]
    t = part.tiling(v)
    if axis in t.axes():
        return None
    blocked = _blocked_dims(part, v)
    best = None
    for d in range(val.rank):
        k = part.mesh.devices_along((axis, *t.dims[d]))
        if val.shape[d] % k:
            continue
        key = (d not in blocked, not t.dims[d], (v, d) not in avoid, val.shape[d] // k)
        if best is None or key > best[0]:
            best = (key, d)
    return None if best is None else best[1]


def _blocked_dims(part, v: int) -> frozenset[int]:
    """Dims of input `v` that an op reading its tiling class blocks (`FactorRule.blocked`)."""
    return part.program.analysis(_blocked_inputs, part.detached).get(v, frozenset())


def _blocked_inputs(prog, detached: frozenset) -> dict[int, frozenset[int]]:
    """`_blocked_dims` of every input, for the tiling classes of `detached`: they depend on
    the program alone, and ZeRO asks for every parameter every time it applies."""
    cls = prog.classes_for(detached)
    out = {}
    for v in prog.inputs:
        dims = set()
        for u in cls.members[cls.of[v]]:
            for o in prog.value_ops[u]:
                op = prog.ops[o]
                specs = list(op.rule.operands) + list(op.rule.results)
                for k, w in enumerate(op.operands + op.results):
                    if w == u:
                        dims.update(d for d, fs in enumerate(specs[k]) if any(f in op.rule.blocked for f in fs))
        if dims:
            out[v] = frozenset(dims)
    return out


@dataclass(frozen=True)
class ZeRO(Tactic):
    """ZeRO over `axis` (which data parallelism must already split the batch over).

    stage 1: optimizer state sharded; parameters and gradients stay whole. Pattern: the
      gradient all-reduce, each device updates its shard, then an all-gather of the
      updated parameters.
    stage 2: gradients sharded too: the gradient reduction becomes a reduce-scatter,
      then the sharded update and the all-gather of the parameters.
    stage 3 (FSDP): parameters sharded too: an all-gather of each parameter before it
      is used (forward and backward), a reduce-scatter of its gradient, a local update.

    Each tensor is split on a dim that `axis` divides, preferring dims that earlier
    tactics left unsplit and (`leave_room`) dims a Megatron on another mesh axis would
    not want, so it composes with tensor parallelism before or after it.
    """

    stores: ClassVar[bool] = True  # see Tactic.stores

    axis: str
    stage: int = 3
    leave_room: bool = True  # keep dims a later Megatron on another axis would split

    def __post_init__(self):
        check.text("ZeRO axis", self.axis, example="axis='data'", error=TacticError)
        check.one_of("ZeRO stage", self.stage, STAGES, error=TacticError)
        check.one_of("ZeRO leave_room", self.leave_room, (True, False), error=TacticError)

    def apply(self, part, ctx: Context):
        prog = part.program
        r = roles(prog)
        if not any(self.axis in part.tiling(v).axes() for v in r.batch):
            raise TacticError(f"ZeRO over {self.axis!r} needs the batch split over it first: "
                              f"put DataParallel({self.axis!r}) earlier in the schedule")
        avoid = self._tensor_parallel_dims(part) if self.leave_room else frozenset()
        if self.stage < 3:
            part = self._keep_whole(part)
        sharded, skipped = [], []
        targets = r.params if self.stage == 3 else r.opt_state
        for v in targets:
            if prog.values[v].rank == 0:
                continue
            d = _pick_dim(part, v, self.axis, avoid)
            if d is None:
                if self.axis not in part.tiling(v).axes():
                    skipped.append(prog.name(v))
                continue
            mark = part.mark()
            try:
                part.tile(v, d, self.axis, source=str(self))
                sharded.append(prog.name(v))
            except PartitioningError:
                part.rollback(mark)
                skipped.append(prog.name(v))
        what = {1: "optimizer state", 2: "optimizer state and gradients", 3: "parameters, gradients and optimizer state"}
        notes = [f"stage {self.stage}: {what[self.stage]} sharded over {self.axis!r} ({len(sharded)} tensors split)"]
        if skipped:
            notes.append(f"left whole (no dim divisible by {self.axis!r}): {', '.join(skipped[:5])}"
                         + (" ..." if len(skipped) > 5 else ""))
        return part, notes

    def _tensor_parallel_dims(self, part) -> frozenset:
        """(input, dim) pairs that Megatron would split over another mesh axis: sharding
        them over this one first would leave tensor parallelism no room, so ZeRO leaves
        them to it (found by a trial Megatron on a copy, discarded)."""
        from ._megatron import Megatron

        prog = part.program
        for other in part.mesh.names:
            if other == self.axis or part.mesh.size(other) == 1:
                continue
            trial = part.copy()
            try:
                trial, _ = Megatron(other).apply(trial, Context())
            except PartitioningError:
                continue
            return frozenset((v, d) for v in prog.inputs for d, axes in enumerate(trial.tiling(v).dims)
                             if other in axes)
        return frozenset()

    def _keep_whole(self, part):
        """Detach the parameters, their updated outputs and (stage 1) their gradients from
        the update they share a tiling class with (`zero_whole`), and pin them as they
        are. Where they are detached already (a search that offers ZeRO as a macro
        starts from such a partitioning), in place."""
        keep = zero_whole(part.program, self.stage)
        if not keep <= part.detached:
            part = part.detach(keep)
        for v in sorted(keep):
            part.pin(v, axes=(self.axis,), source=str(self))
        return part


def zero_whole(prog, stage: int) -> frozenset[int]:
    """The values ZeRO of `stage` (1 or 2) keeps whole over its axis, detached from the
    update they share a tiling class with: the parameters, their updated outputs and,
    at stage 1, their gradients."""
    if stage not in (1, 2):
        raise TacticError(f"zero_whole: stage {stage!r} keeps nothing whole: give 1 or 2 (stage 3 shards "
                          "the parameters)")
    r = roles(prog)
    cls = prog.classes
    by_class: dict = {}
    for v in prog.outputs:
        if v >= 0:
            by_class.setdefault(cls.of[v], []).append(v)
    keep = set(r.params)
    for p in r.params:
        keep.update(o for o in by_class.get(cls.of[p], ()) if prog.values[o].shape == prog.values[p].shape
                    and o not in prog.input_set and _updates(prog, o, p))
    if stage == 1:
        keep.update(_gradients(prog, r))
    return frozenset(prog.resolve(v) for v in keep)


def _updates(prog, out: int, param: int) -> bool:
    """Is output `out` computed by an op that reads `param` directly (p - lr * u), up to
    dtype casts of either (bfloat16 weights stepped in float32 and cast back, as a
    mixed-precision update with master weights does)?"""
    p = prog.producer[_uncast(prog, out)]
    return p >= 0 and param in {_uncast(prog, v) for v in prog.ops[p].operands if v >= 0}


def _uncast(prog, v: int) -> int:
    """The value `v` is a dtype cast of (through casts of casts), or `v` itself."""
    while prog.producer[v] >= 0 and prog.ops[prog.producer[v]].primitive == "convert_element_type":
        v = prog.ops[prog.producer[v]].operands[0]
    return v


def _gradients(prog, r) -> set[int]:
    """The weight gradients: results of backward contractions (dots, reductions) in the
    tiling class of a parameter, or transposed into it."""
    cls = prog.classes
    param_classes = {cls.of[p] for p in r.params}
    grads = set()
    for op in prog.ops[r.forward_end:]:
        if not prog.backward[op.id] or not op.rule.reduction:
            continue
        for v in op.results:
            if v < 0:
                continue
            if cls.of[v] in param_classes:
                grads.add(v)
            else:
                for u in prog.users[v]:
                    nxt = prog.ops[u]
                    if nxt.primitive in ("transpose", "reshape") and cls.of[nxt.results[0]] in param_classes:
                        grads.add(v)
    return grads


@dataclass(frozen=True)
class FSDP(Tactic):
    """Fully sharded data parallelism over `axis`: `DataParallel(axis)` (unless the batch
    is split over it already) then `ZeRO(axis, stage=3)`.

    Textbook pattern: every device runs the whole model on its slice of the batch, with
    each parameter all-gathered before it is used and its gradient reduce-scattered.
    """

    stores: ClassVar[bool] = True  # see Tactic.stores

    axis: str
    leave_room: bool = True

    def __post_init__(self):
        check.text("FSDP axis", self.axis, example="axis='data'", error=TacticError)
        check.one_of("FSDP leave_room", self.leave_room, (True, False), error=TacticError)

    def apply(self, part, ctx: Context):
        from ._data import DataParallel

        notes = []
        if not any(self.axis in part.tiling(v).axes() for v in roles(part.program).batch):
            part, notes = DataParallel(self.axis).apply(part, ctx)
        part, more = ZeRO(self.axis, 3, self.leave_room).apply(part, ctx)
        return part, notes + more
