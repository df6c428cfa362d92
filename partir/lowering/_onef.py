"""The 1F1B schedule: a train step's forward layer scan, the head between the two scans
and the backward layer scan run as one tick loop of each device's stage, for both
lowerings (`partir.Pipelining(schedule="1f1b")`).

At tick t the stage s runs the forward of microbatch t - s on its layers, then (the
last stage only) the head region on that microbatch (`HeadLayout`: final norm, head,
loss and their backward), then the backward of microbatch t - (2S-2-s); after the tick
it sends the forward carry to stage s+1 and the backward one to stage s-1 (one
`ppermute` each). A microbatch's forward reaches the last stage in tick m + S-1, and
its backward starts there in that very tick. Each unit runs under a `lax.cond` on
whether the stage has one this tick, rather than on masked results: a masked loop
would compute the forward and the backward in all M + 2S-2 ticks, (M+2S-2)(F+B) a
step against GPipe's (M+S-1)(F+B); with the conds the idle units cost nothing and
the step is GPipe's (ticks with only forwards or only backwards are that long). The
collectives of the plan's other axes sit inside a branch every device along them takes
alike (the condition depends on the stage index only).

A stage keeps the residuals of the microbatches between their forward and backward,
at most 2(S-1-s)+1 of them, in a ring of min(M, 2S-1) microbatch slots instead of all
M of GPipe. (The S-s of an asynchronous 1F1B needs ticks of one unit each, which in a
lockstep loop last max(F, B): 2(M+S-1) max(F, B) a step, more than GPipe's when the
backward is twice the forward.) Where the layers recompute (`Remat`), the ring keeps,
per microbatch in flight, what recomputing needs (`StageRemat.extra`: the layer input
for 'full') instead of the residuals the policy drops, and the backward unit recomputes
them from its slot, as GPipe's backward ticks do from their stacks
(`_pipeline_remat`). What the head sums (the loss, the head's weight
gradients) is accumulated on the last stage and reaches every stage by one all-reduce
over the stage axis each (with the axes a deferred reduction left, `HeadLayout.deferred`).

Interleaved (`repeats` R > 1, Megatron's virtual stages) a unit is one of the stage's R
chunks of layers on one microbatch, in the order `partir.OnefSchedule` gives: the
carries go round the stages (the last stage's forward to the first stage's next chunk),
the head runs after a microbatch's last chunk, the stacked inputs are exchanged for the
chunks at rest (`_circular`), and the ring's slots come from the schedule's table (the
units' lifetimes are not first in, first out). Uneven stages and rolled layers run
padded slots, their rows exchanged in and out, as GPipe's (`_uneven`). A residual that
is a weight the forward gathers (`partir.onef_gathered`) is read from the forward's
gathered block, not kept in a ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from .._nested import split_operands
from .._pipeline import SAME, SPLIT, onef_gathered
from .._pipeline_head import onef_outputs
from .._scans import var_ids
from ._boundaries import cross
from ._pipeline_head import run_looped
from ._shardmap_pipeline import (_block, _keep, _micro, _rows, add_summed, micro_const, stacked_at_rest, stage_blocks,
                                 thin_consts)
from ._spmd import move
from ._uneven import slot_mask


def run_onef(interp, pipe, layouts, inner, head, remat, frame) -> None:
    """Run equations [forward scan, backward scan] of their region as the 1F1B tick loop
    on the blocks of `frame` (see the module docstring), putting the backward scan's
    results and what the head gives the rest of the step in `frame`; `remat`: the
    pipeline's `StageRemat` (None when its layers recompute nothing)."""
    prog, (fcall, bcall) = interp.prog, pipe.scans.calls
    region, ids = prog.regions[fcall.parent], var_ids(prog, fcall.parent)
    for i in head.hoisted:
        interp.eqn(frame, fcall.parent, i, region.jaxpr.eqns[i])
    fwd = _stage_side(interp, pipe, layouts[0], region.jaxpr.eqns[fcall.index], ids, frame, (), remat)
    bwd = _stage_side(interp, pipe, layouts[1], region.jaxpr.eqns[bcall.index], ids, frame, fcall.ys, remat)
    after = onef_outputs(prog, pipe, head)
    loop = _Loop(interp, pipe, layouts, inner, head, frame, fwd, bwd, after, remat)
    state = jax.lax.scan(loop.tick, loop.initial(), jnp.arange(loop.ticks))[0]
    _leave(interp, pipe, layouts[1], bcall, region, frame, state, loop, after)


