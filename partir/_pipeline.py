"""Pipeline parallelism in the IR: the layers of a layer scan cut into contiguous stages
over a mesh axis, the batch cut into microbatches that stream through the stages.

A `Pipelining` names a program's forward layer scan and the backward scan reading its
residuals (`partir._scans`), the stage axis, the number of microbatches and the batch
inputs they are cut from. The partitioning holds it beside the tilings
(`Partitioning.pipeline`); every stacked value of the two scans (parameters, residuals,
gradients) is split along its layer dim over the stage axis, so that each device holds
its stage's layers.

*Microbatches are a split of the batch factor over a sequential axis.* `microbatched`
builds a second partitioning of the same program on the mesh plus a `MICROBATCH` axis
of M: the plan's decisions again, then the batch inputs' leading dim split over it.
Propagation then says, for every value of the scan bodies, which dim holds the
microbatch (split), whether it is the same for every microbatch (no micro factor) or a
sum over them (a reduction over the batch: a weight gradient), exactly as it says
where a data-parallel value is split or partial. `ScanLayout` records that per body
input and output; a lowering runs the body once per microbatch on blocks of that
partitioning, and accumulates per-layer outputs as their kind says. Anything the
analysis cannot prove (a microbatch dim moved inside the body, a sum passed through a
non-linear op, an accumulated carry) is a `PartitioningError` before lowering.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ._errors import PartitioningError
from ._graph import call_roots
from ._mesh import MeshSpec
from ._nested import Link
from ._microbatch import LINEARITY, MICROBATCH, SAME, SPLIT, SUM, _strip
from ._pipeline_defer import deferred_scatters
from ._pipeline_hoist import gathered_inputs
from ._remat import recompute
from ._scans import LayerScans, ScanCall, body_regions, layer_scans, stacked_outputs
from ._onef_schedule import OnefSchedule
from ._stage_split import StageSplit
from ._tiling import Tiling

#: Schedules the lowering runs, by name: "gpipe" (all forwards, then all backwards; with
#: repeats, the circular schedule) and "1f1b" (one tick loop in which a stage runs one
#: microbatch's forward and an earlier one's backward, the head between them on the
#: last stage: `lowering/_onef`).
SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Pipelining:
    """Stages of `scans` over mesh `axis`, `microbatches` cut from the leading dim of the
    `batch` inputs (value ids), run by `schedule` (one of `SCHEDULES`). With `repeats`
    R > 1 (the circular schedule) the layers are cut into S*R chunks, chunk c running on
    stage c mod S, so that a microbatch goes round the stages R times."""

    axis: str
    microbatches: int
    scans: LayerScans
    batch: tuple[int, ...]
    schedule: str = "gpipe"
    repeats: int = 1

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise PartitioningError(f"pipeline schedule {self.schedule!r} is not known; allowed: {list(SCHEDULES)}")
        if self.microbatches < 1:
            raise PartitioningError(f"pipeline microbatches={self.microbatches}: give a positive count")
        if self.repeats < 1:
            raise PartitioningError(f"pipeline repeats={self.repeats}: give a positive count")

    def to_json(self, program) -> dict:
        """The plan file's entry: the settings, the layer scan named by its first stacked
        input, the batch inputs by name (`repeats` only when above 1, so that plan files
        of one-repeat pipelines are unchanged)."""
        first = next(v for v in self.scans.forward.xs if v >= 0)
        out = {"axis": self.axis, "microbatches": self.microbatches, "schedule": self.schedule,
               "layers": program.name(first), "batch": [program.name(v) for v in self.batch]}
        if self.repeats > 1:
            out["repeats"] = self.repeats
        return out

    @staticmethod
    def from_json(data: dict, program) -> "Pipelining":
        """The `Pipelining` a plan file's entry names in `program` (`to_json`)."""
        scans = [s for s in layer_scans(program)
                 if any(v >= 0 and program.name(v) == data["layers"] for v in s.forward.xs)]
        if not scans:
            raise PartitioningError(f"no layer scan of this program reads {data['layers']!r}")
        batch = tuple(program.resolve(name) for name in data["batch"])
        return Pipelining(data["axis"], int(data["microbatches"]), scans[0], batch, data["schedule"],
                          int(data.get("repeats", 1)))

    def chunks(self, stages: int) -> tuple[tuple[int, ...], ...]:
        """Per stage, the layer chunks it runs in order (`stage_chunks`), S the stage count."""
        return stage_chunks(stages, self.repeats)

    def ticks(self, stages: int) -> int:
        """Trips of a tick loop over `stages` stages: M*R + S - 1 per pass (GPipe, the
        circular schedule), M*R + (R+1)*S - 2 for 1F1B's one loop running both passes
        (`OnefSchedule`)."""
        if self.schedule == "1f1b":
            return self.onef(stages).ticks
        return self.microbatches * self.repeats + stages - 1

    def onef(self, stages: int) -> OnefSchedule:
        """The 1F1B tick loop's schedule over `stages` stages (interleaved: R > 1)."""
        return OnefSchedule(stages, self.repeats, self.microbatches)

    def in_flight(self, stages: int) -> int:
        """The most units (a chunk of the stage's layers on one microbatch) whose
        residuals a stage keeps between their forward and backward: all M*R under GPipe;
        under 1F1B its ring (`OnefSchedule.ring`: the first stage's 2S-1 with one
        repeat, at most M)."""
        if self.schedule == "1f1b":
            return self.onef(stages).ring
        return self.microbatches * self.repeats

    def ring_share(self, stages: int) -> float:
        """The share of all microbatches' residuals a stage keeps at once: 1 under GPipe,
        its ring's under 1F1B (`in_flight` over M*R)."""
        return self.in_flight(stages) / (self.microbatches * self.repeats)

    def split(self, stages: int) -> "StageSplit":
        """How the layers of the forward scan fall into `stages` stages (`StageSplit`)."""
        return StageSplit(self.scans.forward.length, stages, self.scans.forward.rolled, self.repeats)

    @property
    def bodies(self) -> tuple[int, ...]:
        """The body regions of the pipelined scans, forward first."""
        return tuple(c.body for c in self.scans.calls)

    def stacked(self) -> tuple[int, ...]:
        """Every stacked value of the pipelined scans (split over the stage axis)."""
        return tuple(dict.fromkeys(v for c in self.scans.calls for v in c.stacked))


