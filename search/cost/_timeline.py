"""Which stage runs which microbatch when (what `Plan.plot` draws): the timelines of a
pipeline's schedules, from the seconds of one tick of each pass that `CostModel` prices
(`TickTimes`, `_pipeline.PipelinePricing.tick_times`)."""

from __future__ import annotations

from dataclasses import dataclass

import partir


@dataclass(frozen=True)
class TickTimes:
    """Seconds one tick of a pipeline's loop takes on a stage, per pass, as `CostModel`
    prices it: the stage's layers on one microbatch (their ops and the moves they make
    per microbatch) and the send of the carry they made. What runs once a step (the
    stacked values' moves, the final carry's all-reduce, the deferred reductions) is in
    no tick. `backward` is 0 for a program without a backward pass."""

    forward: float
    backward: float


@dataclass(frozen=True)
class Slot:
    """Stage `stage` running its layers on microbatch `microbatch` in the forward or
    `backward` pass, from `start` to `end` seconds after the forward tick loop begins;
    under the circular schedule, in round `repeat` (0 .. R-1) of the microbatch through
    the stages, on one chunk of its layers."""

    stage: int
    microbatch: int
    backward: bool
    start: float
    end: float
    repeat: int = 0


def gpipe_timeline(stages: int, microbatches: int, ticks: TickTimes, repeats: int = 1) -> tuple[Slot, ...]:
    """Which stage runs which microbatch when under GPipe, as the lowering runs it: one
    loop of M*R + S - 1 ticks per pass, the backward loop after the forward one; every
    tick lasts as long on every stage (the stages hold as many layers, and each tick
    ends in a send the next one reads). Forward, stage s runs unit u (microbatch u % M
    in round u // M; one round with `repeats` R = 1) in tick u + s; backward, the layers
    run in reverse, so stage s runs it in tick u + S - 1 - s. With R > 1 (the circular
    schedule) a tick runs one of the stage's R chunks of layers, so `ticks` are 1/R as
    long as GPipe's. A stage is idle in S - 1 ticks of each loop: the bubble,
    (S-1)/(M*R+S-1) of the time."""
    if stages < 1 or microbatches < 1 or repeats < 1:
        raise ValueError(f"a pipeline of {stages} stages, {microbatches} microbatches and {repeats} repeats: give "
                         "positive counts")
    units = microbatches * repeats
    loop = (units + stages - 1) * ticks.forward
    out = [Slot(s, u % microbatches, False, (u + s) * ticks.forward, (u + s + 1) * ticks.forward, u // microbatches)
           for s in range(stages) for u in range(units)]
    if ticks.backward > 0:
        out += [Slot(s, u % microbatches, True, loop + (u + stages - 1 - s) * ticks.backward,
                     loop + (u + stages - s) * ticks.backward, u // microbatches)
                for s in range(stages) for u in range(units)]
    return tuple(out)


def onef_timeline(stages: int, microbatches: int, ticks: TickTimes, repeats: int = 1) -> tuple[Slot, ...]:
    """Which stage runs which microbatch when under 1F1B, as the lowering runs it
    (`lowering/_onef`, `partir.OnefSchedule`): one loop of M*R + (R+1)*S - 2 ticks; in
    tick t stage s runs a forward unit, then a backward one (the last stage starts a
    microbatch's backward in the tick of its last chunk's forward). With `repeats` R > 1
    (interleaved: virtual stages) a unit is one of the stage's R chunks, so `ticks` are
    1/R as long as plain 1F1B's. A tick lasts a forward where any stage runs one, plus
    a backward where any stage runs one (the stages wait for each other at the tick's
    sends), so the step is (M*R+S-1)(F+B), the circular schedule's, and each stage is
    idle (S-1)/(M*R+S-1) of it."""
    if stages < 1 or microbatches < 1 or repeats < 1:
        raise ValueError(f"a 1f1b pipeline of {stages} stages, {microbatches} microbatches and {repeats} repeats: "
                         "give positive counts")
    sched = partir.OnefSchedule(stages, repeats, microbatches)
    n, out, start = sched.units, [], 0.0
    for t in range(sched.ticks):
        forward = ticks.forward if t <= n + stages - 2 else 0.0
        backward = ticks.backward if t >= sched.lag - stages + 1 else 0.0
        for s in range(stages):
            f, b = t - s, t - (sched.lag - s)
            if 0 <= f < n:
                m, r = sched.forward_of(f)
                out.append(Slot(s, m, False, start, start + ticks.forward, r))
            if 0 <= b < n and ticks.backward > 0:
                m, r = sched.backward_of(b)
                out.append(Slot(s, m, True, start + forward, start + forward + ticks.backward, r))
        start += forward + backward
    return tuple(out)
