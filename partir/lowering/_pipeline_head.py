"""The region between a pipeline's two layer scans (head, loss and their backward) run
one microbatch at a time, for both lowerings (`partir.HeadLayout`).

Its equations that are the same for every microbatch run once, first, with the plan's
interpreter. The others run in a loop over the M microbatches with the interpreter of
the microbatched partitioning (its moves leave the microbatch axis out), on the
microbatch's block of each input split along a microbatch dim: so the head's
activations (the logits) are one microbatch's. What leaves the region is kept as its
kind says: a microbatch's block of a split value written into the replica batch's
block (the backward scan's initial carry), a sum accumulated (the loss, the head's
weight gradients) and completed after the loop where its reduction was deferred
(`HeadLayout.deferred`: one all-reduce a step, as without a pipeline).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._tiling import Tiling
from ._frame import Frame
from ._shardmap_pipeline import _keep, _micro
from ._spmd import move


def run_head(interp, inner, head, frame: Frame) -> None:
    """Run `head`'s equations on the blocks of `frame` (the plan's interpreter `interp`
    running its region), putting what leaves the region in `frame`."""
    prog = interp.prog
    region = prog.regions[head.region]
    for i in head.hoisted:
        interp.eqn(frame, head.region, i, region.jaxpr.eqns[i])
    whole = {v: frame.whole[v] for v, d in zip(head.inputs, head.in_dims) if d is None and v in frame.whole}
    blocks = {v: frame.read(v) for v in head.inputs if v not in whole}
    M = head.microbatches

    def one(acc, m):
        f = run_looped(inner, head, whole, blocks, m)
        return tuple(_keep(b, f.read(v), k, d, m, True)
                     for b, v, k, d in zip(acc, head.outputs, head.out_kinds, head.out_dims)), None

    start = tuple(jnp.zeros(interp.rest(v).shard_shape(prog.values[v].shape, interp.mesh), prog.values[v].dtype)
                  for v in head.outputs)
    acc, _ = jax.lax.scan(one, start, jnp.arange(M))
    for v, a in zip(head.outputs, acc):
        rest, left = interp.rest(v), head.left_partial(v)
        frame.put(v, move(a, Tiling(rest.dims, left, "sum"), rest, interp.move_mesh) if left else a)


def run_looped(inner, head, whole: dict, blocks: dict, m, given: dict | None = None) -> Frame:
    """The frame of `head`'s looped equations run by `inner` (the microbatched plan's
    interpreter) on microbatch `m`: the inputs made whole (`whole`) as they are, the
    others cut to the microbatch from their blocks (`blocks`), those `given` (value ->
    the microbatch's block) as given."""
    f = Frame(inner)
    for v, x in whole.items():
        f.make_whole(v, x)
    for v, d in zip(head.inputs, head.in_dims):
        if v in blocks:
            f.put(v, _micro(blocks[v], d, m, head.microbatches))
    for v, x in (given or {}).items():
        f.put(v, x)
    region = inner.prog.regions[head.region]
    for i in head.looped:
        inner.eqn(f, head.region, i, region.jaxpr.eqns[i])
    return f