@dataclass(frozen=True)
class _Side:
    """One pipelined scan as the tick loop runs it: its call and body, its operand ids
    (`g`) and body inputs (`w`) split as a scan's (`split_operands`), the microbatch dims
    of its body inputs (`d`), and its operands in its body's layouts (its constants as
    `thin_consts` gives them)."""

    call: object
    body: object
    g: object
    w: object
    d: object
    consts: list
    carry: list
    xs: list


def _stage_side(interp, pipe, layout, eqn, ids, frame, residuals, remat) -> _Side:
    """One scan's operands in its body's layouts: constants and the initial carry on the
    replica batch (none for the backward scan: the head makes it), the stage's blocks
    of its stacked inputs (None for a residual, which the ring holds). The forward
    scan's stacked inputs and constants that recomputing reads are saved in `remat`
    (`StageRemat.keep_inputs`), as GPipe's forward scan saves them."""
    call, body = layout.call, interp.prog.regions[layout.call.body]
    ins = [-1 if isinstance(x, Literal) else ids[x] for x in eqn.invars]
    g, w = split_operands(eqn, ins), split_operands(eqn, list(body.invars))
    later = set(residuals) | (set(g.carry) if residuals else set())  # made in the loop: the ring, the head
    read = [x.val if isinstance(x, Literal) else None if v in later else frame.read(v) for x, v in zip(eqn.invars, ins)]
    x = split_operands(eqn, read)
    consts = [cross(interp, a, u, v) for a, u, v in zip(x.consts, g.consts, w.consts)]
    carry = [cross(interp, a, u, v) for a, u, v in zip(x.carry, g.carry, w.carry)] if not residuals else []
    xs = [None if u in residuals else a for a, u in zip(x.xs, g.xs)]  # (the residuals: the ring's)
    xs = stage_blocks(interp, pipe, layout, xs, g.xs, w.xs, [False] * len(xs), again=bool(residuals))
    if remat is not None and not residuals:
        remat.keep_inputs(g, w, xs, consts)
    d = split_operands(eqn, list(layout.in_dims))
    return _Side(call, body, g, w, d, thin_consts(interp.prog, call, consts, d.consts, pipe.microbatches), carry, xs)


