"""A pipelined layer scan as each device runs it inside the `shard_map` lowering.

Device s along the stage axis holds the layers [s*L/S, (s+1)*L/S) of a layer scan (its
stacked inputs' blocks). The scan runs as M + S - 1 ticks of one loop (GPipe): at tick
t the device at position p along the flow (p = s forward, S-1-s for the backward scan,
which runs the layers in reverse) runs its layers on microbatch t - p when there is
one, then sends the carry it made (an activation forward, its gradient backward) to
the next position with one `ppermute`; the first position takes a fresh microbatch of
the scan's initial carry instead. A tick without a microbatch (the bubble) computes on
what it holds and writes nothing. Each per-layer output is kept as the microbatch's
block of its split dim, summed over microbatches, or kept once (`partir.ScanLayout`);
the last position's final carries are sent to every stage (one all-reduce over the
stage axis of the carry, zeros elsewhere), whole along it as the plan keeps them. A sum
(a weight's gradient) is added into its kept rows by each layer as it makes it, in
place: stacked over the stage's layers first, it was a second stage-sized buffer of
every such gradient in each tick.

With `repeats` R > 1 (the circular schedule) the loop has M*R + S - 1 ticks of one
chunk of L/(S*R) layers each, the sends form a ring (the last position sends to the
first, where a microbatch's carry waits for its next round), and the stacked values are
exchanged for the chunks the stage runs on the way in and back on the way out
(`_circular`), but for the residuals kept in that order between the two scans
(`partir.kept_in_slots`). With uneven stages (S, or S*R, not dividing L) or layers
rolled from unrolled ones each stage runs ceil(L/S) layer slots (circular: R chunks of
ceil(L/(S*R))), a padding slot passing its carry on, and its rows of the stacked values
are exchanged in and out of their [L, ...] layout (`_uneven`), already in the circular
schedule's slot order, but for the residuals kept as the stages' blocks between the
two scans.

The body runs on the blocks of the microbatched partitioning (`partir.microbatched`) by
an interpreter whose moves leave the microbatch axis out: a sum over microbatches is
completed by the accumulation here, not by a collective. Where the plan recomputes the
layers' residuals (`Remat`), the forward ticks keep what recomputing needs instead and
the backward ticks hand it to the body (`_pipeline_remat.StageRemat`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .._errors import PartitioningError
from .._nested import split_operands
from .._pipeline import SAME, SPLIT, SUM, kept_in_slots, made_at, state_dim
from .._uniform import uniform_dims
from .._tiling import Tiling
from ._boundaries import cross
from ._circular import from_slots, to_slots
from ._local import LocalOp, bind_local
from ._spmd import move
from ._uneven import from_stage_rows, slot_mask, stage_rows, to_stage_rows, whole_rows


def _micro(a, dim, m, count: int):
    """Microbatch `m` (traced) of block `a`, cut along `dim` into `count` (all when None)."""
    if dim is None:
        return a
    n = a.shape[dim] // count
    return jax.lax.dynamic_slice_in_dim(a, m * n, n, dim)


def thin_consts(prog, call, consts, dims, count: int) -> list:
    """The stage's constants `consts` of pipelined scan `call` (blocks in its body's
    layouts; `dims`: their microbatch dims, `count` microbatches) as the tick loop takes
    them: `(block, None)`, cut per microbatch (`micro_const`), but for one that holds the
    same entries along its microbatch dim (a causal mask broadcast to the batch:
    `partir.uniform_dims`), `(its first row along every such dim, one microbatch's
    block shape)`, broadcast in each tick; XLA then makes no mask of the whole batch."""
    out = []
    for a, o, dim in zip(consts, call.consts, dims):
        same = uniform_dims(prog, o) if dim is not None and o >= 0 else frozenset()
        if dim not in same:
            out.append((a, None))
            continue
        shape = tuple(n // count if k == dim else n for k, n in enumerate(a.shape))
        out.append((a[tuple(slice(0, 1) if k in same else slice(None) for k in range(a.ndim))], shape))
    return out


def micro_const(const, dim, m, count: int):
    """Microbatch `m` (traced) of a constant as `thin_consts` gives it, cut along `dim`
    into `count`, or broadcast to a microbatch's block."""
    a, shape = const
    return _micro(a, dim, m, count) if shape is None else jnp.broadcast_to(a, shape)


