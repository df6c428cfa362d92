"""The blocks one device holds while the shard_map lowering runs a region: `Frame`
(a region's run: its values' blocks, the ones made whole, the moves made) and `_Blocks`
(every block by value id, as recomputation reads them)."""

from __future__ import annotations

import jax

from .._tiling import Tiling
from ._spmd import move


class Frame:
    """One run of one region (or one recomputation): values' blocks at rest (`env`, by
    value id), the values made whole (`whole`), and the moves made so far (one per
    value, layout and pass). With `record`, what it defines is also kept by id in the
    interpreter's `values` (what recomputation starts from)."""

    def __init__(self, interp, *, record: bool = True):
        self.interp, self.record = interp, record
        self.env, self.whole, self.moved = {}, {}, {}
        self.last = None  # the latest value the backward pass made here

    def put(self, v: int, x) -> None:
        self.env[v] = x
        if self.record:
            self.interp.values[v] = x

    def make_whole(self, v: int, x) -> None:
        self.whole[v] = x
        if self.record:
            self.interp.wholes[v] = x

    def has(self, v: int) -> bool:
        return v in self.env or v in self.whole

    def read(self, v: int, need: Tiling | None = None, backward: bool = False, again: bool = False, after=None):
        """Value `v`'s block in layout `need` (at rest when None). A forward value moved
        `again` by the backward pass is moved in a form XLA does not merge with the
        forward's move, after `after` (a value the backward pass made) when given: it is
        then not kept moved in between either, as the model charges it."""
        interp = self.interp
        rest = interp.rest(v)
        need = rest if need is None else need
        if v in self.whole:
            key = (v, need.dims, "whole")
            if key not in self.moved:
                self.moved[key] = move(self.whole[v], Tiling.replicated(need.rank), need, interp.move_mesh)
            return self.moved[key]
        if need.dims == rest.dims:
            return self.env[v]
        key = (v, need.dims, backward)
        if key not in self.moved:
            x = self.env[v]
            if after is not None:
                x, _ = jax.lax.optimization_barrier((x, after))
            self.moved[key] = move(x, rest, need, interp.move_mesh, again=again)
        return self.moved[key]

    def replace(self, v: int, x) -> None:
        """Read value `v` as `x` from now on (a recomputed residual)."""
        self.env[v] = x
        self.moved = {k: y for k, y in self.moved.items() if k[0] != v}


class _Blocks(dict):
    """Blocks at rest by value id, as recomputation reads them: a value made whole is cut
    to its block on first request."""

    def __init__(self, interp):
        super().__init__()
        self.interp = interp

    def __missing__(self, v: int):
        interp = self.interp
        if v not in interp.wholes:
            raise KeyError(v)
        t = interp.part.tiling(v)
        x = self[v] = move(interp.wholes[v], Tiling.replicated(t.rank), t, interp.move_mesh)
        return x
