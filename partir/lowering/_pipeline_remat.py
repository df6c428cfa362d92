"""Rematerialization inside pipelined layers (`_shardmap_pipeline`), for both lowerings.

A scan whose layers recompute residuals runs, unpipelined, as `_recompute.ScanRemat`
says: the forward loop stacks a scalar instead of each recomputed residual and stacks
in addition what recomputing needs that the loops do not pass on (the layer's input
activation); the backward loop slices those stacks, and the interpreter's
`Recomputation` remakes the residuals in the backward body from them. In a pipeline
the two loops are the stage's tick loops, and the same holds per microbatch: the
forward ticks keep, for every layer of the stage, each microbatch's block of what
recomputing needs (split along the microbatch dim as the microbatched plan says), the
backward ticks hand the body its microbatch's slice of it. `StageRemat` says what that
is and carries it from the forward scan to the backward one (`saved`: the stage's
blocks, kept as the trace goes, as `ScanRemat.stacks` is): what the forward body makes
(`ScanRemat.extra`), the stage's block of a stacked input the backward loop does not
read, and the forward scan's constants the recomputation reads. Under the jit lowering
each pipelined scan is a `shard_map` region of its own, so the forward region returns
them and the backward one takes them (`saved_layouts`). Under 1F1B (`_onef`) both
scans are one tick loop: what the forward body makes is kept in the ring of the
microbatches in flight, in the loop's state, rather than in `saved`, and the backward
unit hands `per_layer` its slot.
"""

from __future__ import annotations

import jax.numpy as jnp

from .._errors import PartitioningError
from .._nested import Link
from .._pipeline import MICROBATCH, _micro_dim
from .._tiling import Tiling
from .._uniform import uniform_dims


class StageRemat:
    """What recomputing residuals in the backward ticks of pipeline `pipe` needs from its
    forward ticks, for the stage program of `interp` (`inner`: the interpreter of the
    microbatched plan, whose `remat` recomputes)."""

    def __init__(self, interp, inner, pipe):
        self.interp, self.inner, self.pipe = interp, inner, pipe
        self.saved: dict[int, object] = {}  # value id -> the stage's block (this trace)
        scans, prog = inner.remat.scans, interp.prog
        self.fwd, self.bwd = pipe.scans.forward.body, pipe.scans.backward.body
        layer = scans.fwd.get(self.fwd)
        srcs = sorted({s for r in inner.remat.rec.by_layer.get(layer.index, ()) for s in inner.remat.rec.sources[r]}
                      ) if layer is not None else []
        #: The forward body's values stacked for recomputing (`ScanRemat.extra`).
        self.extra = list(scans.extra.get(self.fwd, ())) if layer is not None else []
        #: (slice, stack) of the stacked inputs recomputing reads that the backward body does not slice.
        self.more = [(s, stack) for s, stack in scans.sliced_sources.get(self.fwd, ())
                     if (stack, self.bwd) not in scans.sliced]
        #: The forward body's constants recomputing reads (outside both loops).
        self.consts = [s for s in srcs if prog.producer[s] >= 0 and prog.ops[prog.producer[s]].link
                       and prog.ops[prog.producer[s]].primitive == Link.SCAN_CONST]
        self.dims = {s: self._micro(s) for s in self.extra + [s for s, _ in self.more] + self.consts}
        #: Constants the same along their microbatch dim (a causal mask: `thin_consts`):
        #: saved as one row along the dims they are the same along, broadcast per tick to a
        #: microbatch's block (that shape).
        self.rows: dict[int, tuple[frozenset, tuple]] = {}
        for s in self.consts:
            same = uniform_dims(prog, prog.ops[prog.producer[s]].operands[0])
            if self.dims[s] in same:
                block = interp.rest(s).shard_shape(tuple(prog.values[s].shape), interp.mesh)
                self.rows[s] = (same, tuple(n // pipe.microbatches if k == self.dims[s] else n
                                            for k, n in enumerate(block)))

    def _micro(self, s: int):
        t = self.inner.part.tiling(s)
        if MICROBATCH in t.partial:
            raise PartitioningError(f"recomputing the pipelined layers needs {self.interp.prog.name(s)}, a sum over "
                                    "the batch: keep it with another Remat policy, or leave Remat out")
        return _micro_dim(t, f"value {self.interp.prog.name(s)}")

    def placeholder(self, v: int) -> bool:
        """Is the stacked value `v` a recomputed residual's placeholder (a scalar per layer)?"""
        return v in self.inner.remat.scans.placeholders

    def saved_layouts(self) -> list[tuple[int, Tiling]]:
        """(value, the layout of its stage block at rest) of what the forward scan saves,
        in the order a region passes them: stacked ones with the stage axis on their
        layer dim (a constant saved as a row: that row, in the same layout)."""
        rest = self.interp.rest
        stacked = [(s, Tiling(((self.pipe.axis,),) + rest(s).dims)) for s in self.extra + [s for s, _ in self.more]]
        return stacked + [(s, rest(s)) for s in self.consts]

    # -- the forward scan ----------------------------------------------------------------
    def keep_inputs(self, g, w, xs, consts) -> None:
        """Save the stage's blocks of the forward scan's stacked inputs and constants that
        recomputing reads (`xs`, `consts`: in the body's layouts, a weight the stage
        gathered, and cast or broadcast, before the loop as gathered: `gather_once`,
        read so by the recomputation; `g`, `w`: the scan's operand and body input ids)."""
        for s, stack in self.more:
            self.saved[s] = xs[list(g.xs).index(stack)]
        for s in self.consts:
            a = consts[list(w.consts).index(s)]
            same = self.rows[s][0] if s in self.rows else ()
            self.saved[s] = a[tuple(slice(0, 1) if k in same else slice(None) for k in range(a.ndim))]

    def made(self):
        """The forward body's values to stack, as the body just made them."""
        return tuple(self.inner.values[s] for s in self.extra)

    def keep_made(self, stacks) -> None:
        """Save the stage's stacks of `made` over every microbatch."""
        self.saved.update(zip(self.extra, stacks))

    # -- the backward scan -----------------------------------------------------------------
    def per_layer(self, mc, count: int, micro, made=None) -> tuple:
        """Microbatch `mc`'s part of the saved stacks (`micro(a, dim, mc, count)` cuts it),
        to scan over with the stage's layers. `made`: (the stacks of `extra` holding it,
        its slot in them, their slots) where the tick loop holds those instead of
        `saved` (1F1B's ring of the microbatches in flight: `_onef`)."""
        stacks, at, slots = (tuple(self.saved[s] for s in self.extra), mc, count) if made is None else made
        out = tuple(micro(a, None if self.dims[s] is None else self.dims[s] + 1, at, slots)
                    for s, a in zip(self.extra, stacks))
        return out + tuple(micro(self.saved[s], None if self.dims[s] is None else self.dims[s] + 1, mc, count)
                           for s, _ in self.more)

    def per_tick(self, mc, count: int, micro) -> dict:
        """Microbatch `mc`'s part of the saved constants (one saved as a row broadcast)."""
        return {s: jnp.broadcast_to(self.saved[s], self.rows[s][1]) if s in self.rows
                else micro(self.saved[s], self.dims[s], mc, count) for s in self.consts}

    def enter(self, layer_slices, consts: dict) -> None:
        """Before the backward body runs on one layer: what recomputing there reads."""
        stacked = self.extra + [s for s, _ in self.more]
        scans = self.inner.remat.scans
        scans.slices[self.bwd] = {**dict(zip(stacked, layer_slices)), **consts}
        self.inner.remat.clear(self.bwd)
