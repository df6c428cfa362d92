"""Pipeline parallelism as a tactic."""

from __future__ import annotations

from dataclasses import dataclass

import partir

from . import _checks as check
from ._base import Context, Tactic, TacticError
from ._data import batch_inputs

@dataclass(frozen=True)
class Pipeline(Tactic):
    """Run the layers of a layer scan (`jax.lax.scan` over stacked layers) as contiguous
    stages over mesh `axis`: with S devices along it, device s holds layers
    [s*L/S, (s+1)*L/S) (their parameters, gradients and optimizer state: every stacked
    value of the scan is split along its layer dim over `axis`). When S does not divide
    L the stages are uneven (`partir.StageSplit`): each runs ceil(L/S) layer slots, the
    last stages one layer fewer (a padding slot that passes its input on), and the
    stacked values keep their [L, ...] layout (an array cannot be split unevenly): the
    layers' parameters, gradients and optimizer state are split over `axis` along
    another dim at rest (one that `axis` divides; whole along it where none does), and
    each step exchanges the stage's layers in and their gradients out. The batch is cut into
    `microbatches` that stream through the stages (`schedule` "gpipe": all forwards,
    then all backwards); activations go forward and their gradients back between
    neighbouring stages, and the gradients are summed over microbatches, so the step
    computes what the unpipelined one does. What is outside the layer stack (embedding,
    head, loss) runs as the rest of the plan places it, whole along `axis`; the head and
    loss between the forward and backward layers run one microbatch at a time (the loss
    must be a sum or mean over the batch's examples). With `Remat`
    (before or after), each stage recomputes in the backward pass what the policy does
    not keep, per microbatch.

    With `repeats` R > 1 (the circular schedule) the layers are cut into S*R chunks and
    stage s runs chunks s, s+S, ..., s+(R-1)*S: a microbatch goes round the stages R
    times, and the bubble falls from (S-1)/(M+S-1) to (S-1)/(M*R+S-1). The stacked
    values stay in contiguous blocks at rest; each step exchanges the stage's
    parameters and gradients for its chunks over `axis` (docs/pipeline.md). Where S*R
    does not divide the layers (or they were rolled from unrolled ones) the chunks are
    padded to ceil(L/(S*R)) slots, the last ones one layer fewer, and the state is held
    as uneven stages hold it, exchanged straight into the chunks' order. Needs
    `microbatches` >= S and at most as many chunks as layers (Remat runs in the chunks,
    a padding slot keeping its carry only).

    With `schedule` "1f1b" the forward layers, the head and the backward layers run as
    one tick loop: a stage runs one microbatch's forward and an earlier one's backward
    each tick, so it keeps the residuals of at most 2S-1 microbatches instead of all
    of them, at GPipe's bubble (docs/pipeline.md); with `Remat`, of what the policy
    keeps (and the layer inputs it recomputes from). Needs a train step differentiated
    where it scans the layers. With `repeats` R > 1 it is interleaved
    1F1B (Megatron's virtual stages): stage s runs chunks s, s+S, ... as the circular
    schedule does, a tick runs one chunk's forward and one chunk's backward, the bubble
    is the circular schedule's, and a stage keeps fewer residuals than with one repeat
    ((R+1)S-1 chunks' residuals, S + (S-1)/R microbatches' of the stage's layers, in place
    of 2S-1: `partir.OnefSchedule`).
    Needs microbatches a multiple of S and at most as many chunks as layers.
    """

    axis: str
    microbatches: int = 1
    schedule: str = "gpipe"
    repeats: int = 1
    batch_argnums: tuple[int, ...] | int | None = None

    def __post_init__(self):
        check.text("Pipeline axis", self.axis, example="axis='stage'", error=TacticError)
        check.number("Pipeline microbatches", self.microbatches, integer=True, example="microbatches=4",
                     error=TacticError)
        check.number("Pipeline repeats", self.repeats, integer=True, example="repeats=2", error=TacticError)
        check.one_of("Pipeline schedule", self.schedule, partir.PIPELINE_SCHEDULES, error=TacticError)

    def apply(self, part, ctx: Context):
        prog = part.program
        stages = part.mesh.size(self.axis)
        if part.reused:
            raise TacticError("a Remat policy relaxes the user's jax.checkpoint here, which pipelined layers do not "
                              "do yet: pick a Remat policy that keeps no more than the user's, or leave Remat out")
        scans = partir.layer_scans(prog)
        if not scans:
            raise TacticError("found no layer scan to pipeline (a jax.lax.scan over stacked layers' parameters): "
                              "write the layers as a scan, lift the step with partir.roll_layers(partir.lift(...)) "
                              "to roll unrolled layers into one, or leave Pipeline out")
        scan = scans[0]
        length = scan.forward.length
        split = partir.StageSplit(length, stages, scan.forward.rolled, self.repeats)
        found, _ = batch_inputs(part, self.batch_argnums)
        for v in found:
            blocks = part.mesh.devices_along(part.tiling(v).dims[0]) * self.microbatches
            if prog.values[v].shape[0] % blocks:
                raise TacticError(f"{self.microbatches} microbatches of the {part.tiling(v).dims[0] or 'whole'} "
                                  f"blocks of {prog.name(v)} (batch {prog.values[v].shape[0]}) are not whole: "
                                  "pick microbatches that divide each device's batch")
        pipe = partir.Pipelining(self.axis, self.microbatches, scan, tuple(found), self.schedule, self.repeats)
        mark = part.mark()
        try:
            if split.exchanged:
                _split_state(part, pipe, str(self))
            else:
                for v in pipe.stacked():
                    part.tile(v, 0, self.axis, source=str(self))
            part.pipeline(pipe)
            partir.check_pipeline(part, pipe)  # what the lowering will run: refused now if it cannot
        except partir.PartitioningError as e:
            part.rollback(mark)
            raise TacticError(f"cannot pipeline the layer scan over {self.axis!r}: {e}") from e
        per, units = split.slots, self.microbatches * self.repeats
        kind = "interleaved" if self.schedule == "1f1b" else "circular"
        chunks = f" in {self.repeats} chunks of {split.chunk} ({kind})" if self.repeats > 1 else ""
        if split.uneven:  # (the last chunks run one layer fewer: with one repeat, the last stages)
            which = "chunks " if self.repeats > 1 else ""
            chunks += f" (the last {split.chunks - split.fuller} {which}of {split.chunk - 1}; uneven)"
        return part, [f"{length} layers in {stages} stages of {per}{chunks} over {self.axis!r}, "
                      f"{self.microbatches} microbatches, schedule {self.schedule}; modeled bubble "
                      f"{(stages - 1) / (units + stages - 1):.0%}"]