def _keep(buf, y, kind: str, dim, m, valid):
    """`buf` with output `y` of microbatch `m` kept as `kind` says, where `valid`."""
    if kind == SUM:
        return buf + jnp.where(valid, y, jnp.zeros_like(y))
    if kind == SPLIT:
        y = jax.lax.dynamic_update_slice_in_dim(buf, y, m * y.shape[dim], dim)
    return jnp.where(valid, y, buf)


def _block(interp, v: int, layers: int = 0, axis: str | None = None):
    """Zeros shaped as one device's block of value `v` at rest or, given `layers` and the
    stage `axis`, of `v` stacked on a leading layer dim split over it."""
    if v < 0:
        raise PartitioningError("a pipelined scan's body gives a literal as a result; it cannot be pipelined")
    val, rest = interp.prog.values[v], interp.rest(v)
    if axis is None:
        return jnp.zeros(rest.shard_shape(val.shape, interp.mesh), val.dtype)
    t = Tiling(((axis,),) + rest.dims)
    return jnp.zeros(t.shard_shape((layers,) + tuple(val.shape), interp.mesh), val.dtype)


def run_pipelined(interp, pipe, layout, inner, remat, eqn, ins, results, operands, whole) -> list:
    """The results (blocks at rest) of the pipelined scan `eqn` (see the module docstring);
    `inner` is the interpreter of the microbatched partitioning, `remat` the pipeline's
    `StageRemat` (None when its layers recompute nothing)."""
    prog, call = interp.prog, layout.call
    body = prog.regions[call.body]
    operands = [move(whole[k], Tiling.replicated(jnp.ndim(whole[k])), interp.rest(v), interp.move_mesh)
                if k in whole else a for k, (a, v) in enumerate(zip(operands, ins))]
    g, w, x = split_operands(eqn, ins), split_operands(eqn, list(body.invars)), split_operands(eqn, operands)
    split = pipe.split(interp.mesh.size(pipe.axis))
    for v in g.xs:
        if v >= 0 and not split.exchanged and interp.rest(v).dims[0] != (pipe.axis,):
            raise PartitioningError(f"{prog.name(v)} is laid out {interp.rest(v)}: a pipelined scan's stacked "
                                    f"inputs are split along their layer dim over {pipe.axis!r} alone")
    consts = [cross(interp, a, u, v) for a, u, v in zip(x.consts, g.consts, w.consts)]
    carry = [cross(interp, a, u, v) for a, u, v in zip(x.carry, g.carry, w.carry)]
    # (A recomputed residual's placeholder, a scalar per layer, as it is.)
    held = [remat is not None and u >= 0 and remat.placeholder(u) for u in g.xs]
    xs = stage_blocks(interp, pipe, layout, x.xs, g.xs, w.xs, held, again=call == pipe.scans.backward)
    if remat is not None and call.body == remat.fwd:
        remat.keep_inputs(g, w, xs, consts)
    drop = [remat is not None and r >= 0 and remat.placeholder(r) for r in results[len(carry):]]
    kept, ys_kept = _tick_loop(interp, pipe, layout, inner, remat, split_operands(eqn, list(layout.in_dims)),
                               consts, carry, xs, held, drop)
    last = jax.lax.axis_index(pipe.axis) == (interp.mesh.size(pipe.axis) - 1 if not call.reverse else 0)
    finals = [move(jax.lax.psum(jnp.where(last, c, jnp.zeros_like(c)), pipe.axis), interp.rest(v), interp.rest(r),
                   interp.move_mesh) if r >= 0 else c for c, v, r in zip(kept, w.carry, results[:len(carry)])]
    return finals + stacked_at_rest(interp, pipe, layout, ys_kept, body.outvars[len(carry):], results[len(carry):],
                                    drop)


