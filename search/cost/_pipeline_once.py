"""What a pipelined stage moves once a step instead of once per microbatch, layer and
tick, and the buffers that live across its tick loop for it: its weights gathered
before the loop (`partir.ScanLayout.gathered`, `partir/_pipeline_hoist.py`) and its
weight gradients accumulated whole along the axes of their reduce-scatter and
reduce-scattered after it (`partir.ScanLayout.widened`, `partir/_pipeline_defer.py`),
and what the head between the layer scans sums over the microbatches (`head_sums`)."""

from __future__ import annotations

import math

import partir
from partir import Kind, Tiling

from ._comm import CollectiveCost
from ._tick_buffers import body_span


def loops_span(prog, layouts) -> tuple[int, int]:
    """The first and last op of the bodies of a pipeline's scans `layouts` (its forward
    and backward layers): what the stage moves once a step lives across all its tick
    loops. XLA gathers every weight the loops read, and zeroes every gradient
    accumulator, before the first loop (all of them operands of the loop, or of the
    first: loop-invariant), and frees them after the last, as the compiled programs'
    buffer assignments show (a 1F1B tick loop runs the forward and the backward layers
    in every tick: the weights the forward layers read live through the backward
    ticks too). `PipelinePricing.spans` holds it per pipeline."""
    spans = [body_span(prog, lay.call.body) for lay in layouts]
    return min(a for a, _ in spans), max(b for _, b in spans)


def _span_of(pricing, pipe) -> tuple[int, int]:
    return next(span for (p, *_), span in zip(pricing.costs, pricing.spans) if p is pipe)


def read_gathered(pricing, lay, pipe, split) -> None:
    """Record in `pricing` (`PipelinePricing`) the weights pipelined scan `lay` gathers
    before its loop: `gathered` (the value its layers read -> (that layout, `lay`,
    `pipe`)), and the casts before the gather priced once a step on all the stage's
    layers (`scale`; `split`: the pipeline's `StageSplit`). A weight handed into a call
    inside the layers (the user's `jax.checkpoint`: `Gathered.via`) is recorded as the
    value its readers in the callee read; the links on the way move nothing."""
    pricing.gathered.update((g.value, (g.layout, lay, pipe)) for g in lay.gathered)
    for o in (o for g in lay.gathered for o in g.ops):
        pricing.scale[o] = split.slots / split.length


def hoisted(pricing, model) -> list:
    """(op, value, collectives, (last op, buffer bytes)) of each weight a pipelined
    stage gathers before its tick loop (`pricing`: the model's `PipelinePricing`): the
    gather of its stage's block, all its layers (ceil(L/S) slots), from its layout at
    rest to the one its layers read, charged once a step at the first op reading it; the
    gathered block live from there to the body's last op (the loop runs the body in
    every tick) and, as every buffer the stage keeps for its loops, across all of them
    (`loops_span`). A weight gather is overlappable as any FSDP gather is
    (`overlappable`)."""
    prog, mesh = pricing.part.program, pricing.part.mesh
    out = []
    for v, (need, lay, pipe) in pricing.gathered.items():
        start, last = _span_of(pricing, pipe)
        first = min(min(prog.users[v]), start)
        stages = mesh.size(pipe.axis)
        layers = pipe.split(stages).slots * stages  # the stacked block's rows over all stages
        src = Tiling(((pipe.axis,),) + pricing.part.tiling(v).dims)
        dst = Tiling(((pipe.axis,),) + need.dims)
        full = float(model._nbytes[v]) * layers
        cols = tuple(CollectiveCost(kind, axes, nbytes, t, first, v, 1.0, False)
                     for kind, axes, nbytes, t in pricing.links.reshard(src, dst, full, mesh))
        out.append((first, v, cols, (last, full / mesh.devices_along(a for d in dst.dims for a in d))))
    return out


def scattered(pricing, model) -> list:
    """(op, value, collectives, (last op, buffer bytes)) of each weight gradient a
    pipelined stage accumulates whole along the axes of its reduce-scatter
    (`partir.ScanLayout.widened`): the stage's block of all its layers,
    partial over those axes, reduce-scattered to the layout at rest once a step after
    the loop (a gradient's reduction, overlappable as any), the accumulator live across
    the stage's loops (`loops_span`). Charged at their first op, where the accumulator
    starts."""
    prog, part, mesh = pricing.part.program, pricing.part, pricing.part.mesh
    out = []
    for (pipe, _, layouts, _), (first, last) in zip(pricing.costs, pricing.spans):
        for lay in layouts:
            held = dict(lay.widened)
            for v, r in zip(prog.regions[lay.call.body].outvars[len(lay.call.carry):], lay.call.ys):
                if v not in held or r < 0:
                    continue
                src = Tiling(((pipe.axis,),) + held[v].dims, lay.left_partial(v), "sum")
                # (Uneven stages reduce-scatter the stage's ceil(L/S) rows to the body's
                # layout, then exchange them as any stacked output: `_uneven_exchanges`.)
                split = pipe.split(mesh.size(pipe.axis))
                # (Likewise the circular schedule's chunks, exchanged back at rest.)
                back = split.exchanged or pipe.repeats > 1
                dst = Tiling(((pipe.axis,),) + part.tiling(v).dims) if back else part.tiling(r)
                full = float(model._nbytes[v]) * (split.slots * split.stages if split.exchanged else lay.call.length)
                item = float(model._nbytes[v]) / max(1, math.prod(prog.values[v].shape))
                cols = tuple(CollectiveCost(kind, axes, nbytes, t, first, v, 1.0, True,
                                            nbytes / item if kind == Kind.ALL_REDUCE else 0.0)
                             for kind, axes, nbytes, t in pricing.links.reshard(src, dst, full, mesh))
                out.append((first, v, cols, (last, full / mesh.devices_along(a for d in src.dims for a in d))))
    return out


def head_sums(prog, pipe, head, mesh) -> list:
    """(value, mesh axes) of each all-reduce completing what the head between the layer
    scans makes once the microbatches are summed: its deferred sums, over the axes left
    (GPipe); under 1F1B every output the step reads after the backward scan, which the
    last stage alone makes, over those axes and the stage axis."""
    if head is None:
        return []
    if pipe.schedule != "1f1b":
        return [(v, axes) for v, axes in head.deferred if v in head.outputs]
    return [(v, tuple(a for a in mesh.names if a in head.left_partial(v) or a == pipe.axis))
            for v in partir.onef_outputs(prog, pipe, head)]
