"""Rematerialization under the `shard_map` lowering.

Which residuals are recomputed, from which kept values, on which backward read, and
how a scan's two loops carry what recomputing needs (and the forward values a relaxed
user checkpoint reads) are the jit lowering's (`_recompute.Recomputation` and
`ScanRemat`); here the recomputed forward ops run on blocks, each with its moves (collectives included, as the cost model charges
them: the `collectives` policy keeps what moved data, so it repeats none).
"""

from __future__ import annotations

import jax
from jax.extend.core import Literal

from ._boundaries import cross
from ._frame import Frame
from ._spmd import move
from .._tiling import Tiling
from ._recompute import Recomputation


class BlockRecomputation(Recomputation):
    """Recomputes rematerialized residuals on blocks, where the backward pass first reads
    them, for the interpreter `interp` (`_shardmap.Interpreter`)."""

    def __init__(self, part, interp):
        super().__init__(part, interp)
        self.interp = interp

    def reads(self, frame: Frame, rid: int, i: int, eqn) -> None:
        """Equation `i` of region `rid` reads recomputed blocks where the backward pass
        reads a recomputed residual (`frame` reads them from then on)."""
        ids = self.interp._var_ids(rid)
        vids = [-1 if isinstance(x, Literal) else ids[x] for x in eqn.invars]
        blocks = [frame.env.get(u) for u in vids]
        for u, old, new in zip(vids, blocks, self.substitute(rid, i, eqn, vids, blocks)):
            if new is not old:
                frame.replace(u, new)

    def _forward_value(self, x, v: int, u: int):
        """Forward value `v`'s block `x` moved to the layout of the value `u` it stands for."""
        return cross(self.interp, x, v, u)

    def _kept(self, s: int, body: int):
        """Source `s`'s block for a recomputation in backward body `body`, in the layout
        the forward body holds `s` in (`Interpreter.rest`). A pipelined stage gathers a
        weight once before each tick loop (`Interpreter.held`): the backward's slice of
        it comes as the backward body holds it, which is the forward's layout where
        both loops gather it alike (no move)."""
        interp = self.interp
        x, u = self.scans.source(s, body, interp.values), self.scans.origin(s, body)
        need = interp.rest(interp.aliases.get(s, s))
        if u is None or u == s or interp.rest(u) == need:
            return x
        return move(x, Tiling(interp.rest(u).dims), Tiling(need.dims), interp.move_mesh)

    def _block(self, b: int, anchor, rid: int = 0) -> dict:
        """The recomputed blocks of block `b`'s residuals (made on its first backward
        read; in a scan's backward body, from that body's slices)."""
        key = (b, self.scans.body_of(rid))
        if key in self.done:
            return self.done[key]
        interp, prog = self.interp, self.prog
        sources = sorted({s for r in self.rec.by_layer[b] for s in self.rec.sources[r]})
        kept = tuple(self._kept(s, key[1]) for s in sources)
        if anchor is not None:
            kept, _ = jax.lax.optimization_barrier((kept, anchor))
        frame = Frame(interp, record=False)
        # (A weight its stage gathered, and cast or broadcast, once before the tick loop
        # is read as the forward body read it: `Interpreter.aliases`, the chain not run.)
        frame.env.update((interp.aliases.get(s, s), x) for s, x in zip(sources, kept))
        by_root = {self.root[s]: interp.aliases.get(s, s) for s in sources}  # a kept input read through a call's copy
        for o in self.ops[b]:
            op = prog.ops[o]
            if o in interp.skipped:
                continue  # (run once before the tick loop: its result given, `aliases`)
            for u in op.operands:
                if u >= 0 and not frame.has(u) and self.root[u] in by_root:
                    frame.env[u] = frame.env[by_root[self.root[u]]]
            if not op.link:
                interp.op(frame, op.eqn, o)
            elif op.operands[0] >= 0 and op.results[0] >= 0:
                u, r = op.operands[0], op.results[0]
                if u in frame.whole:
                    frame.whole[r] = frame.whole[u]
                else:
                    frame.env[r] = cross(interp, frame.env[u], u, r)
        self.done[key] = {r: frame.read(r) for r in self.rec.by_layer[b]}
        return self.done[key]
