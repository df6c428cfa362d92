"""What a stage's weights gathered once before its tick loop cost
(`partir.ScanLayout.gathered`, `partir/_pipeline_hoist.py`): one gather a pass of the
stage's layers of each such weight, instead of one per microbatch, layer and tick, and
its buffer, live across the loop."""

from __future__ import annotations

import partir
from partir import Tiling

from ._comm import CollectiveCost


def hoisted(pricing, model) -> list:
    """(op, value, collectives, (last op, buffer bytes)) of each weight a pipelined
    stage gathers before its tick loop (`pricing`: the model's `PipelinePricing`): the
    gather of its stage's block, all its layers (ceil(L/S) slots), from its layout at
    rest to the one its layers read, charged once a step at the first op reading it; the
    gathered block live from there to the body's last op (the loop runs the body in
    every tick). A weight gather is overlappable as any FSDP gather is (`overlappable`)."""
    prog, mesh = pricing.part.program, pricing.part.mesh
    out = []
    for v, (need, lay, pipe) in pricing.gathered.items():
        inside = set(partir.body_regions(prog, lay.call.body))
        last = max(op.id for op in prog.ops if op.region in inside)
        first = min(prog.users[v])
        stages = mesh.size(pipe.axis)
        layers = pipe.split(stages).slots * stages  # the stacked block's rows over all stages
        src = Tiling(((pipe.axis,),) + pricing.part.tiling(v).dims)
        dst = Tiling(((pipe.axis,),) + need.dims)
        full = float(model._nbytes[v]) * layers
        cols = tuple(CollectiveCost(kind, axes, nbytes, t, first, v, 1.0, False)
                     for kind, axes, nbytes, t in pricing.links.reshard(src, dst, full, mesh))
        out.append((first, v, cols, (last, full / mesh.devices_along(a for d in dst.dims for a in d))))
    return out