@dataclass(frozen=True)
class ScanLayout:
    """How one pipelined scan's body sees microbatches: per body input the dim holding
    the microbatch (None: the same for all), per body output its kind (`SPLIT`, `SAME`,
    `SUM`) and split dim (None unless `SPLIT`)."""

    call: ScanCall
    in_dims: tuple
    out_kinds: tuple[str, ...]
    out_dims: tuple
    deferred: tuple = ()  # (value id, mesh axes): sums left partial until accumulated
    gathered: tuple = ()  # `Gathered`: stacked inputs gathered (and cast) once before the tick loop
    widened: tuple = ()  # (value id, Tiling): a deferred sum held whole along its axes
    widened_ops: tuple = ()  # (op id, mesh axes): ops run on blocks whole along the axes
    recomputed: tuple = ()  # (value id, Tiling): backward inputs held as the forward's gathered weight is

    @property
    def summed(self) -> tuple[bool, ...]:
        """Per per-layer output (the body's outputs after its carries), whether it is a sum
        over the microbatches (a weight's gradient), which a tick adds in place."""
        return tuple(k == SUM for k in self.out_kinds[len(self.call.carry):])

    def left_partial(self, v: int) -> tuple[str, ...]:
        """The mesh axes value `v` is left partial over (completed once the microbatches
        are summed, not once per microbatch)."""
        return dict(self.deferred).get(v, ())


def microbatched(part, pipe: Pipelining):
    """`part`'s plan on its mesh plus the `MICROBATCH` axis, the batch cut along it, and
    the `ScanLayout` of each pipelined scan (checked: see the module docstring)."""
    from ._partitioning import Partitioning

    if MICROBATCH in part.mesh.names:
        raise PartitioningError(f"mesh axis {MICROBATCH!r} is reserved for pipeline microbatches: rename it")
    if pipe.repeats > 1:
        _check_circular(part, pipe)
    elif pipe.split(part.mesh.size(pipe.axis)).exchanged:
        _check_uneven(part, pipe)
    mesh = MeshSpec(part.mesh.axes + ((MICROBATCH, pipe.microbatches),))
    ext = Partitioning(part.program, mesh, detached=part.detached)
    for d in part.decisions:
        ext.redo(d)
    for v in pipe.batch:
        ext.tile(v, 0, MICROBATCH, source="pipeline")
    gone = _recomputed_stacks(part, pipe)
    layouts = tuple(_scan_layout(part, ext, pipe, c, gone) for c in pipe.scans.calls)
    return ext, _held_gathered(part, pipe, layouts, gone)


