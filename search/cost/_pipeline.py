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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import partir
from partir import Kind, Tiling

from ._comm import CollectiveCost, LinkModel
from ._device import DEFAULT_DEVICE, get_device, link_levels


@dataclass(frozen=True)
class PipelineCost:
    """A pipeline's terms (see the module docstring): the stage count, microbatches and
    schedule; the bubble fraction; the tick loop's trips per pass; the collectives it
    adds (a permute's `count` is its trips per step); the bytes one microbatch's carries
    take across one stage boundary per pass (`p2p_bytes`); per device, the stage's
    stacked inputs (`stage_bytes`) and the residuals in flight between the passes."""

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

    @property
    def p2p_time(self) -> float:
        """Seconds of point-to-point sends per step (not overlapped: a tick sends what it
        made, and the next tick reads it)."""
        return sum(c.time * c.count for c in self.collectives if c.kind == Kind.COLLECTIVE_PERMUTE)


def _block_bytes(prog, v: int, t: Tiling, mesh, shape=None) -> float:
    val = prog.values[v]
    shape = val.shape if shape is None else shape
    return float(math.prod(t.shard_shape(tuple(shape), mesh))) * np.dtype(val.dtype).itemsize


def pipeline_cost(part, pipe, device=DEFAULT_DEVICE, *, links: dict[str, str] | None = None) -> PipelineCost:
    """The terms of pipelining `pipe` (a `partir.Pipelining` of `part`) on `device`."""
    prog, mesh = part.program, part.mesh
    dev = get_device(device)
    link = LinkModel(mesh, dev, link_levels(mesh.axes, dev, links))
    stages, m = mesh.size(pipe.axis), pipe.microbatches
    ticks = m + stages - 1
    ext, layouts = partir.microbatched(part, pipe)
    cols, p2p = [], []
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
            whole = _block_bytes(prog, out, part.tiling(out), mesh)
            cols.append(CollectiveCost(Kind.ALL_REDUCE, axes, whole, link.time(Kind.ALL_REDUCE, axes, whole),
                                       prog.producer[w], out))
    stage = sum(_block_bytes(prog, v, part.tiling(v), mesh) for v in prog.inputs
                if prog.values[v].rank and part.tiling(v).dims[0][:1] == (pipe.axis,))
    kept = sum(_block_bytes(prog, v, part.tiling(v), mesh) for v in pipe.scans.forward.ys if v >= 0)
    return PipelineCost(pipe.axis, stages, m, pipe.schedule, (stages - 1) / ticks, ticks, tuple(cols), tuple(p2p),
                        stage, kept)
