"""What a pipeline (`partir.Pipelining`) adds to a step, as the shard_map lowering runs it
(`partir/lowering/_shardmap_pipeline.py`, docs/pipeline.md).

Per pass (the forward scan, then the backward one), the stage program is one loop of
M + S - 1 ticks; each tick sends every carry of one microbatch to the next stage (one
collective-permute over the stage axis per carry, in the loop), and after the loop the
last stage's final carries reach every stage (one all-reduce over the stage axis per
carry). The bubble is the share of ticks a stage has no microbatch: (S-1)/(M+S-1).
Each device keeps its stage's share of the stacked values (parameters, gradients,
optimizer state: `stage_bytes`) and, under GPipe, the residuals of all M microbatches
of its layers from the forward pass to the backward (`in_flight_bytes`).

With R repeats (the circular schedule) the loop has M*R + S - 1 ticks of one chunk of
L/(S*R) layers, so the bubble is (S-1)/(M*R+S-1), and the stacked values are exchanged
over the stage axis in and out of the stage program (one all-to-all each: `_exchanges`).

With uneven stages (S not dividing L, `partir.StageSplit`) every stage runs ceil(L/S)
layer slots a tick, so a tick lasts as long as the busiest stage's; the layers' state is
split over the stage axis along another dim (`stage_bytes`: 1/S of it), each stage's
residuals are its slots' (`in_flight_bytes`), and the stage's layers of each stacked
value are exchanged in and out over the stage axis (`_uneven_exchanges`).

The seconds of one tick of each pass that `CostModel` prices (`TickTimes`) are what
`_timeline` draws the schedule from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import partir
from partir import Kind, Tiling

from ._comm import CollectiveCost, LinkModel
from ._device import DEFAULT_DEVICE, get_device, link_levels
from ._pipeline_once import head_sums, hoisted, loops_span, read_gathered, scattered
from ._remat import stacked_for_it
from ._tick_buffers import TickBuffers
from ._timeline import TickTimes


@dataclass(frozen=True)
class PipelineCost:
    """A pipeline's terms (see the module docstring): the stage count, microbatches and
    schedule; the bubble fraction; the tick loop's trips per pass; the collectives it
    adds (a permute's `count` is its trips per step); the bytes one microbatch's carries
    take across one stage boundary per pass (`p2p_bytes`); per device, the stage's
    stacked inputs (`stage_bytes`) and the residuals in flight between the passes; the
    circular schedule's `repeats` (1: GPipe)."""

    axis: str
    stages: int
    microbatches: int
    schedule: str
    bubble: float
    ticks: int
    collectives: tuple[CollectiveCost, ...]
    p2p_bytes: tuple[float, ...]
    stage_bytes: float
    in_flight_bytes: float
    repeats: int = 1

    @property
    def p2p_time(self) -> float:
        """Seconds of point-to-point sends per step (not overlapped: a tick sends what it
        made, and the next tick reads it)."""
        return sum(c.time * c.count for c in self.collectives if c.kind == Kind.COLLECTIVE_PERMUTE)


def _block_bytes(prog, v: int, t: Tiling, mesh, shape=None) -> float:
    val = prog.values[v]
    shape = val.shape if shape is None else shape
    return float(math.prod(t.shard_shape(tuple(shape), mesh))) * np.dtype(val.dtype).itemsize


def bubble(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of a pass's ticks a stage has no microbatch: (S-1)/(M*R+S-1) (GPipe
    with R = 1, the circular schedule with R repeats)."""
    return (stages - 1) / (microbatches * repeats + stages - 1)


def pipeline_cost(part, pipe, device=DEFAULT_DEVICE, *, links: dict[str, str] | None = None) -> PipelineCost:
    """The terms of pipelining `pipe` (a `partir.Pipelining` of `part`) on `device`."""
    prog, mesh = part.program, part.mesh
    dev = get_device(device)
    link = LinkModel(mesh, dev, link_levels(mesh.axes, dev, links))
    stages, m = mesh.size(pipe.axis), pipe.microbatches
    ticks = pipe.ticks(stages)
    ext, layouts = partir.microbatched(part, pipe)
    cols, p2p = list(_exchanges(part, pipe, link)), []
    for layout in layouts:
        call = layout.call
        body = prog.regions[call.body]
        nk = len(call.carry)
        carries = body.invars[len(call.consts):len(call.consts) + nk]
        sent = [_block_bytes(prog, w, ext.tiling(w), ext.mesh) for w in carries]
        p2p.append(sum(sent))
        axes = (pipe.axis,)
        # Each is charged at the link op carrying the carry into the body.
        for w, out, nbytes in zip(carries, body.outvars[:nk], sent):
            cols.append(CollectiveCost(Kind.COLLECTIVE_PERMUTE, axes, nbytes,
                                       link.time(Kind.COLLECTIVE_PERMUTE, axes, nbytes), prog.producer[w], w,
                                       float(ticks)))
            if pipe.schedule == "1f1b" and call is pipe.scans.forward:
                continue  # (its final carry feeds the head on the last stage, not every stage)
            whole = _block_bytes(prog, out, part.tiling(out), mesh)
            cols.append(CollectiveCost(Kind.ALL_REDUCE, axes, whole, link.time(Kind.ALL_REDUCE, axes, whole),
                                       prog.producer[w], out))
    split = pipe.split(stages)
    cols += _uneven_exchanges(part, pipe, link) if split.exchanged else []
    stage = sum(_block_bytes(prog, v, part.tiling(v), mesh) for v in _layer_state(part, pipe))
    gone, extra = _recomputing(part, pipe)
    # The residuals of the stage's layers (its ceil(L/S) slots' of the L layers when
    # uneven: held whole along the stage axis by the plan, kept as the stage's blocks by
    # the lowering).
    # (Under 1F1B not those the backward reads from the forward's gathered block of a weight.)
    held = split.slots / split.length if split.exchanged else 1.0
    shared = partir.onef_gathered(prog, pipe, layouts)
    kept = held * sum(_block_bytes(prog, v, part.tiling(v), mesh) for v in pipe.scans.forward.ys
                      if v >= 0 and v not in gone and v not in shared)
    # The layer inputs stacked for recomputing: the stage's slots' (ceil(L/S), a padding
    # slot keeping its carry), of every microbatch.
    layers = (split.slots * stages,)
    kept += sum(_block_bytes(prog, s, Tiling(((pipe.axis,),) + part.tiling(s).dims), mesh,
                             layers + tuple(prog.values[s].shape)) for s in extra)
    kept *= pipe.ring_share(stages)  # (1F1B: a ring of the units in flight)
    return PipelineCost(pipe.axis, stages, m, pipe.schedule, bubble(stages, m, pipe.repeats), ticks, tuple(cols),
                        tuple(p2p),
                        stage, kept, pipe.repeats)


def _layer_state(part, pipe) -> list:
    """The program's inputs that hold the layers' state (parameters, optimizer state):
    split along their layer dim over the stage axis, or, with uneven stages (whole along
    it), in a tiling class of the pipeline's stacked values."""
    prog = part.program
    if not pipe.split(part.mesh.size(pipe.axis)).exchanged:
        return [v for v in prog.inputs if prog.values[v].rank and part.tiling(v).dims[0][:1] == (pipe.axis,)]
    cls = prog.classes_for(part.detached)
    stacked = {cls.of[v] for v in pipe.stacked()}
    return [v for v in prog.inputs if prog.values[v].rank and cls.of[v] in stacked]


def _uneven_exchanges(part, pipe, link: LinkModel) -> list:
    """Uneven stages' collectives over the stage axis (`lowering/_uneven`), but for the
    residuals the stages keep as their blocks (`partir.kept_in_slots`): per stacked
    input split over the axis at rest (`partir.state_dim`), one all-to-all of its S *
    ceil(L/S) layer rows (once for both scans: XLA computes the identical exchanges
    once); per stacked output, one all-to-all of as many rows in the layout the body
    makes it, split over the axis as its result is at rest, or, where that result is
    whole along the axis, one all-reduce of all L layers."""
    prog, mesh, kept, axes = part.program, part.mesh, partir.kept_in_slots(part, pipe), (pipe.axis,)
    split = pipe.split(mesh.size(pipe.axis))
    rows, roots, seen, out = split.slots * split.stages, partir.call_roots(prog), set(), []
    for call in pipe.scans.calls:
        body = prog.regions[call.body]
        for outer in call.xs:
            t = part.tiling(outer) if outer >= 0 else None
            if t is None or outer in kept or partir.state_dim(t, pipe.axis) is None or (roots[outer], t) in seen:
                continue
            seen.add((roots[outer], t))
            nbytes = _block_bytes(prog, outer, t, mesh, (rows,) + tuple(prog.values[outer].shape[1:]))
            out.append(CollectiveCost(Kind.ALL_TO_ALL, axes, nbytes, link.time(Kind.ALL_TO_ALL, axes, nbytes),
                                      prog.producer[outer], outer))
        for outer, inner in zip(call.ys, body.outvars[len(call.carry_out):]):
            if outer < 0 or outer in kept or inner < 0:
                continue
            t = partir.made_at(pipe, split, part.tiling(inner), part.tiling(outer), kept, outer)
            whole = partir.state_dim(part.tiling(outer), pipe.axis) is None
            kind = Kind.ALL_REDUCE if whole else Kind.ALL_TO_ALL
            nbytes = _block_bytes(prog, inner, t, mesh, (split.length if whole else rows,) + tuple(prog.values[inner].shape))
            out.append(CollectiveCost(kind, axes, nbytes, link.time(kind, axes, nbytes), prog.producer[inner], inner))
    return out


def _exchanges(part, pipe, link: LinkModel) -> list:
    """The circular schedule's all-to-alls over the stage axis (`lowering/_circular`):
    one per stacked input of each scan, in the layout its body reads, and one per
    stacked output, but none for the residuals kept in slot order
    (`partir.kept_in_slots`). Each sends the stage's block padded to S*ceil(R/S)
    chunks. A stacked input both scans read alike is exchanged once: XLA computes the
    two identical exchanges of the same value once."""
    stages, repeats = part.mesh.size(pipe.axis), pipe.repeats
    if repeats == 1 or pipe.split(stages).exchanged:  # (exchanged rows come in slot order)
        return []
    prog, slots = part.program, partir.kept_in_slots(part, pipe)
    roots, pad = partir.call_roots(prog), stages * -(-repeats // stages) / repeats
    seen, out = set(), []
    for call in pipe.scans.calls:
        body = prog.regions[call.body]
        ins = body.invars[len(call.consts) + len(call.carry):]
        outs = body.outvars[len(call.carry_out):]
        for outer, inner in [*zip(call.xs, ins), *zip(call.ys, outs)]:
            if outer < 0 or outer in slots:
                continue
            t = Tiling(((pipe.axis,),) + part.tiling(inner).dims)
            nbytes = pad * _block_bytes(prog, inner, t, part.mesh, (call.length,) + tuple(prog.values[inner].shape))
            key = (roots[outer], t, outer in call.xs)
            if key in seen:
                continue
            seen.add(key)
            out.append(CollectiveCost(Kind.ALL_TO_ALL, (pipe.axis,), nbytes,
                                      link.time(Kind.ALL_TO_ALL, (pipe.axis,), nbytes), prog.producer[inner], inner))
    return out


def _recomputing(part, pipe) -> tuple[set, list]:
    """(the stacks of the forward layers' residuals the plan recomputes, which the
    forward loop no longer keeps; the layer inputs it stacks instead for recomputing
    them: its carries in, `_remat`)."""
    prog = part.program
    body = pipe.scans.forward.body
    rec = partir.recompute(prog, part.rematerialized, part.saved) if part.rematerialized else None
    if rec is None:
        return set(), []
    stacked = partir.stacked_outputs(prog)
    mine = [r for r in rec.sources if prog.values[r].region == body]
    extra = {s: None for r in mine for s in rec.sources[r] if s not in stacked and stacked_for_it(prog, s)}
    return {stacked[r] for r in mine if r in stacked}, list(extra)


class PipelinePricing:
    """How `CostModel` prices the ops of pipelined layers (`part.pipelines`): on the
    microbatched partitioning (`partir.microbatched`), as the shard_map lowering runs
    them. An op's work is divided over the microbatch axis too (a microbatch's share),
    and it runs (L/(S·R))·(M·R+S-1) times a step instead of L (`scale`: its stage's
    chunk in every tick, bubble included; R = 1 but for the circular schedule; ceil(L/S)
    slots with uneven stages); its moves are the plan's on a microbatch's blocks, the
    microbatch axis left out (a sum over it is the accumulation), less the reductions
    left for after the loop; the stacked values are read where their stage holds them
    (no gather along the layer dim). The pipeline's own collectives are `pipeline_cost`'s
    plus, per deferred sum, one reduction after the loop."""

    def __init__(self, part, links: LinkModel, device):
        self.part, self.links = part, links
        self.costs, self.scale, self.layouts, self.stacked = [], {}, {}, {}
        self.spans: list[tuple[int, int]] = []  # per pipeline, its tick loops' first and last op: `loops_span`
        self.heads: list = []  # per pipeline, its `partir.HeadLayout` (None: the head runs on the whole batch)
        # 1F1B's forward body region -> the share of the microbatches its stage keeps at once (its ring).
        self.ring: dict[int, float] = {}
        # A pipelined scan's body region -> the layers a stage holds (ceil(L/S) slots).
        self.slots: dict[int, int] = {}
        self.uneven: dict[int, float] = {}  # a stacked input of uneven stages -> slots / L
        self.gathered: dict[int, tuple] = {}  # a weight gathered before its tick loop: `read_gathered`
        self.remade: set[int] = set()  # recomputed from a weight gathered so (`ScanLayout.recomputed`)
        prog = part.program
        for pipe in part.pipelines:
            ext, layouts = partir.microbatched(part, pipe)
            stages, m = part.mesh.size(pipe.axis), pipe.microbatches
            split = pipe.split(stages)
            for lay in layouts:
                self.slots[lay.call.body] = split.slots
                inside = set(partir.body_regions(prog, lay.call.body))
                for op in prog.ops:
                    if op.region in inside:
                        self.scale[op.id] = split.slots * (m * pipe.repeats + stages - 1) / (
                            pipe.repeats * split.length)
                        self.layouts[op.id] = (ext, lay, pipe)
                read_gathered(self, lay, pipe, split)
                self.remade.update(v for v, _ in lay.recomputed)
                if split.exchanged:  # a stage moves its slots' rows of what it reads, all L of what it makes
                    self.uneven.update((v, split.slots / split.length) for v in lay.call.xs if v >= 0)
            if pipe.schedule == "1f1b":
                self.ring[pipe.scans.forward.body] = pipe.ring_share(stages)
            head = partir.head_layout(part, ext, pipe)
            for o in head.looped_ops if head is not None else ():  # the head's ops, once per microbatch
                self.scale[o] = float(m)
                self.layouts[o] = (ext, head, pipe)
            self.heads.append(head)
            self.stacked.update((v, pipe.axis) for v in pipe.stacked())
            for v in pipe.stacked():  # the links reading and making the stacked values, once a step
                for o in prog.value_ops[v]:
                    if prog.ops[o].link:
                        self.scale[o] = 1.0
                        self.layouts[o] = (part, None, pipe)
            self.costs.append((pipe, ext, layouts, pipeline_cost(part, pipe, device)))
            self.spans.append(loops_span(prog, layouts))
        # The tick loops' own buffers, for the memory model.
        self.ticks = TickBuffers(part, [(p, ext, lay, *_recomputing(part, p)) for p, ext, lay, _ in self.costs])

    def value_div(self, n: int):
        """Per value of the program, how many microbatches its block is cut into at once:
        M for a value of a pipelined layer or of the head between the scans split along
        the microbatch axis, M over the microbatches in flight for 1F1B's residuals
        between the scans (its ring), L/ceil(L/S) for uneven stages' residuals between
        the scans (held whole along the stage axis by the plan, kept as each stage's
        slots by the lowering: `partir.kept_in_slots`), else 1; over the devices of the
        axes a deferred sum is held whole along (`ScanLayout.widened`: a weight's
        gradient the stage reduce-scatters once, after its loops), less: the plan splits
        it over them, the tick loop does not."""
        out = np.ones(n)
        prog = self.part.program
        for (pipe, ext, layouts, _), head in zip(self.costs, self.heads):
            inside = {r for lay in layouts for r in partir.body_regions(prog, lay.call.body)}
            mine = {v for v, val in enumerate(prog.values) if val.region in inside}
            if head is not None:  # (what leaves the head is kept for the whole batch)
                mine |= {v for o in head.looped_ops for v in prog.ops[o].results if v >= 0} - set(head.outputs)
            for v in mine:
                if partir.MICROBATCH in ext.tiling(v).axes():
                    out[v] = pipe.microbatches
            if pipe.schedule == "1f1b":  # the residuals between the scans: the ring's microbatches
                ys = [v for v in pipe.scans.forward.ys if v >= 0 and partir.MICROBATCH in ext.tiling(v).axes()]
                out[ys] = 1.0 / pipe.ring_share(self.part.mesh.size(pipe.axis))
            split = pipe.split(self.part.mesh.size(pipe.axis))
            if split.exchanged:
                out[sorted(partir.kept_in_slots(self.part, pipe))] *= split.length / split.slots
            for lay in layouts:  # a deferred sum: whole along the axes its reduction left for after the loop
                for v, held in lay.widened:
                    out[v] /= self.part.mesh.devices_along(
                        a for a in ext.tiling(v).axes() if a != partir.MICROBATCH and a not in held.axes())
        return out

    def stacks(self, entries, value_div) -> list:
        """`entries`, buffers `(start, end, value, scale)` (`_remat.extra_buffers`), with
        each stack a pipelined layer's loop makes of one of its values (`scale`: the
        loop's trips) sized as a stage holds it: its L/S layers' blocks, of every
        microbatch (`value_div`: the microbatches a value's block is cut into at once),
        or under 1F1B of the forward layers, of the microbatches in flight (`ring`)."""
        prog, out = self.part.program, []
        for start, end, v, scale in entries:
            region = prog.values[v].region
            slots = self.slots.get(region)
            if slots is not None and scale == prog.regions[region].trip_count:
                scale = float(value_div[v]) * slots * self.ring.get(region, 1.0)
            out.append((start, end, v, scale))
        return out

    @property
    def ops(self) -> frozenset:
        """The ops inside pipelined layers."""
        return frozenset(self.scale)

    def price(self, model, o: int):
        """`CostModel._price` of op `o` inside pipelined layers (see the class docstring)."""
        ext, lay, pipe = self.layouts[o]
        prog, mesh, real = self.part.program, ext.mesh, self.part.mesh
        # A stacked value's link moves the stage's block, whole along the layers it holds.
        micro = (partir.MICROBATCH,) if lay is not None else (pipe.axis,)
        layout = ext.op_layout(o)
        div = mesh.devices_along(a for axes in ext.factor_tiling(o) for a in axes)
        moved = model._moved(layout[0], lambda dims: mesh.devices_along(a for d in dims for a in d))
        slot_of = {(side, k): i for i, (side, k, _, _) in enumerate(layout[0])}
        out = []
        for r in ext.layout_reshards(o, layout):
            if r.value in model._free and not r.src.partial or r.side == "operand" and (
                    r.value in self.gathered or r.value in self.remade):
                continue  # (a weight the stage gathered before its loop, or remade from one: `hoisted`)
            off = micro + ((self.stacked[r.value],) if r.value in self.stacked else ())
            off += lay.left_partial(r.value) if r.side == "result" and lay is not None else ()
            src, dst = r.src.without_axes(off, partial=True), r.dst.without_axes(off, partial=True)
            if src == dst:
                continue
            val = prog.values[r.value]
            full = float(model._nbytes[r.value]) * self.uneven[r.value] if r.value in self.uneven else float(
                model._nbytes[r.value]) / mesh.devices_along(a for d in ext.tiling(r.value).dims for a in d if a in micro)
            item = float(model._nbytes[r.value]) / max(1, math.prod(val.shape))
            grad = bool(src.partial) and model._backward[o] and not model._feeds_backward[r.value]
            cols = tuple(CollectiveCost(kind, axes, nbytes, t, o, r.value, float(model._mult[o]), bool(grad),
                                        nbytes / item if kind == Kind.ALL_REDUCE else 0.0)
                         for kind, axes, nbytes, t in self.links.reshard(src, dst, full, real))
            shards = real.devices_along
            buf = full / shards(a for d in dst.dims for a in d) if r.side == "operand" else max(
                0.0, full / shards(a for d in src.dims for a in d) - full / shards(a for d in dst.dims for a in d))
            # The move is keyed on the mesh's own axes: the microbatch axis is none.
            key = r.dst.without_axes((partir.MICROBATCH,)).dims if r.side == "operand" else None
            out.append((slot_of[(r.side, r.index)], r.side, r.index, key, cols, buf))
        return div, moved, tuple(out), 1.0

    def tick_times(self, model, times) -> tuple[TickTimes, ...]:
        """Per pipeline, the seconds of one tick of each pass (`TickTimes`), from `model`'s
        seconds per op per step `times`: each pipelined scan's ops and their moves over
        its M + S - 1 ticks, plus one send of its carries."""
        firsts = [(min(e), e[min(e)][1]) for key, e in model._timed_moves() if key[0] != "pipeline"]
        view = model._view()
        again = set(view.ops.tolist()) if view is not None else set()
        again_cols = model._recomputed(times)[1] if view is not None else []
        out = []
        for _, _, layouts, cost in self.costs:
            # The ops run (M*R + S - 1)/(S*R) times a step per pass: one tick of each (1F1B:
            # a tick with both units lasts a forward's and a backward's).
            passes, per = cost.microbatches * cost.repeats + cost.stages - 1, []
            for lay in layouts:
                ops = {o for o, (_, at, _) in self.layouts.items() if at is lay}
                comm = sum(c.time * c.count for o, cols in firsts if o in ops for c in cols)
                carries = set(self.part.program.regions[lay.call.body].invars)
                send = sum(c.time for c in cost.collectives
                           if c.kind == Kind.COLLECTIVE_PERMUTE and c.value in carries)
                per.append((float(times[sorted(ops)].sum()) + comm) / passes + send)
            if len(per) > 1:  # the forward ops recomputed run in the backward ticks
                redo = again & {o for o, (_, at, _) in self.layouts.items() if at is layouts[0]}
                per[1] += (float(times[sorted(redo)].sum())
                           + sum(c.time * c.count for o, c, _ in again_cols if o in redo)) / passes
            out.append(TickTimes(per[0], per[1] if len(per) > 1 else 0.0))
        return tuple(out)

    def collectives(self, model) -> list:
        """(op, value, collectives) the pipelines add: `pipeline_cost`'s, the deferred sums'
        reductions after the loop, what `_pipeline_once` moves once a step (with its buffer)."""
        prog, out = self.part.program, []
        for (pipe, *_), head in zip(self.costs, self.heads):
            for v, axes in head_sums(prog, pipe, head, self.part.mesh):
                nbytes = _block_bytes(prog, v, self.part.tiling(v), self.part.mesh)
                out.append((prog.producer[v], v, (CollectiveCost(
                    Kind.ALL_REDUCE, axes, nbytes, self.links.time(Kind.ALL_REDUCE, axes, nbytes),
                    prog.producer[v], v, 1.0, bool(model._backward[prog.producer[v]])),)))
        out += hoisted(self, model) + scattered(self, model)
        for pipe, ext, layouts, cost in self.costs:
            out += [(c.op, c.value, (c,)) for c in cost.collectives]
            kept = partir.kept_in_slots(self.part, pipe)
            for lay in layouts:
                body = prog.regions[lay.call.body]
                split = pipe.split(self.part.mesh.size(pipe.axis))
                for v, r in zip(body.outvars[len(lay.call.carry):], lay.call.ys):
                    axes = lay.left_partial(v) if v >= 0 else ()
                    if not axes or v in dict(lay.widened):  # (those reduce-scattered: `scattered`)
                        continue
                    t = partir.made_at(pipe, split, self.part.tiling(v), self.part.tiling(r), kept, r)
                    nbytes = _block_bytes(prog, v, t, self.part.mesh, (lay.call.length,) + tuple(prog.values[v].shape))
                    out.append((prog.producer[v], v, (CollectiveCost(
                        Kind.ALL_REDUCE, axes, nbytes, self.links.time(Kind.ALL_REDUCE, axes, nbytes),
                        prog.producer[v], v, 1.0, True),)))
        return out