def _split_state(part, pipe, source: str) -> None:
    """Uneven stages' layer state at rest: each stacked input of the forward scan split
    over the stage axis along a dim other than its layer dim (`_state_dim`; propagation
    carries the split to its gradients and optimizer state), but not into the layers,
    whose values are kept whole along the stage axis (pinned at the scans' links)."""
    prog = part.program
    for call in pipe.scans.calls:
        body = prog.regions[call.body]
        inner = body.invars[len(call.consts) + len(call.carry):] + body.outvars[len(call.carry_out):]
        for w in (w for w in inner if w >= 0):
            part.pin(w, axes=(pipe.axis,), source=source)
    for v in dict.fromkeys(v for v in pipe.scans.forward.xs if v >= 0):
        d = _state_dim(part, v, pipe.axis)
        if d is None:
            continue
        try:
            part.tile(v, d, pipe.axis, source=source)
        except partir.PartitioningError:
            pass  # (changing nothing) the stage's layers then come from the value whole along the axis


def _state_dim(part, v: int, axis: str):
    """The dim of stacked value `v` to split over `axis` at rest: not the layer dim, one
    `axis` divides with the axes already on it, preferring dims nothing splits yet, then
    the largest blocks; None where no dim will do (or `axis` splits it already)."""
    val, t = part.program.values[v], part.tiling(v)
    if axis in t.axes():
        return None
    fits = [d for d in range(1, val.rank) if val.shape[d] % part.mesh.devices_along((*t.dims[d], axis)) == 0]
    return max(fits, key=lambda d: (not t.dims[d], val.shape[d] // part.mesh.devices_along(t.dims[d])), default=None)