def _held_gathered(part, pipe: Pipelining, layouts: tuple, gone: set) -> tuple:
    """`layouts` with the backward scan's stacked inputs that are the end of a weight's
    chain the forward gathers (`Gathered.value`: a bfloat16 cast of a weight, a norm
    scale's broadcast) held gathered as that value is (`ScanLayout.recomputed`), so the
    backward ticks read them without a move: the slices of recomputed residuals (stacked
    as `gone`), which the recomputation remakes from the gathered weight, and under 1F1B
    every such residual, which the backward reads from the forward's gathered block
    rather than from the ring (`onef_gathered`; GPipe's backward gathers it once
    before its loop)."""
    onef = pipe.schedule == "1f1b"
    if len(layouts) < 2 or not (gone or onef):
        return layouts
    prog, (fwd, bwd) = part.program, layouts[:2]
    held = {g.value: g.layout for g in fwd.gathered}
    made = dict(zip(fwd.call.ys, prog.regions[fwd.call.body].outvars[len(fwd.call.carry):]))
    body = prog.regions[bwd.call.body]
    first = len(bwd.call.consts) + len(bwd.call.carry)
    pairs = tuple((v, held[made[outer]]) for v, outer in zip(body.invars[first:], bwd.call.xs)
                  if v >= 0 and (outer in gone or onef) and made.get(outer) in held)
    if not pairs:
        return layouts
    return (fwd, dataclasses.replace(bwd, recomputed=pairs)) + layouts[2:]


def onef_gathered(program, pipe: Pipelining, layouts: tuple) -> frozenset:
    """Under 1F1B, the forward scan's stacked outputs (residuals) the backward ticks
    read from the forward's gathered block of a weight, not from the ring
    (`_held_gathered`): none under GPipe."""
    if pipe.schedule != "1f1b" or len(layouts) < 2:
        return frozenset()
    bwd = layouts[1]
    held = dict(bwd.recomputed)
    body = program.regions[bwd.call.body]
    ins = body.invars[len(bwd.call.consts) + len(bwd.call.carry):]
    return frozenset(outer for w, outer in zip(ins, bwd.call.xs) if w in held and outer in pipe.scans.forward.ys)


def _check_circular(part, pipe: Pipelining) -> None:
    """The circular schedule's conditions: a microbatch back at the first stage no later
    than it is needed there; with chunks of unequal lengths (S*R not dividing the
    layers) or layers rolled from unrolled ones, those of their exchange
    (`_check_uneven`)."""
    stages = part.mesh.size(pipe.axis)
    if pipe.microbatches < stages:
        raise PartitioningError(f"the circular schedule (repeats={pipe.repeats}) needs at least as many microbatches "
                                f"as stages ({stages}); {pipe.microbatches} microbatches would reach the first stage "
                                f"again before it is free: give microbatches >= {stages}, or repeats=1")
    if pipe.split(stages).exchanged:
        _check_uneven(part, pipe)


def _check_uneven(part, pipe: Pipelining) -> None:
    """Uneven stages' conditions (`StageSplit`): no more stages than layers, and every
    stacked value's layer dim whole (an array cannot be
    split unevenly), the stage axis splitting at most one other dim, as its minor axis
    (`state_dim`: the stage program exchanges the stage's layers from there)."""
    stages, length = part.mesh.size(pipe.axis), pipe.scans.forward.length
    if stages > length:
        raise PartitioningError(f"{stages} stages over {pipe.axis!r} are more than the {length} layers of the layer "
                                "scan: some stage would run no layer; pick an axis of at most as many devices")
    if stages * pipe.repeats > length:
        raise PartitioningError(f"{stages} stages x {pipe.repeats} repeats make more chunks than the {length} layers "
                                "of the layer scan: some chunk would run no layer; pick repeats of at most "
                                f"{length // stages}")
    for v in pipe.stacked():
        t = part.tiling(v)
        if t.dims[0] or state_dim(t, pipe.axis) == -1:
            raise PartitioningError(f"{part.program.name(v)} is laid out {t}, from which uneven stages ({length} "
                                    f"layers over {stages}) cannot exchange their layers: leave its layer dim whole "
                                    f"and {pipe.axis!r} the minor axis of the one dim it splits, or pick a stage "
                                    "count dividing the layers")