def stage_blocks(interp, pipe, layout, xs, outer, inner, held, *, again: bool) -> list:
    """The stage's blocks of a pipelined scan's stacked inputs `xs` (scan operands
    `outer`, body inputs `inner`) as its tick loop reads them, in this order: uneven
    stages' (or rolled layers') padded rows exchanged or taken from the [L, ...] values
    (`_uneven`); moved once to the layouts the layers read, as a scan's are; the circular
    schedule's chunks exchanged into the order the stage runs them (`_circular`: at rest,
    before the gathers; exchanged rows arrive in that order already); the weights the
    layers read gathered, gathered once (`gather_once`; `again`: the backward scan's).
    A None stays None (1F1B's residuals: its ring holds them), those `held` marks are not
    moved (a recomputed residual's placeholder), and the residuals the stages keep in
    their slot order, or as their own blocks, from one scan to the other are not
    exchanged (`kept_in_slots`)."""
    split, repeats = pipe.split(interp.mesh.size(pipe.axis)), pipe.repeats
    slots = kept_in_slots(interp.part, pipe)
    xs = [_rows_in(a, interp.rest(u), pipe.axis, split) if a is not None and split.exchanged and u not in slots
          else a for a, u in zip(xs, outer)]
    xs = [a if a is None or h else move(a, Tiling(((),) + interp.rest(u).dims[1:]).without_axes((pipe.axis,)),
                                        Tiling(((),) + interp.rest(v).dims), interp.move_mesh)
          for a, u, v, h in zip(xs, outer, inner, held)]
    if repeats > 1 and not split.exchanged:
        xs = [a if a is None or u in slots else to_slots(a, pipe.axis, split.stages, repeats) for a, u in zip(xs, outer)]
    return gather_once(interp, layout, xs, inner, again=again)


def stacked_at_rest(interp, pipe, layout, ys, outs, results, drop) -> list:
    """A pipelined scan's per-layer outputs `ys` as the tick loop kept them (body outputs
    `outs`, scan results `results`) at rest: the gradients accumulated whole along their
    reduce-scatter's axes (`ScanLayout.widened`) reduce-scattered first where the rows
    go back to the [L, ...] layout or the chunks to contiguous blocks (either exchange
    moves the blocks at rest), the rows or chunks exchanged back (but the residuals kept
    in slot order: `kept_in_slots`), then moved from where the stage program made them
    (`made_at`). Those of an unread result, or that `drop` marks (a recomputed
    residual's placeholder), as they are."""
    split, repeats = pipe.split(interp.mesh.size(pipe.axis)), pipe.repeats
    slots = kept_in_slots(interp.part, pipe)
    scattered = {v for v, _ in layout.widened} if split.exchanged or repeats > 1 else set()
    ys = _scatter_rows(interp, layout, ys, outs, scattered)
    out = []
    for y, v, r, dropped in zip(ys, outs, results, drop):
        if r < 0 or dropped:
            out.append(y)
            continue
        if split.exchanged and r not in slots:  # back to the [L, ...] layout
            y = _rows_out(y, interp.rest(r), pipe.axis, split)
        elif repeats > 1 and not split.exchanged and r not in slots:
            y = from_slots(y, pipe.axis, split.stages, repeats)
        t = made_at(pipe, split, interp.part.tiling(v) if v in scattered else interp.rest(v), interp.rest(r), slots,
                    r, () if v in scattered else layout.left_partial(v))
        out.append(move(y, t, interp.rest(r), interp.move_mesh))
    return out


def _scatter_rows(interp, layout, ys, outs, scattered) -> list:
    """Per-layer outputs `ys` (of body outputs `outs`), those in `scattered` (gradients
    accumulated whole along their reduce-scatter's axes, `ScanLayout.widened`, of uneven
    stages or rolled layers) reduce-scattered on the stage's rows to the body's layout, before the rows
    are exchanged back to the [L, ...] layout (even stages reduce-scatter them on the
    way to rest, which is the same collective)."""
    return [move(y, Tiling(((),) + interp.rest(v).dims, layout.left_partial(v), "sum"),
                 Tiling(((),) + interp.part.tiling(v).dims), interp.move_mesh) if v in scattered else y
            for y, v in zip(ys, outs)]


def gather_once(interp, layout, xs, ws, *, again: bool) -> list:
    """The stage's stacked blocks `xs` (of body inputs `ws`, in their body layouts) with
    those the layers read gathered (`ScanLayout.gathered`) gathered once, before the
    tick loop, to the layout they read (the microbatched plan's interpreter holds them
    there: `Interpreter.held`), cast first where the layers read a cast of them
    (`Gathered.ops`: casts and broadcasts, run on each layer's block). `again` (the
    backward scan): gathered anew, in a form XLA does not merge with the forward scan's
    gather of the same weight, so that the forward's copy need not stay live across the
    head (`_spmd.move`)."""
    gathered = {g.input: g for g in layout.gathered}
    out = []
    for a, v in zip(xs, ws):
        g = gathered.get(v)
        if g is not None:
            for o in g.ops:
                a = jax.vmap(functools.partial(_per_layer, interp, interp.prog.ops[o]))(a)
            a = move(a, Tiling(((),) + interp.rest(g.value).dims), Tiling(((),) + g.layout.dims), interp.move_mesh,
                     again=again)
        out.append(a)
    return out


