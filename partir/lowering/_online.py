"""Ring attention with an online softmax, as each device runs it in the shard_map
lowering (`partir.online_attentions` finds the attentions it can run).

Forward, at the combine dot (`P V`): the device's queries meet one key and value block
at a time as the blocks travel round the context axis (`jax.lax.ppermute`, sent
before the block's work so that XLA may overlap them). Per block, the program's own
score dot and chain of ops (scale, mask: the blocks of their constants made as
blocks, `_online_masks`) give the block's logits; a running max and sum per query row
rescale the output accumulator (flash attention's online softmax). Only the output
and the row log-sum-exp are kept for the backward pass. No device holds more than one
`[.., S/n, .., S/n]` block of scores.

Backward, at the first of its dots: the keys and values go round again, each block's
weights recomputed from the queries, the key block and the saved log-sum-exp; the
queries' gradient accumulates where the queries are, and the keys' and values'
gradient of each block travels with the block, one device adding its part per step,
and reaches the device holding the block one send after the last step (the block's
own device adds its part at the end). Sends: `n - 1` per key or value rotation and per
partial sum, as the ring dots the plan lists (`partir.ring_moves`) count them.

Each runs where its ops are: in a loop's body it runs once per iteration. A forward
pass alone (`partir.OnlineForward`: a checkpointed layer's first pass) keeps nothing.
Across a layer scan pair (`partir.OnlineAcrossScans`) the forward body stacks the
output and log-sum-exp (`SavedRows`) in the slot of one score-shaped residual and a
scalar in the others' (`OnlineRings.unmoved`: they cross the loops' boundaries as
the device made them), and the backward body reads them from its slice.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .._graph import made_from_scalars
from .._online import OnlineAttention, OnlineForward, Unmatched, online_reason
from .._online_scans import OnlineAcrossScans, online_attentions
from .._tiling import Tiling
from ._eval import bind_equation
from ._ring import _next
from ._online_masks import BlockConstants, tiling_spec


class SavedRows(NamedTuple):
    """What a blockwise attention's forward pass leaves its backward pass: this device's
    output rows and their log-sum-exp (a layer scan stacks them per layer, unmoved)."""

    out: object
    lse: object


class OnlineRings:
    """The blockwise attentions of one interpreter's plan: which ops they replace, and
    what each forward pass leaves its backward pass (output and log-sum-exp)."""

    def __init__(self, interp, enabled: bool):
        self.interp = interp
        self.found: dict[int, OnlineForward] = {}  # its subclasses included
        if enabled:
            for m in online_attentions(interp.prog):
                reason = m.reason if isinstance(m, Unmatched) else online_reason(interp.part, m, interp.rings)
                if reason is None:
                    self.found[m.attention.score] = m
                elif interp.rings:
                    name = interp.prog.name(interp.prog.ops[m.score if isinstance(m, Unmatched) else m.attention.score]
                                            .results[0])
                    warnings.warn(f"ring attention on {name} keeps the program's softmax (each device holds its "
                                  f"query rows' whole scores): {reason}", stacklevel=2)
        self.ops = {o: m for m in self.found.values() for o in m.ops}
        # Residuals stacked across a layer scan pair as this device made them (`SavedRows`
        # or a scalar per layer): they cross the loops' boundaries unmoved.
        self.unmoved = {v for m in self.found.values() if isinstance(m, OnlineAcrossScans)
                        for vs in (m.saved, *m.dropped) for v in vs}
        self.values = {r for m in self.found.values() for o in m.ops for r in interp.prog.ops[o].results}
        self.constants = BlockConstants(interp, self._whole)
        self.clear()

    def clear(self) -> None:
        """Forget the previous trace's saved outputs (per score dot: output and
        log-sum-exp) and the constants made whole."""
        self.saved: dict[int, SavedRows] = {}
        # By (region traced, value): a constant made while tracing one loop body is a
        # value of that body's trace, which another body (the backward scan's, reaching
        # the forward's mask through the scans' links) must not close over: JAX would
        # lift the dead tracer into the step's arguments (a crash from its second call).
        self.wholes: dict[tuple[int, int], object] = {}
        self.tracing: int | None = None  # the region whose trace makes the constants now

    def skips(self, frame, results) -> bool:
        """Does a nested call making `results` make only values of a blockwise attention
        and values made from scalars? Then it is not run: the latter are made whole
        (the mask a `jnp.where` returns for its gradient), the former never exist."""
        if not self.values or not any(r in self.values for r in results):
            return False
        self.tracing = self.interp.prog.values[results[0]].region
        free = made_from_scalars(self.interp.prog)
        if not all(r < 0 or r in self.values or free[r] for r in results):
            return False
        for r in results:
            if r >= 0 and r not in self.values:
                frame.make_whole(r, self._whole(r))
        return True

    def run(self, frame, oid: int) -> None:
        """Op `oid` of a blockwise attention: its forward pass at the combine dot, its
        backward pass (an `OnlineAttention`'s) at the first backward dot; every other op
        has nothing to do."""
        m = self.ops[oid]
        a = m.attention
        self.tracing = self.interp.prog.ops[oid].region
        if oid == a.combine:
            self._forward(frame, m)
        elif oid in m.backward_dots and not frame.has(self.interp.prog.ops[m.grad_values].results[0]):
            self._backward(frame, m)  # once per run of the region: it makes the four dots' results

    # -- the pieces ------------------------------------------------------------------
    def _whole(self, v: int):
        """Value `v` (made from scalars) whole, in the plan's token order."""
        cache, key = self.wholes, (self.tracing, v)
        if key in cache:
            return cache[key]
        prog = self.interp.prog
        p = prog.producer[v]
        if p < 0:
            x = jnp.asarray(_unlinked(prog, v))
        elif prog.ops[p].link:
            x = self._whole(prog.ops[p].operands[0])
        else:
            op = prog.ops[p]
            args = [x.val if u < 0 else self._whole(u) for x, u in zip(op.eqn.invars, op.operands)]
            outs = bind_equation(op.eqn, args)
            x = self.interp.order.made(v, outs[op.results.index(v)])
        cache[key] = x
        return x

    def _logits(self, m, scores, block, size: int):
        """The chain's result (the softmax's input) on one block of the scores, key
        block `block` of `size` keys; the chain's constants cut to the same block."""
        prog, part, mesh = self.interp.prog, self.interp.part, self.interp.mesh
        x = scores
        for o, key in zip(m.chain, m.chain_key_dims):
            op = prog.ops[o]
            if op.link:
                continue
            slots = part.block_layout(o)[0]
            args = []
            for k, (var, u) in enumerate(zip(op.eqn.invars, op.operands)):
                if u < 0:
                    args.append(var.val)
                elif _is_chain(prog, m, o, u):
                    args.append(x)
                elif not prog.values[u].shape:
                    args.append(self._whole(u))
                else:  # this device's rows, the key block's columns
                    need = next(Tiling(d) for side, j, _, d in slots if side == "operand" and j == k)
                    spec = tiling_spec(need, prog.values[u].shape, mesh)
                    spec[key] = (block * size, size)
                    args.append(self.constants.block(u, tuple(spec)))
            x = bind_equation(op.eqn, args)[0]
        return x

    def _forward(self, frame, m) -> None:
        interp, a = self.interp, m.attention
        prog = interp.prog
        score, combine = prog.ops[a.score], prog.ops[a.combine]
        ring = interp.rings[a.score]
        n = interp.mesh.size(ring.axis)
        q = interp.read_operand(frame, a.score, score.operands.index(a.query))
        keys = interp.read_operand(frame, a.score, score.operands.index(a.key))
        values = interp.read_operand(frame, a.combine, combine.operands.index(a.value))
        size = keys.shape[a.key_dim]
        me = jax.lax.axis_index(ring.axis)
        kd = m.key_dim
        cast = prog.values[m.read].dtype  # P as P V reads it (a bfloat16 step casts it)
        row_max = row_sum = acc = None
        for s in range(n):
            block = (me - s) % n
            if s + 1 < n:
                sent = (_next(keys, ring.axis, n), _next(values, ring.axis, n))
            x = self._logits(m, _dot(score, a.key, keys, q), block, size)
            top = jnp.max(x, axis=kd, keepdims=True)
            new_max = top if row_max is None else jnp.maximum(row_max, top)
            safe = jnp.where(jnp.isneginf(new_max), 0, new_max)  # a row masked to -inf so far
            p = jnp.exp(x - safe)
            # Summed over the blocks in the statistics' precision, as one dot over the
            # whole row sums internally; cast to the program's dtype once at the end.
            pv = _dot(combine, a.value, values, p.astype(cast), preferred_element_type=p.dtype)
            if row_max is None:
                row_sum, acc = jnp.sum(p, axis=kd, keepdims=True), pv
            else:
                scale = jnp.exp(row_max - safe)
                row_sum = row_sum * scale + jnp.sum(p, axis=kd, keepdims=True)
                acc = acc * _to_out(combine, a.value, values, scale) + pv
            row_max = new_max
            if s + 1 < n:  # the next block's work after this one's: one block of scores at a time
                keys, values, row_max, row_sum, acc = jax.lax.optimization_barrier((*sent, row_max, row_sum, acc))
        out = (acc / _to_out(combine, a.value, values, row_sum)).astype(prog.values[a.out].dtype)
        lse = jnp.where(jnp.isneginf(row_max), 0, row_max) + jnp.log(row_sum)
        self.saved[a.score] = SavedRows(out, lse)
        if isinstance(m, OnlineAcrossScans):  # stacked for the backward scan, in the place of its residuals
            frame.put(m.saved[0], self.saved[a.score])
            for v, _, _ in m.dropped:
                frame.put(v, jnp.zeros((), out.dtype))
        interp.put_results(frame, a.combine, [interp.order.made(a.out, out)])

    def _backward(self, frame, m: OnlineAttention) -> None:
        interp, a = self.interp, m.attention
        prog = interp.prog
        score, combine = prog.ops[a.score], prog.ops[a.combine]
        dq_op, dk_op, dv_op = (prog.ops[o] for o in (m.grad_queries_dot, m.grad_keys_dot, m.grad_values))
        ring = interp.rings[a.score]
        n = interp.mesh.size(ring.axis)
        out, lse = frame.env[m.saved[2]] if isinstance(m, OnlineAcrossScans) else self.saved[a.score]
        query, key, value = m.backward_operands
        d_out = interp.read_operand(frame, m.grad_values, dv_op.operands.index(m.grad_out))
        after = d_out
        q = interp.read_operand(frame, m.grad_keys_dot, dk_op.operands.index(query), after)
        keys = interp.read_operand(frame, m.grad_queries_dot, dq_op.operands.index(key), after)
        values = interp.read_operand(frame, m.grad_scores, prog.ops[m.grad_scores].operands.index(value), after)
        # Rotated again after the backward pass's dO and apart from the forward's ring.
        keys, values, q = jax.lax.optimization_barrier((keys, values, q, d_out))[:3]
        size = keys.shape[a.key_dim]
        me = jax.lax.axis_index(ring.axis)
        cast = prog.values[m.read].dtype
        delta = _to_rows(combine, a.value, values, d_out.astype(lse.dtype) * out.astype(lse.dtype), lse)
        dq = own = travelling = None
        for s in range(n):
            block = (me - s) % n
            if s + 1 < n:
                sent = (_next(keys, ring.axis, n, again=True), _next(values, ring.axis, n, again=True))
            x, logits_vjp = jax.vjp(lambda t, b=block: self._logits(m, t, b, size), _dot(score, a.key, keys, q))
            p = jnp.exp(x - lse)
            _, weights_vjp = jax.vjp(lambda t, vb=values: _dot(combine, a.value, vb, t.astype(cast)), p)
            (dp,) = weights_vjp(d_out)
            (ds,) = logits_vjp(p * (dp - delta))
            part_dq = _dot(dq_op, key, keys, ds)
            dq = part_dq if dq is None else dq + part_dq
            parts = (_dot(dk_op, query, q, ds), _dot(dv_op, m.grad_out, d_out, p.astype(cast)))
            if s == 0:
                own = parts
            else:
                travelling = parts if travelling is None else tuple(t + x for t, x in zip(travelling, parts))
                travelling = tuple(_next(t, ring.axis, n) for t in travelling)
            if s + 1 < n:
                keys, values, dq, own, travelling = jax.lax.optimization_barrier((*sent, dq, own, travelling))
        dk, dv = own if travelling is None else tuple(t + o for t, o in zip(travelling, own))
        for o, r in ((m.grad_queries_dot, dq), (m.grad_keys_dot, dk), (m.grad_values, dv)):
            interp.put_results(frame, o, [r])


def _unlinked(prog, v: int):
    """The constant a value with no producer holds: a region's const, or a call's
    literal operand (a call passes a literal to its body without a link)."""
    region = prog.regions[prog.values[v].region]
    if v in region.constvars:
        return region.consts[region.constvars.index(v)]
    parent = prog.regions[region.parent]
    i = next(i for i, kids in parent.children.items() if region.id in kids)
    return parent.jaxpr.eqns[i].invars[region.invars.index(v)].val


def _is_chain(prog, m, o: int, u: int) -> bool:
    """Is `u`, read by chain op `o`, the chain's own value (the scores so far)?"""
    k = m.chain.index(o)
    if k == 0:
        return u == m.attention.scores
    return u in prog.ops[m.chain[k - 1]].results


def _dot(op, fixed: int, given, other, **changes):
    """Dot `op` bound with its operand `fixed` (a value id) as `given` and the other as
    `other`, its params updated by `changes`."""
    args = [given, other] if op.operands[0] == fixed else [other, given]
    return bind_equation(op.eqn, args, **changes)[0]


def _to_out(combine, value: int, values, stat):
    """A per-row statistic (the weights' layout, keys' dim of size 1) in the combine
    dot's result layout: the dot of it with ones of one key (exact, in its dtype)."""
    ones = jnp.ones(_one_key(combine, value, values), stat.dtype)
    return _dot(combine, value, ones, stat, preferred_element_type=stat.dtype)


def _to_rows(combine, value: int, values, y, like):
    """`y` (of the combine dot's result layout) summed over the values' own dims, in
    the layout of `like` (the weights' with the keys' dim of size 1): `_to_out`
    transposed."""
    ones = jnp.ones(_one_key(combine, value, values), like.dtype)
    (r,) = jax.linear_transpose(lambda t: _dot(combine, value, ones, t, preferred_element_type=like.dtype), like)(y)
    return r


def _one_key(combine, value: int, values) -> tuple:
    """The shape of the values' block with one key."""
    (lc, rc), _ = combine.eqn.params["dimension_numbers"]
    key = (lc, rc)[combine.operands.index(value)][0]
    return tuple(1 if d == key else s for d, s in enumerate(values.shape))