def state_dim(t: Tiling, axis: str) -> int | None:
    """The dim of a stacked value of uneven stages (layout `t`) that the stage `axis`
    splits at rest, None when it is whole along it, -1 when no exchange can take the
    stage's layers from it (`axis` on the layer dim, or not the minor axis of its dim)."""
    dims = [d for d, axes in enumerate(t.dims) if axis in axes]
    if not dims:
        return None
    return dims[0] if dims[0] > 0 and t.dims[dims[0]][-1] == axis else -1


def kept_in_slots(part, pipe: Pipelining) -> frozenset:
    """The values the stages keep between the two scans as they run them rather than as
    they are at rest: under the circular schedule in slot order (the chunks they run,
    `lowering/_circular`) rather than in contiguous layers, so that neither scan
    exchanges them; with uneven stages (`StageSplit`) as each stage's padded block of
    its layers rather than whole along the stage axis, so that no stage holds another's.
    These are the forward scan's stacked outputs that nothing but the backward scan
    reads (across call boundaries), split over the stage axis on their layer dim
    wherever they are (circular) or whole along it (uneven). Every value id of each
    such residual; empty with contiguous even stages or no backward scan."""
    back = pipe.scans.backward
    stages = part.mesh.size(pipe.axis)
    uneven = pipe.split(stages).exchanged
    if (pipe.repeats == 1 and not uneven) or back is None:
        return frozenset()
    prog, roots = part.program, call_roots(part.program)
    links = (Link.CALL_IN, Link.CALL_OUT)
    read = {v for v in back.xs if v >= 0}
    members: dict[int, list[int]] = {}
    for v in range(len(prog.values)):
        members.setdefault(roots[v], []).append(v)
    out = set()
    for y in (v for v in pipe.scans.forward.ys if v >= 0):
        group = members[roots[y]]
        readers = [prog.ops[o] for v in group for o in prog.users[v]]
        if (read & set(group) and not set(group) & set(prog.outputs)
                and all(op.link and op.primitive in links or op.id == _xs_link(prog, back, op) for op in readers)
                and all(_held_by_stage(part.tiling(v), pipe.axis, uneven) for v in group)):
            out.update(group)
    return frozenset(out)


def _held_by_stage(t: Tiling, axis: str, uneven: bool) -> bool:
    """Is a residual of tiling `t` what `kept_in_slots` keeps: split along its layer dim
    over the stage `axis` alone (circular), or not split over it at all (uneven)?"""
    return not t.dims[0] and axis not in t.axes() if uneven else t.dims[0] == (axis,)


def _xs_link(prog, call: ScanCall, op) -> int:
    """`op`'s id if it is a link handing scan `call`'s body a stacked input, else -1."""
    hands = op.link and op.primitive == Link.SCAN_XS and prog.values[op.results[0]].region == call.body
    return op.id if hands else -1


def _micro_dim(t: Tiling, what: str):
    dims = [d for d, axes in enumerate(t.dims) if MICROBATCH in axes]
    if not dims:
        return None
    if len(dims) > 1 or t.dims[dims[0]][-1] != MICROBATCH:
        raise PartitioningError(f"{what}: microbatches are not contiguous blocks of one dim in layout {t}; "
                                "pipeline a program whose batch stays the leading split of one dim")
    return dims[0]