def _per_layer(interp, op, a):
    """Op `op` (a cast or a broadcast, `Gathered.ops`) on one layer's block `a` of its
    operand, at rest (a broadcast made at the block's shapes)."""
    eqn, (v,), (r,) = op.eqn, op.operands, op.results
    local = LocalOp(eqn, (interp.rest(v),), (interp.rest(r),), (interp.prog.values[v].shape,),
                    (interp.prog.values[r].shape,), interp.mesh)
    return bind_local(local, [a])[0]


def _rows_in(a, rest: Tiling, axis: str, split):
    """The stage's padded rows of stacked input `a` (at rest `rest`) under uneven stages."""
    dim = state_dim(rest, axis)
    return stage_rows(a, axis, split) if dim is None else to_stage_rows(a, axis, split, dim)


def _rows_out(y, rest: Tiling, axis: str, split):
    """Stacked output rows `y` of uneven stages in the [L, ...] layout its result (at
    rest `rest`) keeps along the stage axis."""
    dim = state_dim(rest, axis)
    return whole_rows(y, axis, split) if dim is None else from_stage_rows(y, axis, split, dim)


@dataclass(frozen=True)
class _Ticks:
    """Where a stage is in the tick loop: S stages, M microbatches, R repeats. The stage
    at position `pos` along the flow runs unit u = t - pos at tick t (M*R units: repeat
    u // M of microbatch u % M), on its chunk slot u // M (forward) or R-1 - u // M (the
    backward scan, which runs the chunks in reverse)."""

    stages: int
    microbatches: int
    repeats: int
    forward: bool

    @property
    def count(self) -> int:
        """Ticks of the loop: M*R + S - 1."""
        return self.microbatches * self.repeats + self.stages - 1

    def perm(self) -> list:
        """The sends after each tick, position p to p+1 (and, circular, the last back to
        the first), as stage pairs."""
        step, n = (1 if self.forward else -1), self.stages
        if self.repeats == 1:
            return [(i, i + step) for i in range(n) if 0 <= i + step < n]
        return [(i, (i + step) % n) for i in range(n)]

    def unit(self, t, pos):
        """(valid, microbatch, repeat, slot) of the unit position `pos` runs at tick `t`."""
        u = t - pos
        units = self.microbatches * self.repeats
        valid = (u >= 0) & (u < units)
        u = jnp.clip(u, 0, units - 1)
        k = u // self.microbatches
        return valid, u % self.microbatches, k, k if self.forward else self.repeats - 1 - k


def _rows(buf, y, slot, fn):
    """`buf` with `fn(rows, y)` written back in place of the rows of chunk `slot` (as
    many rows as `y`'s leading dim), or `fn(buf, y)` when `y` covers `buf`."""
    n = y.shape[0]
    if n == buf.shape[0]:
        return fn(buf, y)
    rows = jax.lax.dynamic_slice_in_dim(buf, slot * n, n, 0)
    return jax.lax.dynamic_update_slice_in_dim(buf, fn(rows, y), slot * n, 0)


def add_summed(sums, ys, summed, row, valid) -> tuple:
    """(the kept rows `sums` of the per-layer outputs `ys` that are sums over the
    microbatches (`summed`, `ScanLayout.summed`), each such output added into its row
    `row` in place where `valid`; `ys` with a scalar in place of those). A layer adds
    its gradient as it makes it: stacked over the stage's layers and added after, it
    would be a second stage-sized buffer of every such gradient in each tick."""
    made = [y for y, s in zip(ys, summed) if s]
    return (tuple(_add_row(b, y, row, valid) for b, y in zip(sums, made)),
            tuple(jnp.zeros((), y.dtype) if s else y for y, s in zip(ys, summed)))


def _add_row(buf, y, row, valid):
    """`buf` with `y` added to its row `row` (its leading dim), in place, where `valid`."""
    now = jax.lax.dynamic_index_in_dim(buf, row, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf, now + jnp.where(valid, y, jnp.zeros_like(y)), row, 0)


