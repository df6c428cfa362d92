"""Which values of a program XLA turns into buffers, and which ops it really runs.

The jaxpr is not what XLA executes. Before buffers are assigned, XLA

1. drops dead code: ops no output depends on. JAX's jaxprs keep some (a broadcast
   hoisted out of a scan as a loop-invariant residual that the backward never reads,
   an unused argument of an inner `jit`);
2. fuses broadcasts, iotas and cheap elementwise ops on values made from scalars into
   their consumers: a causal mask, a `finfo.min` fill broadcast to `[B, H, S, S]`, a
   mean broadcast from `[B, S, 1]` to `[B, S, D]` never exist as buffers. Every
   consumer re-derives them, in the forward and in the backward, from their *sources*
   (the materialized values they were broadcast from), which must stay live instead;
3. makes a reshape a view of its operand's buffer (a bitcast in XLA's row-major
   layouts), so a value and its reshapes are one buffer;
4. keeps the activation entering each layer of an unrolled program as a buffer, as a
   scan's carry is one, however cheap the op that makes it (a residual add);
5. on a backend that runs attention as one fused kernel (`fused_attention=True`: GPU and
   TPU presets), makes none of the score-shaped values a buffer (`_attention`).

Which cheap ops with several readers fuse depends on the backend. XLA:CPU duplicates
one into its readers unless one of them ends in a reduction (measured: a float32 copy
of a bfloat16 activation that a norm's mean of squares reads is a buffer). XLA:GPU's
priority fusion (`priority_fusion=True`: GPU presets) fuses a producer into all its
readers, reductions included, whenever its cost model says the fused kernels run
faster than the producer's own kernel plus the readers reading its result
(openxla/xla, `xla/service/gpu/transforms/priority_fusion.cc`: a producer's priority
is the time saved by fusing it into every reader, and it is fused into all or none).
For the memory-bound elementwise ops this is about, time is bytes: a cheap op that
reads `in` bytes of buffers, writes `out` and has `n` readers fuses when

    n * in <= in + out + n * out        (`priority_fuses`)

so a widening cast (a norm's float32 copy of its bfloat16 input) is never a buffer:
each reader casts again. On such a backend a scan's fused residual may be re-derived
from body buffers its forward loop does not stack (the layer's input, a projection's
output): the loop stacks those instead (`_stacks`, `Materialization.carried`), once
each, as the unrolled program keeps each layer's copy.

`materialization(program, fused_attention=False, priority_fusion=False)` computes these
static facts once per program; the cost model prices and the liveness counts only what
XLA materializes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from partir import Link, depended_on, layers_of, makers_of
from partir.rules import Fusion, Traits, Work, get_traits

from ._attention import AttentionRegion, attention_region
from ._stacks import CALL_LINKS, STACKS, Stacks

#: How XLA fuses each primitive is its traits' (`partir.rules`, `Traits.fusion`): cheap ops
#: are computed inside the fusions of their consumers, duplicated into each; expensive
#: ones fused into a consumer only when that is their one reader (XLA does not duplicate
#: expensive work: with several readers they are materialized); reductions and
#: broadcasts take their elementwise producers in; a view is its operand's buffer; an op
#: that creates values makes them from shapes or scalars. A link (no traits) fuses
#: nothing of its own.
_NO_TRAITS = Traits(Work.MOVE)


def op_traits(op) -> Traits:
    return (None if op.link else get_traits(op.primitive)) or _NO_TRAITS


#: Links into a loop body: a `while` loop's operands are buffers, so a value made from
#: scalars that a scan takes as a constant (JAX hoists loop-invariant residuals out of
#: the body) is materialized once before the loop.
LOOP_ENTRIES = frozenset((Link.SCAN_CONST, Link.SCAN_CARRY_IN, Link.WHILE_CONST, Link.WHILE_CARRY_IN))

@dataclass(frozen=True, eq=False)
class Materialization:
    """Static buffer facts of a program (arrays indexed by op or value id).

    `live_op[o]`: some output depends on op o (else XLA drops it).
    `virtual[v]`: v is never a buffer: dead, or fused into its consumers.
    `from_scalars[v]`: v is made from scalars and iotas alone, so it can be made in any
    layout where it is needed, never moved (a subset of `virtual`).
    `sources[v]`: for a virtual value that is fused, the materialized values its
    consumers re-derive it from (they stay live as long as v is read).
    `attention`: the fused attention kernels (None where the backend has none).
    `carried`: the body buffers a scan's forward loop stacks for residuals re-derived
    from them in the backward loop (priority fusion only), as `(start, end, value,
    scale, stacks)`: `scale` more copies of the value, live from `start` to `end` (the
    value's own buffer lives until the backward loop reads it, as a source), for the
    fused stacks `stacks` (the stacked outputs re-derived from it).
    """

    live_op: np.ndarray
    virtual: np.ndarray
    from_scalars: np.ndarray
    sources: dict
    attention: AttentionRegion | None = None
    carried: tuple = ()


def materialization(program, fused_attention: bool = False, priority_fusion: bool = False) -> Materialization:
    """The static buffer facts of `program` (see the module docstring); with
    `fused_attention`, the attention scores are inside a kernel and no buffer; with
    `priority_fusion`, cheap ops fuse as XLA:GPU's priority fusion fuses them."""
    live = _live_ops(program)
    n = len(program.values)
    produced = makers_of(program)
    virtual = np.zeros(n, dtype=bool)
    scalar_made = np.zeros(n, dtype=bool)
    sources: dict[int, tuple[int, ...]] = {}
    readers = _readers(program, live)
    stacks = Stacks(program, carry=priority_fusion)
    boundaries = _layer_boundaries(program, first=priority_fusion)
    for op in program.ops:  # lift order: operands are decided before their users
        if not live[op.id]:
            for v in op.results:
                if v >= 0 and all(not live[p] for p in produced[v]):
                    virtual[v] = True
            continue
        if op.link and op.primitive in STACKS:
            kind = stacks.fused(op, virtual, scalar_made, sources)
        else:
            kind = _fused(program, op, virtual, scalar_made, sources, readers, priority_fusion)
        if kind is None:
            continue
        made, srcs = kind
        if not made and any(v in boundaries for v in op.results):
            continue
        for v in op.results:
            if v >= 0 and _single_producer(produced[v], op.id, live):
                virtual[v] = True
                scalar_made[v] = made
                if srcs:
                    sources[v] = srcs
    sources = _materialized_sources(sources, virtual)
    for v in program.outputs:  # what the step returns is a buffer, however it was made
        if v >= 0:
            virtual[v] = False
    for op in program.ops:  # so is what enters a loop, but what scalars make (remade inside)
        v = op.operands[0] if op.link and op.operands else -1
        if v >= 0 and op.primitive in LOOP_ENTRIES and live[op.id] and not scalar_made[v]:
            virtual[v] = False
    carried = stacks.carried_buffers(virtual)
    if not fused_attention:
        return Materialization(live, virtual, scalar_made, sources, carried=carried)
    region = attention_region(program, scalar_made)
    virtual = virtual | region.values
    # A value outside the kernel re-derived from one inside it (none in the attention
    # users write) would read it from the kernel's output: it keeps no score alive.
    sources = {v: tuple(s for s in srcs if not region.values[s]) for v, srcs in sources.items()
               if not region.values[v]}
    return Materialization(live, virtual, scalar_made, {v: s for v, s in sources.items() if s}, region, carried)


def _fused(program, op, virtual, scalar_made, sources, readers, priority=False):
    """(made from scalars alone, sources) if op's results are fused into their
    consumers, else None; `priority`: cheap ops fuse as XLA:GPU's priority fusion
    fuses them (module docstring)."""
    arrays = [v for v in op.operands if v >= 0 and program.values[v].shape]
    if op.link:
        if len(arrays) != 1 or not virtual[arrays[0]]:
            return None
        if op.primitive in LOOP_ENTRIES and not scalar_made[arrays[0]]:
            return None
        v = arrays[0]
        return bool(scalar_made[v]), sources.get(v, ())
    made = all(virtual[v] and scalar_made[v] for v in arrays)
    traits = op_traits(op)
    if made and (traits.creates or traits.fusion is Fusion.CHEAP):
        pass  # made from scalars: made wherever it is read, in any layout
    elif op.primitive == "broadcast_in_dim":
        pass  # re-derived where it is read
    elif traits.fusion is Fusion.CHEAP and priority:
        if not _priority_fuses(program, op, readers, virtual, sources):
            return None
    elif traits.fusion is Fusion.CHEAP:
        if not _fuses(op, readers, many=True):
            return None
    elif traits.fusion is Fusion.EXPENSIVE:
        if not _fuses(op, readers, many=False):
            return None
    else:
        return None
    return made, tuple(v for v in arrays if not virtual[v]) + _union(sources, [v for v in arrays if virtual[v]])


def _fuses(op, readers, *, many: bool) -> bool:
    """Do all of op's results go only to fusing consumers? One consumer always fuses it
    in; several duplicate it, which XLA does for cheap ops (`many`) unless one of them
    ends in a reduction (a reduction's fusion reads its operand whole, so the value is
    written once and read by all)."""
    for v in op.results:
        if v < 0:
            continue
        kinds = readers[v]
        if not kinds:
            return False
        if len(kinds) > 1 and (not many or any(into_reduction for _, into_reduction in kinds)):
            return False
    return True


def priority_fuses(n: int, read: float, written: float) -> bool:
    """Does a producer that reads `read` bytes and writes `written` fuse into its `n`
    readers under XLA:GPU's priority fusion? Fused, each reader reads what the producer
    read; unfused, the producer reads and writes once and each reader reads its result."""
    return n * read <= read + written + n * written


def _priority_fuses(program, op, readers, virtual, sources) -> bool:
    """Do all of op's results go only to fusing consumers, and does re-deriving it in
    each move no more bytes than making it once (`priority_fuses`)? A fused operand is
    read from its sources."""
    read: dict[int, None] = {}
    for v in op.operands:
        if v >= 0 and program.values[v].shape:
            read.update(dict.fromkeys(sources.get(v, ()) if virtual[v] else (v,)))
    read_bytes = sum(program.values[v].nbytes for v in read)
    for v in op.results:
        if v < 0:
            continue
        kinds = readers[v]
        if not kinds or not priority_fuses(len(kinds), read_bytes, program.values[v].nbytes):
            return False
    return True


def _readers(program, live) -> list:
    """Per value, its live readers seen through calls as `(primitive, ends in a
    reduction)` pairs, or None when one of them does not fuse its operands in (a dot, a
    gather, a loop, an output). A reader ends in a reduction when it is one, or when it
    is elementwise and its result goes to one reader that does."""
    n = len(program.values)
    out: list = [[] for _ in range(n)]
    for v in program.outputs:
        if v >= 0:
            out[v] = None
    for op in reversed(program.ops):  # a call's inner readers before the call-in link
        if not live[op.id]:
            continue
        results = [r for r in op.results if r >= 0]
        is_call = op.link and (op.primitive in CALL_LINKS or op.primitive in STACKS)
        if is_call:
            inner = [out[r] for r in results]
            entry = None if any(i is None for i in inner) else [k for i in inner for k in i]
        elif op_traits(op).fusion.fuses_producers:
            reduces = op_traits(op).fusion is Fusion.INPUT or any(
                out[r] is not None and len(out[r]) == 1 and out[r][0][1] for r in results)
            entry = [(op.primitive, reduces)]
        else:
            entry = None
        for v in op.operands:
            if v >= 0 and out[v] is not None:
                out[v] = None if entry is None else out[v] + entry
    return out


def _layer_boundaries(program, first: bool = False) -> set[int]:
    """The activations that enter a layer of an unrolled program after the first (made
    by the op just before it, the residual stream's add): XLA makes each a buffer, as a
    scan's carry is one. Fused into its readers instead (the next layer's norm and
    residual add, and the backward pass's recomputation), it would keep both summands of
    every earlier layer's residual add alive: XLA bounds what it fuses. (The first
    layer's start is where the cut is least sure, and its input, made once, is a
    constant beside the layers.) With `first` (priority fusion), the first layer's input
    is one too, as the carry entering a scan is: fused into the layer's readers, a cast
    of the embedding lookup (float32 rows to bfloat16) had every reader read, and the
    backward pass keep, the float32 rows."""
    out = set()
    layers = layers_of(program)
    for b in layers[1:]:
        if b.loop < 0:
            op = program.ops[b.ops[0] - 1]
            out.update(v for v in op.results if v in b.inputs and not op.link)
    if first and len(layers) > 1 and layers[0].loop < 0 and out:
        out.update(_first_layer_input(program, layers[0], out))
    return out


def _first_layer_input(program, block, boundaries) -> set[int]:
    """The input of the first layer `block` its residual stream starts from: reached
    from the second layer's input back through the residual adds inside the block."""
    inputs, seen, found = set(block.inputs), set(), set()
    stack = [v for v in boundaries if program.producer[v] in set(block.ops) | {block.ops[-1] + 1}]
    while stack:
        v = stack.pop()
        if v in seen or v < 0:
            continue
        seen.add(v)
        if v in inputs:
            found.add(v)
            continue
        p = program.producer[v]
        if p >= 0 and program.ops[p].primitive == "add" and not program.ops[p].link:
            stack += list(program.ops[p].operands)
    return {v for v in found if program.producer[v] >= 0 and not program.ops[program.producer[v]].link}


def _materialized_sources(sources, virtual) -> dict:
    """Sources that are buffers: a fused stack a source names is replaced by its own."""
    done: dict[int, tuple[int, ...]] = {}

    def resolve(v, depth=0):
        if v in done or depth > 64:
            return done.get(v, ())
        out: dict[int, None] = {}
        for s in sources.get(v, ()):
            out.update(dict.fromkeys(resolve(s, depth + 1) if virtual[s] else (s,)))
        done[v] = tuple(out)
        return done[v]

    for v in list(sources):
        resolve(v)
    return {v: s for v, s in done.items() if s}


def _union(sources, values) -> tuple[int, ...]:
    out: dict[int, None] = {}
    for v in values:
        out.update(dict.fromkeys(sources.get(v, ())))
    return tuple(out)


def _single_producer(producers, oid, live) -> bool:
    # A loop carry is made by the carry-in link and by the body going round: it is only
    # fused when every live producer fuses it, which for a carry never holds.
    return all(p == oid or not live[p] for p in producers)


def _live_ops(program) -> np.ndarray:
    """Ops some program output (or a side effect) depends on, through loops and calls."""
    effects = [v for op in program.ops if not op.link and getattr(op.eqn, "effects", None) for v in op.operands]
    _, live = depended_on(program, [*program.outputs, *effects])
    for op in program.ops:  # an op with an effect runs even if nothing reads it
        if not op.link and getattr(op.eqn, "effects", None):
            live[op.id] = True
    return live


def view_pairs(program, virtual) -> list[tuple[int, int]]:
    """(operand, result) of each live view op between buffers (its traits' `view`:
    reshapes are bitcasts in XLA's row-major layouts)."""
    out = []
    for op in program.ops:
        if op_traits(op).view and op.operands and op.operands[0] >= 0:
            a, b = op.operands[0], op.results[0]
            if b >= 0 and not virtual[a] and not virtual[b]:
                out.append((a, b))
    return out