def _scan_layout(part, ext, pipe: Pipelining, call: ScanCall, gone: set) -> ScanLayout:
    """`call`'s `ScanLayout` (`gone`: the stacks of recomputed residuals, `_recomputed_stacks`)."""
    prog = part.program
    inside = set(body_regions(prog, call.body))
    _check_body(part, ext, pipe, inside)
    body = prog.regions[call.body]
    in_dims = tuple(_micro_dim(ext.tiling(v), f"scan input {prog.name(v)}") for v in body.invars)
    kinds = {v: SPLIT if d is not None else SAME for v, d in zip(body.invars, in_dims)}
    ops = [op for op in prog.ops if op.region in inside]
    for op in ops:
        _kind_results(prog, ext, op, kinds)
    out_kinds = tuple(kinds.get(v, SAME) if v >= 0 else SAME for v in body.outvars)
    out_dims = tuple(_micro_dim(ext.tiling(v), f"scan output {prog.name(v)}") if v >= 0 else None
                     for v in body.outvars)
    nk = len(call.carry)
    for v, k in zip(body.outvars[:nk], out_kinds[:nk]):
        if k == SUM:
            raise PartitioningError(f"the layer scan's carry {prog.name(v)} is summed over the batch: a pipeline "
                                    "passes each microbatch's carry on, so this scan cannot be pipelined")
    # (Not where a relaxed user checkpoint reads forward values in the backward ticks:
    # they keep moving per microbatch there. The circular schedule exchanges the
    # stage's blocks for its chunks at rest, before the gathers and after the
    # reduce-scatters; exchanged rows, uneven or rolled, arrive in its order before
    # them. The residuals 1F1B keeps in its ring, and those the layers recompute, a
    # scalar per layer, are no stacked weights.)
    ring = (set(pipe.scans.forward.ys) if pipe.schedule == "1f1b" else set()) | gone
    plain = bool(part.reused)
    gathered = gathered_inputs(ext, call, in_dims, ring, plain)
    scatters = None if plain else deferred_scatters(ext, ops, kinds)
    deferred, widened, wide_ops = scatters or (_deferred(ext, ops, kinds), (), ())
    return ScanLayout(call, in_dims, out_kinds, out_dims, deferred, gathered, widened, wide_ops)


def _recomputed_stacks(part, pipe: Pipelining) -> set:
    """The forward scan's stacked outputs that stand for residuals the plan recomputes
    (`Partitioning.rematerialized`): the forward loop stacks a placeholder, a scalar per
    layer, in their place, and the backward ticks remake them from the layer inputs."""
    if not part.rematerialized:
        return set()
    prog = part.program
    rec = recompute(prog, part.rematerialized, part.saved)
    body = pipe.scans.forward.body
    stacked = stacked_outputs(prog)
    return {stacked[r] for r in rec.sources if prog.values[r].region == body and r in stacked}


def _deferred(ext, ops, kinds: dict) -> tuple:
    """Sums over microbatches left partial over the mesh axes their reduction sums over,
    so that one reduction completes the accumulated sum instead of one per microbatch
    (weight gradients all-reduced once per step, as without a pipeline). Only where it
    is plainly right: the reduction is an all-reduce to the value's layout at rest, and
    every op after it is linear in it with no value split over those axes and adds only
    sums left partial alike; otherwise none is deferred."""
    left: dict[int, frozenset] = {}
    for op in ops:
        for v in op.results:
            if v < 0 or kinds.get(v) != SUM:
                continue
            ins = [left.get(u, frozenset()) for u in op.operands if u >= 0 and kinds.get(u) == SUM]
            made = ext.produced(v)
            if op.link:
                axes = ins[0] if ins else frozenset()
            elif MICROBATCH in made.partial:
                axes = frozenset(made.partial) - {MICROBATCH}
                if _strip(made).dims != _strip(ext.tiling(v)).dims:
                    return ()
            else:
                if len(set(ins)) > 1:
                    return ()
                axes = ins[0]
                slots = ext.op_layout(op.id)[0]
                if any(axes & {a for d in dims for a in d} for _, _, _, dims in slots):
                    return ()
            if axes & set(ext.tiling(v).axes()):
                return ()
            if axes:
                left[v] = axes
    return tuple((v, tuple(a for a in ext.mesh.names if a in axes)) for v, axes in left.items())