class _Loop:
    """The tick loop's state and one tick (see the module docstring)."""

    def __init__(self, interp, pipe, layouts, inner, head, frame, fwd, bwd, after, remat):
        self.interp, self.pipe, self.layouts, self.inner, self.head = interp, pipe, layouts, inner, head
        self.fwd, self.bwd, self.after, self.remat = fwd, bwd, after, remat
        self.S, self.M, self.R = interp.mesh.size(pipe.axis), pipe.microbatches, pipe.repeats
        self.sched = pipe.onef(self.S)
        self.ticks, self.ring = self.sched.ticks, self.sched.ring  # the ring: one slot per unit in flight
        self.split = pipe.split(self.S)
        self.chunk = self.split.chunk  # the layer slots one unit runs
        # Uneven, which of the stage's slots hold a layer (a padding slot passes its carry on).
        self.real = slot_mask(pipe.axis, self.split) if self.split.uneven else None
        self.stage = jax.lax.axis_index(pipe.axis)
        # Interleaved, the ring slot of each stage's forward units (`OnefSchedule.slots`);
        # with one repeat, microbatch m's slot is m mod the ring.
        self.table = jnp.asarray(self.sched.slots()) if self.R > 1 else None
        fcall = pipe.scans.forward
        # The residuals the backward scan reads, as positions in the forward's per-layer outputs.
        self.kept = [fcall.ys.index(v) if v >= 0 and v in fcall.ys else None for v in bwd.g.xs]
        # Those the plan recomputes are placeholders (a scalar per layer: `StageRemat`),
        # kept by no ring; the ring keeps what recomputing needs instead (`extra`).
        self.dropped = {j for j, v in enumerate(fcall.ys)
                        if remat is not None and v >= 0 and remat.placeholder(v)}
        # Those the forward's gathered block of a weight holds (a bfloat16 cast): read from
        # it, chunk by chunk, not kept in a ring (`partir.onef_gathered`).
        self.shared = _shared(interp.prog, pipe, layouts, fwd, self.dropped)
        self.ringed = [j for j in self.kept if j is not None and j not in self.dropped and j not in self.shared]
        self.extra = list(remat.extra) if remat is not None else []
        whole = {v: frame.whole[v] for v, d in zip(head.inputs, head.in_dims) if d is None and v in frame.whole}
        self.head_whole = whole
        self.head_blocks = {v: frame.read(v) for v in head.inputs if v not in whole and v not in fcall.carry_out}

    def _micro_block(self, v: int, layers: int = 0):
        """Zeros shaped as one microbatch's block of value `v` (stacked on `layers`), in
        the layout the body gives it (a weight held gathered leaves at rest: `given_out`)."""
        inner = self.inner
        val, t = inner.prog.values[v], inner.given_out(v) or inner.rest(v)
        shape = t.shard_shape(val.shape, inner.mesh)
        return jnp.zeros(((layers,) if layers else ()) + tuple(shape), val.dtype)

    def initial(self):
        per = self.chunk
        fbody, bbody = self.fwd.body, self.bwd.body
        nf, nb = len(self.fwd.call.carry), len(self.bwd.call.carry)
        recv_f = tuple(self._micro_block(w) for w in self.fwd.w.carry)
        recv_b = tuple(self._micro_block(w) for w in self.bwd.w.carry)
        outs = fbody.outvars[nf:]
        rings = tuple(self._ring(outs[j], per, self._slot_dim(j)) for j in self.ringed)
        rings += tuple(self._ring(s, per, self.remat.dims[s]) for s in self.extra)
        kept = tuple(_block(self.interp, v) for v in bbody.outvars[:nb])
        ys = tuple(_block(self.interp, v, self.split.slots * self.S, self.pipe.axis) for v in bbody.outvars[nb:])
        heads = tuple(_block(self.interp, v) for v in self.after)
        return recv_f, recv_b, rings, kept, ys, heads

    def _ring(self, v: int, layers: int, d):
        """Zeros shaped as the ring of value `v` (stacked on a chunk's `layers`; `d`: its
        microbatch dim; None: one slot, the stage's R chunks of rows)."""
        if d is None:
            return self._micro_block(v, layers * self.R)
        block = self._micro_block(v, layers)
        shape = list(block.shape)
        shape[d + 1] *= self.ring
        return jnp.zeros(shape, block.dtype)

    def _units(self, t):
        """(valid, microbatch, chunk, ring slot) of the forward and of the backward unit
        of this stage at `t` (`OnefSchedule`)."""
        sched, n = self.sched, self.sched.units
        f, b = t - self.stage, t - (sched.lag - self.stage)
        fv, bv = (f >= 0) & (f < n), (b >= 0) & (b < n)
        f, b = jnp.clip(f, 0, n - 1), jnp.clip(b, 0, n - 1)
        if self.R == 1:
            return (fv, f, 0, f % self.ring), (bv, b, 0, b % self.ring)
        (mf, rf), (mb, rb) = sched.forward_of(f), sched.backward_of(b)
        return ((fv, mf, rf, self.table[self.stage, f]),
                (bv, mb, rb, self.table[self.stage, sched.unit(mb, rb)]))

    def _chunk(self, a, r):
        """Chunk `r` of a stage's stacked block `a` (in slot order), the whole block with
        one repeat."""
        return a if self.R == 1 else jax.lax.dynamic_slice_in_dim(a, r * self.chunk, self.chunk, 0)

    def _layers(self, side, c_in, m, xs_m, reverse: bool, sums=(), r=0):
        """The stage's layers of one scan on microbatch `m`: (carry out, per-layer outputs,
        `sums`), those of its chunk `r` (a padding slot, uneven, passing its carry on and
        making zeros). Where they recompute (`remat`), the forward layers give a scalar for each
        recomputed residual and, after their outputs, what recomputing needs
        (`StageRemat.made`); the backward layers take that after their stacked inputs
        (`xs_m`), and the constants recomputing reads (`StageRemat.per_tick`). The
        backward layers add each sum over the microbatches into its kept rows `sums`
        layer by layer, in place, and give a scalar for it instead (`add_summed`)."""
        inner, call, nk, remat, nx = self.inner, side.call, len(side.call.carry), self.remat, len(side.xs)
        consts_m = [micro_const(c, i, m, self.M) for c, i in zip(side.consts, side.d.consts)]
        more = remat.per_tick(m, self.M, _micro) if remat is not None and reverse else {}
        summed = self.layouts[1].summed if reverse else (False,) * (len(self.layouts[0].out_kinds) - nk)

        masked = self.real is not None

        def layer(state, xl):
            (c, kept), row = state, xl[-1]
            xl, here = (xl[:-2], xl[-2]) if masked else (xl[:-1], None)
            if remat is not None and reverse:
                remat.enter(xl[nx:], more)
            outs = inner.region(call.body, list(consts_m) + list(c) + list(xl[:nx]))
            if masked:
                outs = [jnp.where(here, o, a) for o, a in zip(outs[:nk], c)] + [
                    jnp.where(here, o, jnp.zeros_like(o)) for o in outs[nk:]]
            if remat is None or reverse:
                added, ys = add_summed(kept, outs[nk:], summed, row, True)
                return (tuple(outs[:nk]), added), ys
            ys = tuple(jnp.zeros((), y.dtype) if j in self.dropped else y for j, y in enumerate(outs[nk:]))
            return (tuple(outs[:nk]), kept), ys + remat.made()

        rows = r * self.chunk + jnp.arange(self.chunk)
        mask = (self._chunk(self.real, r),) if masked else ()
        (c_out, sums), ys = jax.lax.scan(layer, (c_in, sums), tuple(xs_m) + mask + (rows,), reverse=reverse)
        return c_out, ys, sums

    def _forward_zeros(self, per: int) -> tuple:
        """Zeros shaped as the forward unit's per-layer outputs (see `_layers`)."""
        outs, values = self.fwd.body.outvars[len(self.fwd.call.carry):], self.inner.prog.values
        return tuple(jnp.zeros((per,), values[v].dtype) if j in self.dropped else self._micro_block(v, per)
                     for j, v in enumerate(outs)) + tuple(self._micro_block(s, per) for s in self.extra)

    def tick(self, state, t):
        recv_f, recv_b, rings, kept, ys_kept, heads = state
        (fv, mf, rf, sf), (bv, mb, rb, sb) = self._units(t)
        first, last = self.stage == 0, self.stage == self.S - 1
        fwd, bwd, R = self.fwd, self.bwd, self.R
        c0 = tuple(_micro(a, i, mf, self.M) for a, i in zip(fwd.carry, fwd.d.carry))
        c_in = tuple(jnp.where(first & (rf == 0), a, r) for a, r in zip(c0, recv_f))
        xs_f = tuple(self._chunk(_micro(a, None if i is None else i + 1, mf, self.M), rf)
                     for a, i in zip(fwd.xs, fwd.d.xs))
        zeros_f = (c_in, self._forward_zeros(self.chunk), ())
        c_f, ys_f, _ = jax.lax.cond(fv, lambda: self._layers(fwd, c_in, mf, xs_f, False, r=rf), lambda: zeros_f)
        own = last & (rb == R - 1)  # (the backward unit of the forward one just run: its residuals are ys_f)
        taken, rings = self._take(rings, ys_f, sb, own)
        rings = self._store(rings, ys_f, sf, rf, fv)
        slots = self._slots(taken, rings, sb, rb)
        grad, heads = self._head(c_f, mf, fv & last & (rf == R - 1), heads)
        c_b_in = tuple(jnp.where(own, g, r) for g, r in zip(grad, recv_b))
        xs_b = tuple(self._chunk(fwd.xs[self.shared[j]], rb) if j in self.shared else
                     self._read(slots, j) if j is not None else
                     self._chunk(_micro(a, None if i is None else i + 1, mb, self.M), rb)
                     for a, i, j in zip(bwd.xs, bwd.d.xs, self.kept))
        if self.remat is not None:  # (what recomputing reads, after the stacked inputs: whole slots,
            # then the forward's stacked inputs it saved, of the unit's chunk)
            again = self.remat.per_layer(mb, self.M, _micro, made=(slots[len(self.ringed):], 0, 1))
            n = len(self.extra)
            xs_b += again[:n] + tuple(self._chunk(a, rb) for a in again[n:])
        nb, summed = len(bwd.call.carry), self.layouts[1].summed
        sums = tuple(k for k, s in zip(ys_kept, summed) if s)
        zeros_b = (c_b_in, tuple(jnp.zeros((self.chunk,), self.inner.prog.values[v].dtype) if s
                                 else self._micro_block(v, self.chunk)
                                 for v, s in zip(bwd.body.outvars[nb:], summed)), sums)
        c_b, ys_b, sums = jax.lax.cond(bv, lambda: self._layers(bwd, c_b_in, mb, xs_b, True, sums, rb),
                                       lambda: zeros_b)
        kept, ys_kept = self._kept(kept, ys_kept, c_b, ys_b, sums, mb, rb, bv & first & (rb == 0), bv)
        axis, S = self.pipe.axis, self.S
        # (Interleaved, a carry goes round: the last stage's forward to the first stage's
        # next chunk, the first stage's backward to the last stage's previous chunk.)
        ahead = [(i, (i + 1) % S) for i in range(S)] if R > 1 else [(i, i + 1) for i in range(S - 1)]
        recv_f = tuple(jax.lax.ppermute(c, axis, ahead) for c in c_f)
        recv_b = tuple(jax.lax.ppermute(c, axis, [(j, i) for i, j in ahead]) for c in c_b)
        return (recv_f, recv_b, rings, kept, ys_kept, heads), None

    def _kept(self, kept, ys_kept, c_b, ys_b, sums, mb, rb, done, bv):
        """The backward scan's final carries (`done`: the first stage ran the first
        chunk's backward of microbatch `mb`) and per-layer outputs kept after a tick: the
        sums as the layers added them, the others in the rows of chunk `rb`."""
        lay, sums, nb, summed = self.layouts[1], iter(sums), len(self.bwd.call.carry), self.layouts[1].summed
        kept = tuple(_keep(k, c, lay.out_kinds[i], lay.out_dims[i], mb, done) for i, (k, c) in enumerate(zip(kept, c_b)))
        ys_kept = tuple(next(sums) if summed[i] else _rows(k, y, rb, lambda rows, y, i=i: _keep(
            rows, y, lay.out_kinds[nb + i], None if lay.out_dims[nb + i] is None else lay.out_dims[nb + i] + 1, mb, bv))
            for i, (k, y) in enumerate(zip(ys_kept, ys_b)))
        return kept, ys_kept

    def _slot_dim(self, j: int):
        return self.layouts[0].out_dims[len(self.fwd.call.carry) + j]

    def _store(self, rings, ys, slot, r, valid):
        """The rings with the forward unit's residuals (and what recomputing needs:
        `_layers`) written in its `slot` (one the same for every microbatch: in the rows
        of its chunk `r`)."""
        return tuple(_keep(b, y, SPLIT, d + 1, slot, valid) if d is not None else
                     _rows(b, y, r, lambda rows, y: _keep(rows, y, SAME, None, 0, valid))
                     for b, (y, d) in zip(rings, self._made(ys)))

    def _take(self, rings, ys_f, slot, own):
        """The backward unit's `slot` of each ring whose slot is one row along its
        microbatch dim (one sequence a device), read before this tick's write (None for
        the other rings, read after it: `_slots`), and the rings with each such read
        written back into its slot (where `own`, the last stage running the backward of
        the forward unit it has just run, the read is that unit's own output). Why: read
        after the write, XLA:CPU copied such a ring every tick, holding it twice; written
        back, the write reads what the read made, so XLA orders the read first and
        updates the ring in place. Where a slot has more rows XLA holds the ring once as
        it is, and a slot taken before the write would only add a buffer
        (docs/pipeline.md, "Cost model")."""
        taken, out = [], []
        for b, (y, d) in zip(rings, self._made(ys_f)):
            if d is None or b.shape[d + 1] != self.ring:
                taken.append(None)
                out.append(b)
                continue
            t = jnp.where(own, y, self._slot(b, d, slot, 0))
            taken.append(t)
            out.append(_keep(b, t, SPLIT, d + 1, slot, True))
        return taken, tuple(out)

    def _slots(self, taken, rings, slot, r) -> tuple:
        """The backward unit's slot of every ring (`r`: its chunk): those `_take` read
        before the write, the others from the written rings."""
        made = self._made_dims()
        return tuple(t if t is not None else self._slot(b, d, slot, r) for t, b, d in zip(taken, rings, made))

    def _slot(self, ring, d, slot, r):
        """Slot `slot` of `ring` (`d`: its microbatch dim; None: one slot for every
        microbatch, a row block per chunk, of which chunk `r`'s)."""
        if d is None:
            return self._chunk(ring, r)
        return _micro(ring, d + 1, slot, self.ring)

    def _made(self, ys) -> list:
        """(value, microbatch dim) of what the rings keep of the forward unit's outputs `ys`:
        the ringed per-layer outputs, then what recomputing needs (`_layers`)."""
        n = len(self.fwd.body.outvars) - len(self.fwd.call.carry)
        values = [ys[j] for j in self.ringed] + [ys[n + k] for k in range(len(self.extra))]
        return list(zip(values, self._made_dims()))

    def _made_dims(self) -> list:
        """The microbatch dim of each ring's values (None: one slot for every microbatch)."""
        return [self._slot_dim(j) for j in self.ringed] + [self.remat.dims[s] for s in self.extra]

    def _read(self, slots, j: int):
        """The backward unit's residuals of forward output `j`: its ring's slot (`_slots`),
        or for a recomputed one its placeholder: zeros, which the backward layers do not
        read."""
        if j in self.dropped:
            return jnp.zeros((self.chunk,), self.inner.prog.values[self.fwd.call.ys[j]].dtype)
        return slots[self.ringed.index(j)]

    def _head(self, c_f, m, run, heads):
        """The head on microbatch `m` where `run` (the last stage with a forward unit):
        (the backward scan's initial carry, the head's outputs for the rest of the step
        kept as their kinds say)."""
        inner, head = self.inner, self.head
        fcall, bcall = self.pipe.scans.calls
        fbody = self.fwd.body
        carry_in = self.bwd.w.carry

        def run_head():
            given = {r: move(c, inner.rest(w), inner.rest(r), inner.move_mesh)
                     for c, w, r in zip(c_f, fbody.outvars, fcall.carry_out) if r >= 0}
            f = run_looped(inner, head, self.head_whole, self.head_blocks, m, given)
            grad = tuple(cross(inner, f.read(u), u, w) for u, w in zip(bcall.carry, carry_in))
            return grad, tuple(f.read(v) for v in self.after)

        zeros = (tuple(self._micro_block(w) for w in carry_in), tuple(self._micro_block(v) for v in self.after))
        grad, made = jax.lax.cond(run, run_head, lambda: zeros)
        kinds = dict(zip(head.outputs, zip(head.out_kinds, head.out_dims)))
        heads = tuple(_keep(b, y, *kinds[v], m, run) for b, y, v in zip(heads, made, self.after))
        return grad, heads