def _first_input(fresh, recv, held, k, mc, ticks: _Ticks):
    """The carry the first position runs: a fresh microbatch in the first repeat, then
    the last position's output of the same microbatch's previous repeat (`recv` this
    very tick when M == S, else kept in `held`, one slot per microbatch)."""
    if ticks.repeats == 1:
        return fresh
    back = recv if held is None else jax.lax.dynamic_index_in_dim(held, mc, 0, keepdims=False)
    return jnp.where(k == 0, fresh, back)


def _initial(interp, pipe, call, carry, d, drop, extra, waits: bool) -> tuple:
    """The tick loop's state before the first tick: zeros for the received carries, the
    carries waiting for their next round (`waits`: one per microbatch), the final
    carries, the per-layer outputs and what recomputing needs."""
    prog, body, nk = interp.prog, interp.prog.regions[call.body], len(carry)
    M, S = pipe.microbatches, interp.mesh.size(pipe.axis)
    slots = pipe.split(S).slots  # a stage's layers (padded to ceil(L/S) when uneven)
    recv = tuple(jnp.zeros_like(_micro(a, i, 0, M)) for a, i in zip(carry, d.carry))
    back = tuple(jnp.zeros((M,) + r.shape, r.dtype) for r in recv) if waits else ()
    kept = tuple(_block(interp, v) for v in body.outvars[:nk])
    ys_kept = tuple(jnp.zeros((slots,), prog.values[v].dtype) if dropped else
                    _block(interp, v, slots * S, pipe.axis) for v, dropped in zip(body.outvars[nk:], drop))
    made_kept = tuple(_block(interp, s, slots * S, pipe.axis) for s in extra)
    return recv, back, kept, ys_kept, made_kept


def _unit_xs(xs, d, held, mc, M: int, recomputing: tuple, real, start, chunk: int) -> tuple:
    """A unit's per-layer inputs (what its layer scan slices): the stage's stacked inputs
    at microbatch `mc` (a recomputed residual's placeholder `held` as it is), the
    recomputing inputs `recomputing`, the padding mask `real` (None: even stages), and,
    under the circular schedule, only the unit's chunk of them, from slot `start` (None:
    one chunk)."""
    out = tuple(a if h else _micro(a, None if i is None else i + 1, mc, M) for a, i, h in zip(xs, d.xs, held))
    out += recomputing + ((real,) if real is not None else ())
    if start is None:
        return out
    return tuple(jax.lax.dynamic_slice_in_dim(a, start, chunk, 0) for a in out)


def _waiting(back, recv, t, S: int, M: int) -> tuple:
    """The carries waiting at the first position for their next round, one per
    microbatch, with the last position's output of unit t - S (`recv`) kept."""
    return tuple(jnp.where(t >= S, jax.lax.dynamic_update_index_in_dim(b, r, (t - S) % M, 0), b)
                 for b, r in zip(back, recv))


def _kept_ys(ys_kept, ys, sums, summed, drop, layout, nk: int, slot, mc, valid) -> tuple:
    """The per-layer outputs kept after a tick: the sums as the layers added them
    (`sums`), the dropped ones as they were, the others with the tick's stacks `ys` kept
    in the rows of chunk `slot` as their kinds say (`_keep`, microbatch `mc`)."""
    kinds, dims, sums = layout.out_kinds[nk:], layout.out_dims[nk:], iter(sums)
    return tuple(next(sums) if s else b if dropped else _rows(b, y, slot, lambda rows, y, k=k, dim=dim: _keep(
        rows, y, k, None if dim is None else dim + 1, mc, valid))
        for b, y, s, dropped, k, dim in zip(ys_kept, ys, summed, drop, kinds, dims))


def _kept_made(made_kept, made, extra, remat, slot, mc, valid) -> tuple:
    """What recomputing needs (`extra`, made by the forward ticks), kept after a tick
    with the tick's `made` in the rows of chunk `slot`, microbatch `mc`."""
    return tuple(_rows(b, y, slot, lambda rows, y, s=s: _keep(
        rows, y, SAME if remat.dims[s] is None else SPLIT, None if remat.dims[s] is None else remat.dims[s] + 1,
        mc, valid)) for s, b, y in zip(extra, made_kept, made))