def _kind_results(prog, ext, op, kinds: dict) -> None:
    """The kind of each result of `op` (ops in program order, operands known first)."""
    outs = [v for v in op.results if v >= 0]
    ins = [kinds.get(v, SAME) for v in op.operands if v >= 0]
    if op.link:
        for v in outs:
            kinds.setdefault(v, ins[0] if ins else SAME)
        return
    for v in outs:
        if _micro_dim(ext.tiling(v), f"value {prog.name(v)}") is not None:
            kinds[v] = SPLIT
        elif MICROBATCH in ext.produced(v).partial:
            if ext.produced(v).reduce_kind != "sum":
                raise PartitioningError(f"{prog.name(v)} is a {ext.produced(v).reduce_kind} over the batch: "
                                        "only sums accumulate over microbatches")
            kinds[v] = SUM
        elif all(k == SAME for k in ins):
            kinds[v] = SAME
        elif _linear_sum(op.primitive, ins):
            kinds[v] = SUM
        else:
            raise PartitioningError(f"{prog.name(v)} ({op.primitive}) mixes values of different microbatches "
                                    f"({', '.join(ins)}) in a way a pipeline cannot accumulate")


def _linear_sum(primitive: str, ins: list[str]) -> bool:
    """Is a `primitive` of operands of kinds `ins` a sum over microbatches?"""
    how = LINEARITY.get(primitive)
    if SPLIT in ins or how is None:
        return False
    if how == "unary":
        return len(ins) == 1
    if how == "additive":
        return all(k == SUM for k in ins)
    if how == "numerator":
        return ins[0] == SUM and ins.count(SUM) == 1
    return ins.count(SUM) == 1


def _check_body(part, ext, pipe: Pipelining, inside: set) -> None:
    """Inside the pipelined body the plan is `part`'s (the microbatch axis aside), never
    uses the stage axis, and never moves a value along the microbatch axis."""
    prog = part.program
    _check_values(part, ext, pipe, {v for v, val in enumerate(prog.values) if val.region in inside},
                  [o.id for o in prog.ops if o.region in inside])


def _check_values(part, ext, pipe: Pipelining, values, ops, check_stage: bool = True) -> None:
    """`_check_body` for `values` and the ops `ops` (`check_stage`: refuse a value split
    over the stage axis, which a stage's layers cannot be)."""
    prog = part.program
    for v in sorted(values):
        if _strip(ext.tiling(v)) != part.tiling(v):
            raise PartitioningError(f"cutting microbatches changes the layout of {prog.name(v)} "
                                    f"({part.tiling(v)} -> {ext.tiling(v)}); the pipeline cannot run this plan")
        if check_stage and pipe.axis in part.tiling(v).axes():
            raise PartitioningError(f"{prog.name(v)} inside the pipelined layers is split over the stage axis "
                                    f"{pipe.axis!r}; use another axis for it")
    for r in ext.reshards(ops):
        src = tuple(MICROBATCH in d for d in r.src.dims)
        if src != tuple(MICROBATCH in d for d in r.dst.dims):
            raise PartitioningError(f"the plan moves {prog.name(r.value)} across microbatches ({r.src} -> {r.dst}) "
                                    "inside the pipelined layers; the pipeline cannot run it")


def stage_chunks(stages: int, repeats: int = 1) -> tuple[tuple[int, ...], ...]:
    """Per stage, the layer chunks it runs in order: chunk c (layers [c*L/(S*R),
    (c+1)*L/(S*R)) of the forward scan) runs on stage c mod S, so with R = 1 stage s
    holds chunk s alone (GPipe's contiguous stages)."""
    return tuple(tuple(k * stages + s for k in range(repeats)) for s in range(stages))


def made_at(pipe, split, body: Tiling, rest: Tiling, kept, r: int, partial=()) -> Tiling:
    """The layout a pipelined scan's stacked output (`body`: its layout in the body; `rest`:
    the result's at rest) has once the stage program made it, before it moves to `rest`:
    split along the layer dim over the stage axis (even stages), or, uneven, whole along
    it (a residual the stages keep as their blocks, `kept`, or a value put back whole)
    or split along the dim `rest` splits over it."""
    if not split.exchanged:
        return Tiling(((pipe.axis,),) + body.dims, partial, "sum")
    dim = None if r in kept else state_dim(rest, pipe.axis)
    dims = ((),) + body.dims
    if dim is not None:
        dims = dims[:dim] + (dims[dim] + (pipe.axis,),) + dims[dim + 1:]
    return Tiling(dims, partial, "sum")
