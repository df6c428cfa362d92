"""The region between a pipeline's two layer scans (the final norm, the head, the loss
and their backward) run one microbatch at a time.

In a differentiated train step the forward layer scan and the backward one are two
equations of one region; what lies between them reads the forward scan's final carry
(the last layer's activation) and makes the backward scan's initial carry (its
gradient), the loss, and the gradients of the head's parameters. Run on the whole
batch, its activations (the logits above all) are the replica batch's; run per
microbatch they are one microbatch's. The microbatched partitioning
(`partir.microbatched`) says for every value of the region, as for a layer's, whether
it holds a microbatch (`SPLIT`: its blocks are kept, one per microbatch, where it
leaves the region), is the same for all (`SAME`: its equation runs once, before the
loop), or is a sum over them (`SUM`: the loss, a weight gradient; accumulated). A
value the region cannot make that way (a non-sum reduction over the batch, a sum
through a non-linear op, a plan moving a value across microbatches) is refused before
lowering, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from jax.extend.core import Literal

from ._errors import PartitioningError
from ._pipeline import SAME, SPLIT, _check_values, _deferred, _kind_results, _micro_dim, microbatched
from ._scans import body_regions, var_ids


@dataclass(frozen=True)
class HeadLayout:
    """The equations [`start`, `end`) of region `region` (between the forward scan,
    equation `start` - 1, and the backward scan, equation `end`), run per microbatch
    but for the `hoisted` ones (their results are the same for every microbatch: run
    once, before the loop). `looped_ops`: the ops of the others (nested ones and links
    included). `inputs`: the values the looped equations read that are made before
    them, with the dim holding the microbatch (`in_dims`, None: the same for all);
    `outputs`: the values they make that are read after the region, with their kind
    and split dim. `deferred`: sums left partial over mesh axes until accumulated
    (`ScanLayout.deferred`)."""

    region: int
    start: int
    end: int
    microbatches: int
    hoisted: tuple[int, ...]
    looped_ops: tuple[int, ...]
    inputs: tuple[int, ...]
    in_dims: tuple
    outputs: tuple[int, ...]
    out_kinds: tuple[str, ...]
    out_dims: tuple
    deferred: tuple = ()

    @property
    def looped(self) -> tuple[int, ...]:
        """The equations run per microbatch, in order."""
        return tuple(i for i in range(self.start, self.end) if i not in self.hoisted)

    def left_partial(self, v: int) -> tuple[str, ...]:
        """The mesh axes value `v` is left partial over until the microbatches are summed."""
        return dict(self.deferred).get(v, ())


def head_layout(part, ext, pipe) -> HeadLayout | None:
    """The `HeadLayout` of `pipe`'s two layer scans on `part` (`ext`: its microbatched
    partitioning), checked; None when the program has no backward scan, or the two
    scans are not equations of one region (the region between them is then run on
    the whole batch, as the plan places it)."""
    fwd, bwd = pipe.scans.forward, pipe.scans.backward
    if bwd is None or fwd.parent != bwd.parent or bwd.index <= fwd.index + 1:
        return None
    prog, rid = part.program, fwd.parent
    start, end = fwd.index + 1, bwd.index
    region, ids = prog.regions[rid], var_ids(prog, rid)
    eqn_of = _eqn_of_ops(prog, rid, start, end)
    ops = sorted(eqn_of)
    values = {v for o in ops for v in prog.ops[o].results if v >= 0}
    what = "the region between the pipelined layer scans (head and loss), run per microbatch"
    try:
        _check_values(part, ext, pipe, values, ops, check_stage=False)
        kinds = {}
        for o in ops:
            for v in prog.ops[o].operands:
                if v >= 0 and v not in values:
                    kinds.setdefault(v, SPLIT if _micro(ext, prog, v) is not None else SAME)
            _kind_results(prog, ext, prog.ops[o], kinds)
    except PartitioningError as e:
        raise PartitioningError(f"{what}: {e}; make the loss a sum or mean over the batch's examples, or leave "
                                "Pipeline out") from e
    hoisted = _hoisted(region, ids, start, end, kinds)
    looped = tuple(o for o in ops if eqn_of[o] not in hoisted)
    made = {v for i in range(start, end) if i not in hoisted for v in region.eqn_results[i] if v >= 0}
    inputs = tuple(dict.fromkeys(v for i in range(start, end) if i not in hoisted
                                 for v in _operands(region.jaxpr.eqns[i], ids) if v not in made))
    after = _read_after(region, ids, end)
    outputs = tuple(v for v in after if v in made)
    return HeadLayout(rid, start, end, pipe.microbatches, hoisted, looped,
                      inputs, tuple(_micro(ext, prog, v) for v in inputs), outputs,
                      tuple(kinds[v] for v in outputs), tuple(_micro(ext, prog, v) for v in outputs),
                      _deferred(ext, [prog.ops[o] for o in looped], kinds))


def check_pipeline(part, pipe) -> None:
    """Raise the `PartitioningError` that says why `part` cannot run pipeline `pipe` as
    the lowering would (its microbatched plan, the head between its scans, its
    schedule's conditions), before any work."""
    ext, _ = microbatched(part, pipe)
    head = head_layout(part, ext, pipe)
    if pipe.schedule == "1f1b":
        check_onef(part, pipe, head)


def check_pipelines(part) -> None:
    """Raise the `PartitioningError` of the first of `part`'s pipelines its plan no
    longer lets run (e.g. the batch split further since, so that the microbatches are no
    longer whole): what a tactic or search action after a `Pipeline` must not do."""
    for pipe in part.pipelines:
        check_pipeline(part, pipe)


def _micro(ext, prog, v: int):
    return _micro_dim(ext.tiling(v), f"value {prog.name(v)}")


def _operands(eqn, ids) -> list[int]:
    return [ids[x] for x in eqn.invars if not isinstance(x, Literal)]


def _eqn_of_ops(prog, rid: int, start: int, end: int) -> dict[int, int]:
    """Op id -> the equation of region `rid` in [`start`, `end`) it belongs to: the
    equation's own op, the ops of the bodies it calls, and the links into and out of
    them."""
    region = prog.regions[rid]
    owner = {}
    for i in range(start, end):
        if i in region.children:
            for c in region.children[i]:
                owner.update(dict.fromkeys(body_regions(prog, c), i))
    out = {}
    for i in range(start, end):
        if region.eqn_ops[i] >= 0:
            out[region.eqn_ops[i]] = i
    for op in prog.ops:
        if op.region in owner:
            out[op.id] = owner[op.region]
        elif op.link and op.region == rid:
            touched = [prog.values[v].region for v in op.operands + op.results if v >= 0]
            at = next((owner[r] for r in touched if r in owner), None)
            if at is not None:
                out[op.id] = at
    return out


def _hoisted(region, ids, start: int, end: int, kinds: dict) -> tuple[int, ...]:
    """The equations in [`start`, `end`) whose operands and results are all the same for
    every microbatch (made before the region, or by such an equation)."""
    inside = {v for i in range(start, end) for v in region.eqn_results[i] if v >= 0}
    out, ready = [], set()
    for i in range(start, end):
        reads = _operands(region.jaxpr.eqns[i], ids)
        res = [v for v in region.eqn_results[i] if v >= 0]
        if (res and all(kinds.get(v, SAME) == SAME for v in reads + res)
                and all(v in ready or v not in inside for v in reads)):
            out.append(i)
            ready.update(res)
    return tuple(out)


def _read_after(region, ids, end: int) -> list[int]:
    """The values equations from `end` on, or the region's outputs, read."""
    seen = [v for eqn in region.jaxpr.eqns[end:] for v in _operands(eqn, ids)]
    seen += [v for v in region.outvars if v >= 0]
    return list(dict.fromkeys(seen))


def check_onef(part, pipe, head: HeadLayout | None) -> None:
    """The 1F1B schedule's conditions (`lowering/_onef`), refused before any work: a
    backward scan in the region of the forward one with the head between them,
    interleaved 1F1B's (`_check_interleaved`), and the forward scan's results read by
    the head (its final carry) and the backward scan (its residuals) alone. (Uneven
    stages and layers rolled from unrolled ones run as GPipe's: padded slots, their
    rows exchanged in and out. Recomputed layers run: the ring keeps what recomputing
    needs instead of the residuals the `Remat` policy drops, `lowering/_onef`.)"""
    fix = "or use schedule='gpipe'"
    if head is None:
        raise PartitioningError("the 1f1b schedule interleaves the forward and backward layer scans of a train "
                                "step around its head; this program has no backward scan in the region of the "
                                f"forward one: differentiate the loss in the step that scans the layers, {fix}")
    if pipe.repeats > 1:
        _check_interleaved(part, pipe, fix)
    prog, fwd, bwd = part.program, pipe.scans.forward, pipe.scans.backward
    region, ids = prog.regions[fwd.parent], var_ids(prog, fwd.parent)
    mine = set(range(head.start, head.end)) - set(head.hoisted)
    for v in (u for u in fwd.carry_out + fwd.ys if u >= 0):
        readers = [i for i, eqn in enumerate(region.jaxpr.eqns) if v in _operands(eqn, ids)]
        allowed = mine if v in fwd.carry_out else {bwd.index}
        if not set(readers) <= allowed or v in region.outvars:
            raise PartitioningError(f"the 1f1b schedule keeps {prog.name(v)}, a result of the forward layer scan, "
                                    "for one microbatch at a time, but the step reads it elsewhere too: read the "
                                    f"layers' output only in the loss, {fix}")
    for v in bwd.consts + bwd.xs:
        if v in head.outputs:
            raise PartitioningError(f"the backward layer scan reads {prog.name(v)}, made per microbatch by the "
                                    f"head, as a constant or layer input; the 1f1b schedule cannot run it: {fix}")
    fbody, bbody = prog.regions[fwd.body], prog.regions[bwd.body]
    outs, ins = fbody.outvars[len(fwd.carry):], bbody.invars[len(bwd.consts) + len(bwd.carry):]
    for v, w in zip(bwd.xs, ins):
        if v in fwd.ys:
            made = outs[fwd.ys.index(v)]
            if not part.tiling(made).dims == part.tiling(v).dims[1:] == part.tiling(w).dims:
                raise PartitioningError(f"the plan moves the residual {prog.name(v)} between the forward and the "
                                        f"backward layers ({part.tiling(made)} -> {part.tiling(w)}); the 1f1b "
                                        f"schedule keeps residuals as the forward layers make them: {fix}")


def _check_interleaved(part, pipe, fix: str) -> None:
    """Interleaved 1F1B's own condition (`OnefSchedule`): whole groups of S microbatches."""
    stages = part.mesh.size(pipe.axis)
    if pipe.microbatches % stages:
        raise PartitioningError(f"interleaved 1f1b (repeats={pipe.repeats}) runs the microbatches in groups of the "
                                f"{stages} stages over {pipe.axis!r}; {pipe.microbatches} microbatches are not whole "
                                f"groups: give a multiple of {stages}, repeats=1, {fix}")


def onef_outputs(program, pipe, head: HeadLayout) -> tuple[int, ...]:
    """Under 1F1B, the head's outputs the step reads after the backward scan (what the
    last stage accumulates and the stage axis then sums): all but the backward scan's
    initial carry, unless the step reads that again too."""
    bwd = pipe.scans.backward
    region, ids = program.regions[bwd.parent], var_ids(program, bwd.parent)
    return tuple(v for v in _read_after(region, ids, bwd.index + 1) if v in head.outputs)