def _tick_loop(interp, pipe, layout, inner, remat, d, consts, carry, xs, held, drop):
    """The stage's M*R + S - 1 ticks: (the final carries kept by the last position, the
    per-layer outputs kept over the microbatches). `held[k]`: stacked input k is a
    recomputed residual's placeholder; `drop[k]`: per-layer output k is."""
    call = layout.call
    nk, M, S, forward = len(carry), pipe.microbatches, interp.mesh.size(pipe.axis), not call.reverse
    ticks = _Ticks(S, M, pipe.repeats, forward)
    split = pipe.split(S)
    chunk = split.slots // pipe.repeats
    real = slot_mask(pipe.axis, split) if split.uneven else None  # the slots holding a layer
    saving = remat is not None and call.body == remat.fwd and bool(remat.extra)
    reading = remat is not None and call.body == remat.bwd
    extra = remat.extra if saving else ()
    pos = jax.lax.axis_index(pipe.axis) if forward else S - 1 - jax.lax.axis_index(pipe.axis)
    first, last = pos == 0, pos == S - 1
    perm = ticks.perm()
    kinds, dims = layout.out_kinds, layout.out_dims
    waits = pipe.repeats > 1 and M > S  # the first position keeps returning carries until their turn
    consts = thin_consts(interp.prog, call, consts, d.consts, M)

    summed = tuple(s and not dropped for s, dropped in zip(layout.summed, drop))  # (`add_summed`)

    def layer(state, xl, consts_m, more, base, valid):
        c, sums = state
        xl, row = xl[:-1], base + xl[-1]
        if real is not None:  # a padding slot passes its carry on and makes zeros
            here, xl = xl[-1], xl[:-1]
        if reading:
            remat.enter(xl[len(xs):], more)
        outs = inner.region(call.body, list(consts_m) + list(c) + list(xl[:len(xs)]))
        if real is not None:
            outs = [jnp.where(here, o, a) for o, a in zip(outs[:nk], c)] + [
                jnp.where(here, o, jnp.zeros_like(o)) for o in outs[nk:]]
        added, ys = add_summed(sums, outs[nk:], summed, row, valid)
        ys = tuple(jnp.zeros((), y.dtype) if dropped else y for y, dropped in zip(ys, drop))
        return (tuple(outs[:nk]), added), (ys, remat.made() if saving else ())

    def tick(state, t):
        recv, back, kept, ys_kept, made_kept = state
        valid, mc, k, slot = ticks.unit(t, pos)
        back = _waiting(back, recv, t, S, M) if waits else back
        c_in = tuple(jnp.where(first, _first_input(_micro(a, i, mc, M), r, b if waits else None, k, mc, ticks), r)
                     for a, i, r, b in zip(carry, d.carry, recv, back or recv))
        consts_m = [micro_const(c, i, mc, M) for c, i in zip(consts, d.consts)]
        more = remat.per_tick(mc, M, _micro) if reading else {}
        xs_m = _unit_xs(xs, d, held, mc, M, remat.per_layer(mc, M, _micro) if reading else (), real,
                        slot * chunk if pipe.repeats > 1 else None, chunk)
        sums = tuple(b for b, s in zip(ys_kept, summed) if s)
        (c_out, sums), (ys, made) = jax.lax.scan(
            lambda st, xl: layer(st, xl, consts_m, more, slot * chunk, valid), (c_in, sums),
            xs_m + (jnp.arange(chunk),), reverse=not forward)
        done = valid & last & (k == pipe.repeats - 1)
        kept = tuple(_keep(b, c, kinds[i], dims[i], mc, done) for i, (b, c) in enumerate(zip(kept, c_out)))
        ys_kept = _kept_ys(ys_kept, ys, sums, summed, drop, layout, nk, slot, mc, valid)
        made_kept = _kept_made(made_kept, made, extra, remat, slot, mc, valid)
        recv = tuple(jax.lax.ppermute(c, pipe.axis, perm) for c in c_out)
        return (recv, back, kept, ys_kept, made_kept), None

    state = _initial(interp, pipe, call, carry, d, drop, extra, waits)
    (_, _, kept, ys_kept, made_kept), _ = jax.lax.scan(tick, state, jnp.arange(ticks.count))
    if saving:
        remat.keep_made(made_kept)
    return kept, ys_kept
