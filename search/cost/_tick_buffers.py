"""The buffers a pipeline's tick loop holds beside the program's own values, as the
lowering runs it (`partir/lowering/_shardmap_pipeline.py`, `_onef.py`) and XLA assigns
them (measured in docs/pipeline.md, "Cost model").

The memory model sees a pipelined layer's values at one microbatch's size and each
stack a layer makes as the stage holds it (`PipelinePricing.value_div`, `stacks`). The
tick loop adds, per pass:

- **The kept stacks are loop state.** Every per-layer output the forward ticks keep
  (`ys_kept`) is a buffer of the loop, written in place each tick: a residual the model
  takes as re-derived in the backward loop from what it is made of (a fused stack,
  `_stacks.Stacks`) is kept whole by the tick loop, and the body buffers the model
  stacks in its place are not stacked at all.
- **A tick's own stacks.** A tick runs the stage's layers as an inner scan on one
  microbatch, which stacks each per-layer output of that microbatch (its layers' blocks)
  before it is written into the kept stack, and slices that microbatch out of every
  stacked input split over the microbatches (the residuals, in the backward ticks)
  into a copy the inner scan reads: one microbatch's stage-sized block of each, live
  through the tick, beside the kept stacks of all microbatches. A sum over the
  microbatches (a weight's gradient) is not stacked: each layer adds its block into the
  kept rows in place, one layer's block live at a time (`_Pass.summed`).
- **1F1B's conds and ring.** Under 1F1B each unit runs under a `lax.cond`, whose
  operands and results are whole buffers: a tick's stacks are made even for a stage of
  one layer. The ring is held once, updated in place: the backward unit takes its
  slot before the forward unit's write and writes it back, so that the write reads
  what the read made and XLA orders them (`lowering/_onef`, `_take`; read after the
  write, XLA:CPU copied the whole ring every tick where a microbatch is one row along
  its split dim).
- **The loops' constants.** A constant of the layers the model takes as fused is an
  operand of the tick loops: XLA makes it once before them, whole, but for a broadcast
  of a scalar, which it sinks into the loops, and one the same along its microbatch dim
  (a causal mask broadcast to the batch, `partir.uniform_dims`), which the lowering
  passes as one row and broadcasts per tick (`thin_consts`); and each tick passes the
  inner loop its microbatch's block of one split over the microbatches (the backward
  ticks, where they recompute the layers, the forward layers' constants too, which the
  lowering saves for them as it passes them to the forward ticks).
- **1F1B's forward initial carry.** The forward unit of every tick cuts its
  microbatch from the forward scan's initial carry (the embedded batch), so that stays
  live, whole, until the loop ends, through the backward ticks; the program's order
  frees it with the forward scan's final carry, which it shares a buffer with, after
  the head (under 1F1B the final carry is one microbatch's, in the loop). Counted from
  the backward body on (measured: the embedded batch, 16 KB of the 310 KB XLA holds on
  GPT of 32 tokens, data=4 x stage=2, M=8, Remat('full')).
- **Uneven stages' padded rows.** With uneven stages (`partir.StageSplit`) each stacked
  input the stages do not keep as their own blocks reaches the tick loops as the
  stage's ceil(L/S) padded rows (`lowering/_uneven`: the all-to-all's result, whole
  along the dim the stage axis splits at rest, or the stage's rows of a value whole
  along it), a buffer beside the [L, ...] value at rest, held from the first scan that
  reads it to the last (a parameter both scans read is exchanged once); a stacked output
  (a weight gradient) is accumulated through its loop as such rows, padding included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import partir


@dataclass(frozen=True)
class _Pass:
    """One pipelined scan's tick loop: its body's first and last op (`start`, `end`);
    the last op that reads what it keeps (`read_until`: the backward ticks' end, for the
    forward scan); the body values a tick slices from its stacked inputs (`inputs`) and
    stacks as its per-layer outputs (`outputs`); the layers a tick runs; its kept stacks
    (stacked outputs, the forward scan's only); whether it is 1F1B's (`ring`); its
    constants (outer value, body value); the constants it takes as one row, broadcast
    per tick (`thin`: the lowering's `thin_consts`)."""

    start: int
    end: int
    read_until: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    layers: int
    kept: tuple[int, ...]
    ring: bool
    consts: tuple[tuple[int, int], ...]
    thin: frozenset = frozenset()
    summed: tuple[int, ...] = ()

    def ticks(self, virtual, value_div) -> list:
        """`(start, end, value, scale)` of a tick's stacks and constants (see
        `TickBuffers.entries`), and of the kept stacks the model takes as fused or 1F1B
        copies."""
        out = []
        # A tick of one layer runs no inner loop: XLA reads and writes the kept stacks in
        # place, but for 1F1B's units, whose conds take and give whole buffers.
        if self.layers > 1 or self.ring:
            out += [(self.start, self.end, w, float(self.layers)) for w in self.inputs if value_div[w] > 1]
            out += [(self.start, self.end, y, float(self.layers)) for y in self.outputs]
            out += [(self.start, self.end, y, 1.0) for y in self.summed]
            out += [(self.start, self.end, w, 1.0) for o, w in self.consts if virtual[o] and value_div[w] > 1]
        for v in self.kept:  # copies: the stack the model re-derives instead
            if virtual[v]:
                out.append((self.start, self.read_until, v, 1.0))
        return out


class TickBuffers:
    """The tick loops' buffers of a plan's pipelines (see the module docstring):
    `entries` lists them as `(start, end, value, scale)` temporaries for the memory
    model; `stacked_elsewhere` drops the body buffers the model would stack for a fused
    residual of a pipelined scan. `pipes` holds, per pipeline, (its
    `partir.Pipelining`, its microbatched partitioning (`partir.microbatched`), its
    scans' `partir.ScanLayout`s, the stacked outputs its plan recomputes, the layer
    inputs it stacks to recompute them)."""

    def __init__(self, part, pipes):
        prog = part.program
        self.program, self.passes, self.bodies, self.rows = prog, [], set(), []
        self.fed: list = []  # 1F1B's forward initial carries, read by every tick: `_fed`
        self._kernel = (None, None)  # (attention, its `kernel_values`): the memory model asks every evaluation
        for pipe, ext, layouts, gone, extra in pipes:
            self.rows += _padded_rows(part, pipe, layouts)
            layers = pipe.split(part.mesh.size(pipe.axis)).slots // pipe.repeats  # the layers one tick runs
            spans = [body_span(prog, lay.call.body) for lay in layouts]
            last = max(end for _, end in spans)
            shared = partir.onef_gathered(prog, pipe, layouts)  # (read from a gathered block, not kept)
            for lay, span in zip(layouts, spans):
                self.bodies.update(partir.body_regions(prog, lay.call.body))
                self.passes.append(_pass(prog, pipe, ext, lay, span, last, layers, gone, extra, shared))
            if pipe.schedule == "1f1b" and len(spans) > 1:
                self.fed += [(spans[1][0], last, v) for v in pipe.scans.forward.carry if v >= 0]

    def entries(self, virtual, value_div, attention=None) -> list:
        """`(start, end, value, scale)` of the tick loops' buffers: a tick's stacks (one
        microbatch's block of each per-layer output, and of each stacked input split over
        the microbatches, `value_div` saying which are: an input the same for every
        microbatch is read in place), each kept stack the model takes as fused
        (`virtual`), from the forward ticks to the backward ones, the loops' fused
        constants, and uneven stages' padded rows of their stacked inputs and outputs.
        With `attention` (`Materialization.attention`, the fused attention kernels), what
        is inside a kernel is no buffer, in a tick or out of it (`kernel_values`)."""
        out = self._entries(virtual, value_div)
        if attention is None:
            return out
        if self._kernel[0] is not attention:
            self._kernel = (attention, kernel_values(self.program, attention))
        inside = self._kernel[1]
        return [e for e in out if not inside[e[2]]]

    def _entries(self, virtual, value_div) -> list:
        out = list(self.rows) + [(a, b, v, 1.0) for a, b, v in self.fed if not virtual[v]]
        whole: dict[int, list] = {}  # a fused constant the loops read whole: made once, before them
        read_whole = set()  # (by some loop: not taken as one row by all, `_Pass.thin`)
        for p in self.passes:
            out += p.ticks(virtual, value_div)
            for o, _ in p.consts:
                if virtual[o] and not _sunk(self.program, o):
                    span = whole.setdefault(o, [p.start, p.end])
                    span[:] = min(span[0], p.start), max(span[1], p.end)
                    if o not in p.thin:
                        read_whole.add(o)
        return out + [(a, b, o, 1.0) for o, (a, b) in whole.items() if o in read_whole]

    def stacked_elsewhere(self, carried) -> list:
        """`carried` (`Materialization.carried` entries) without those of pipelined scans:
        the tick loop keeps the residuals themselves (see the module docstring)."""
        return [c for c in carried if self.program.values[c[2]].region not in self.bodies]


def kernel_values(prog, attention) -> np.ndarray:
    """Per value: inside a fused attention kernel, where the scores, their softmax and
    its mask never exist: the kernel's values (`attention.values`), their stacks and
    slices across a loop's boundary (a forward scan's stacked weights, the backward
    body's slice of them), and what only the kernel's ops read (the mask a layer scan
    takes as a constant)."""
    inside = np.array(attention.values, dtype=bool)
    for _ in range(2):  # a loop's boundary links run before and after its body
        for op in prog.ops:
            if op.link and op.operands and op.operands[0] >= 0 and inside[op.operands[0]]:
                inside[[r for r in op.results if r >= 0]] = True
    readers: dict[int, list] = {}
    for op in prog.ops:
        for u in op.operands:
            if u >= 0:
                readers.setdefault(u, []).append(op)
    for v, ops in readers.items():
        if all(not o.link and attention.ops[o.id] for o in ops):
            inside[v] = True
    for op in reversed(prog.ops):  # a constant's outer value, when its body copy is the kernel's alone
        if op.link and op.operands and op.operands[0] >= 0 and all(r < 0 or inside[r] for r in op.results) and \
                all(o.link for o in readers.get(op.operands[0], ())):
            inside[op.operands[0]] = True
    return inside


def _pass(prog, pipe, ext, lay, span, last, layers, gone, extra, shared=frozenset()) -> _Pass:
    """The `_Pass` of `pipe`'s scan `lay` (`partir.ScanLayout`; `ext`: the microbatched partitioning), its
    body from `span[0]` to `span[1]`, the pipeline's scans ending at `last`; `gone`: the
    stacked outputs recomputed (kept as placeholders), `extra`: the layer inputs kept
    for recomputing (made by the forward ticks, sliced by the backward ones); `shared`:
    the stacked outputs 1F1B's backward reads from the forward's gathered block of a
    weight (`partir.onef_gathered`), which no ring keeps."""
    call = lay.call
    body = prog.regions[call.body]
    ins = body.invars[len(call.consts) + len(call.carry):]
    outs = body.outvars[len(call.carry_out):]
    reads = [w for w, outer in zip(ins, call.xs) if w >= 0 and outer >= 0 and outer not in gone]
    made = [y for y, outer in zip(outs, call.ys) if y >= 0 and outer >= 0 and outer not in gone]
    # A tick adds a sum over the microbatches into its kept rows layer by layer
    # (`lowering/_shardmap_pipeline`, `_onef`): one layer's block of it at a time.
    summed = [y for y, s in zip(outs, lay.summed) if s and y in made]
    made = [y for y in made if y not in summed]
    forward = call is pipe.scans.forward
    kept = tuple(o for o in call.ys if o >= 0 and o not in gone and o not in shared) if forward else ()
    consts = tuple((o, w) for o, w in zip(call.consts, body.invars) if o >= 0 and w >= 0)
    thin = frozenset(o for o, d in zip(call.consts, lay.in_dims) if o >= 0 and d is not None
                     and d in partir.uniform_dims(prog, o))
    if gone and not forward:  # recomputing reads the forward layers' constants in the backward ticks
        ahead = pipe.scans.forward
        consts += tuple((o, w) for o, w in zip(ahead.consts, prog.regions[ahead.body].invars) if o >= 0 and w >= 0)
        thin |= {o for o, d in zip(ahead.consts, _const_dims(ext, ahead)) if o >= 0 and d is not None
                 and d in partir.uniform_dims(prog, o)}  # (saved as one row for it too)
    return _Pass(span[0], span[1], last, tuple(reads + ([] if forward else list(extra))),
                 tuple(made + (list(extra) if forward else [])), layers, kept, pipe.schedule == "1f1b", consts, thin,
                 tuple(summed))


def _const_dims(ext, call) -> list:
    """The microbatch dim of each constant of scan `call` (None where it has none), on
    the microbatched partitioning `ext`."""
    body = ext.program.regions[call.body]
    return [None if w < 0 else next((d for d, axes in enumerate(ext.tiling(w).dims) if partir.MICROBATCH in axes),
                                    None) for w in body.invars[:len(call.consts)]]


def _padded_rows(part, pipe, layouts) -> list:
    """`(start, end, value, scale)` of the stage's padded rows of each stacked input of
    uneven stages but those kept as the stages' blocks (see the module docstring):
    `scale` times the value's block at rest, S * ceil(L/S) / L of it where the stage axis
    splits another dim at rest (the rows whole along it, 1/S of the padded layers),
    ceil(L/S) / L where it is whole along the axis. And of each stacked output the loop
    accumulates as such rows before the exchange out: what they hold beyond the value's
    block at rest, which the model holds already (S * ceil(L/S) / L - 1 of it)."""
    stages = part.mesh.size(pipe.axis)
    split = pipe.split(stages)
    if not split.uneven:
        return []
    prog, kept = part.program, partir.kept_in_slots(part, pipe)
    roots, spans, first = partir.call_roots(prog), {}, {}
    for lay in layouts:
        start, end = body_span(prog, lay.call.body)
        for outer in lay.call.xs:
            if outer < 0 or outer in kept:
                continue
            key = (roots[outer], part.tiling(outer))
            first.setdefault(key, outer)
            a, b = spans.get(key, (start, end))
            spans[key] = (min(a, start), max(b, end))
    rows = {key: split.slots * (1 if partir.state_dim(key[1], pipe.axis) is None else stages) / split.length
            for key in spans}
    out = [(start, end, first[key], rows[key]) for key, (start, end) in spans.items()]
    for lay in layouts:  # the stacked outputs' rows, accumulated through the loop
        start, end = body_span(prog, lay.call.body)
        for outer in lay.call.ys:
            if outer >= 0 and outer not in kept and partir.state_dim(part.tiling(outer), pipe.axis) is not None:
                out.append((start, end, outer, split.slots * stages / split.length - 1))
    return out


def _sunk(prog, v: int) -> bool:
    """Whether XLA makes fused value `v` inside the loops that read it rather than once
    before them: broadcasts of a scalar or a literal (through calls' renames), which it
    sinks into the loop bodies."""
    while True:
        op = prog.ops[prog.producer[v]] if prog.producer[v] >= 0 else None
        if op is None or not (op.link or op.primitive == "broadcast_in_dim"):
            return False
        if not op.operands or op.operands[0] < 0 or not prog.values[op.operands[0]].shape:
            return not op.link
        v = op.operands[0]


def body_span(prog, body: int) -> tuple[int, int]:
    """The first and last op of scan body `body` (its nested regions included)."""
    inside = set(partir.body_regions(prog, body))
    ids = [op.id for op in prog.ops if op.region in inside]
    return min(ids), max(ids)