def _shared(prog, pipe, layouts, fwd: _Side, dropped) -> dict:
    """Forward output j -> the forward's stacked input k whose gathered block (`fwd.xs[k]`)
    is that residual (`partir.onef_gathered`), but for recomputed ones (`dropped`)."""
    shared = onef_gathered(prog, pipe, layouts)
    held = {g.value: g.input for g in layouts[0].gathered}
    outs = fwd.body.outvars[len(fwd.call.carry):]
    return {j: fwd.w.xs.index(held[outs[j]]) for j, outer in enumerate(fwd.call.ys)
            if outer in shared and j not in dropped}


def _leave(interp, pipe, layout, call, region, frame, state, loop, after) -> None:
    """Put the backward scan's results (its final carry from the first stage, its
    per-layer outputs at rest) and the head's outputs (summed over the stage axis, where
    only the last stage made them) in `frame`."""
    _, _, _, kept, ys_kept, heads = state
    body, nk = interp.prog.regions[call.body], len(call.carry)
    results = region.eqn_results[call.index]
    first = jax.lax.axis_index(pipe.axis) == 0
    for c, v, r in zip(kept, body.outvars[:nk], results[:nk]):
        if r >= 0:
            frame.put(r, move(jax.lax.psum(jnp.where(first, c, jnp.zeros_like(c)), pipe.axis), interp.rest(v),
                              interp.rest(r), interp.move_mesh))
    ys = stacked_at_rest(interp, pipe, layout, ys_kept, body.outvars[nk:], results[nk:], [False] * len(ys_kept))
    for y, r in zip(ys, results[nk:]):
        if r >= 0:
            frame.put(r, y)
    for v, a in zip(after, heads):
        axes = tuple(x for x in interp.mesh.names if x in loop.head.left_partial(v) or x == pipe.axis)
        frame.put(v, jax.lax.psum(a, axes))
