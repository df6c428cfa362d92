"""The `shard_map` lowering: the plan as the program each device runs, with explicit
collectives exactly where the plan moves data.

`partir.lower(part, mesh, backend="shard_map")` runs the jaxpr region by region inside
`jax.shard_map` over the plan's mesh. Every value lives as its block under its at-rest
tiling. Before an op, each operand is moved from there to the layout the op reads it
in; the op runs on blocks (`_local`); after it, each result is moved from the
layout it comes out in (partial over the axes of split reduction factors) to its
at-rest tiling. Every move is the collectives `transition` names, run by
`_spmd.move` in the order and on the buffers the cost model charges, so the
compiled program holds the collectives the model lists. A value moved to one layout is
moved once per pass (forward or backward) in a region, as the model counts it.

Values made from scalars (broadcast constants, iotas, masks made of them: `free`) are
never moved: they are made whole from the scalars and each reader takes its block.
Nested jaxprs (calls, `jax.checkpoint`, `scan`, `while`, `cond`) are evaluated by their
`partir._nested` entries with this interpreter for their bodies; a value crossing a
region boundary is moved as the link op joining the two sides says
(`_boundaries`). Residuals the plan rematerializes are recomputed, block by
block, where the backward pass first reads them (`_shardmap_remat`). A dot that moves
a value round a ring (`partir.ring_moves`) reads it as its block at rest, or makes its
block of the sum, and runs block by block as the blocks travel (`_ring`); a ring
plan's attention runs blockwise with an online softmax where it matches (`_online`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal
from jax.sharding import NamedSharding

from .._errors import PartitioningError
from .._graph import made_from_scalars
from .._mesh import MeshSpec, lowering_mesh
from .._partitioning import Partitioning
from .._pipeline import MICROBATCH, microbatched
from .._pipeline_head import head_layout
from .._rings import ring_moves
from .._scans import var_ids
from .._tiling import Tiling
from ._boundaries import BOUNDARIES, call
from ._common import LAYOUT_ONLY, jit_with_layouts
from ._eval import bind_equation
from ._frame import Frame, _Blocks
from ._hooks import made_in_forward
from ._local import LocalOp, bind_local
from ._order import Reordering
from ._online import OnlineRings
from ._ring import run_ring
from ._shardmap_pipeline import run_pipelined
from ._onef import run_onef
from ._pipeline_head import run_head
from ._pipeline_remat import StageRemat
from ._shardmap_remat import BlockRecomputation
from ._spmd import move


def lower_shard_map(part: Partitioning, mesh, *, free=None, donate_argnums=(), online_softmax: bool = True):
    """`jax.jit` of a `jax.shard_map` running the plan per device. `free` lists the values
    that may be made in any layout instead of moved (value ids or a boolean mask; by
    default those `partir.made_from_scalars` names); pass the cost model's
    (`search._fusion.materialization(program).from_scalars`) to lower exactly what it
    charges. `online_softmax`: a ring plan's attentions run blockwise with an online
    softmax where `partir.online_attentions` matches them (`_online`); False keeps the
    program's softmax round the ring for all."""
    prog = part.program
    interp = Interpreter(part, _free_mask(prog, free), online_softmax=online_softmax)
    in_specs = tuple(part.tiling(v).spec() for v in prog.inputs)
    out_specs = tuple(part.tiling(v).spec() if v >= 0 else jax.sharding.PartitionSpec() for v in prog.outputs)
    auto = lowering_mesh(mesh)
    body = jax.shard_map(lambda *xs: tuple(interp.top(xs)), mesh=auto, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
    order = interp.order

    def run(*args):
        leaves = jax.tree_util.tree_leaves(args)
        if order:  # the inputs in the plan's token order, split as the plan has them
            leaves = [x if y is x else jax.lax.with_sharding_constraint(y, NamedSharding(auto, s))
                      for x, y, s in zip(leaves, order.enter(leaves), in_specs)]
        return jax.tree_util.tree_unflatten(prog.out_tree, order.leave(list(body(*leaves))))

    return jit_with_layouts(run, part, mesh, donate_argnums)


def _pipelined(interp) -> dict:
    """Body region -> (pipelining, scan layout, interpreter of the microbatched plan, its
    `StageRemat` or None) of each pipelined layer scan."""
    part = interp.part
    out = {}
    for pipe in part.pipelines:
        ext, layouts = microbatched(part, pipe)
        inner = Interpreter(ext, [False] * len(part.program.values), MeshSpec(part.mesh.axes + ((MICROBATCH, 1),)))
        remat = None
        if inner.remat is not None and pipe.scans.backward is not None:
            if part.reused:
                raise PartitioningError("a pipeline does not relax the user's jax.checkpoint inside its layers yet "
                                        "(a Remat policy keeping more than the user's): pick a Remat policy that "
                                        "keeps as little as the user's, or leave Remat out")
            remat = StageRemat(interp, inner, pipe)
        for lay in layouts:
            inner.left_partial.update(lay.deferred)
            for g in lay.gathered:  # (gathered, and cast, before the tick loop: `gather_once`)
                _hold_gathered(inner, g)
            inner.held.update(lay.widened)
            inner.held.update(lay.recomputed)  # (remade from a weight gathered once: `BlockRecomputation`)
            inner.widened.update(lay.widened_ops)
            # (the stage program keeps and accumulates those it outputs so: `run_pipelined`)
            interp.held.update(lay.widened)
            out[lay.call.body] = (pipe, lay, inner, remat)
        head = head_layout(part, ext, pipe)
        if head is not None:
            inner.left_partial.update(head.deferred)
            if pipe.schedule == "1f1b":  # both scans and the head between them: one tick loop
                interp.heads[(head.region, pipe.scans.forward.index)] = (
                    run_onef, (pipe, layouts, inner, head, remat), pipe.scans.backward.index + 1)
            else:
                interp.heads[(head.region, head.start)] = (run_head, (inner, head), head.end)
    return out


def _hold_gathered(inner, g) -> None:
    """Have `inner` (the microbatched plan's interpreter) read weight `g` (`Gathered`)
    as its stage gathered it before the tick loop: each region the weight enters (the
    body, a call's callee: `Gathered.via`) takes it as the last value of the chain in
    that region (`aliases`: the casts before it not run again, `skipped`), held in the
    gathered layout, which the call's link hands on as it is (`_boundaries.cross`)."""
    entries = [g.input] + [w for _, w in g.via]
    exits = [h for h, _ in g.via] + [g.value]
    for e, x in zip(entries, exits):
        inner.aliases[e] = x
        inner.held[x] = g.layout
    inner.held.update((w, g.layout) for _, w in g.via)
    inner.skipped.update(g.ops)


def _free_mask(prog, free) -> list[bool]:
    n = len(prog.values)
    if free is None:
        return list(made_from_scalars(prog))
    arr = np.asarray(list(free))
    if arr.dtype == bool:
        if arr.shape != (n,):
            raise PartitioningError(f"free= is a mask of {arr.size} entries; the program has {n} values")
        return arr.tolist()
    ids = set(arr.astype(int).tolist())
    return [v in ids for v in range(n)]


class Interpreter:
    """Runs the program's regions on one device's blocks (see the module docstring)."""

    def __init__(self, part: Partitioning, free: list[bool], move_mesh=None, online_softmax: bool = False):
        # `mesh` gives blocks their shapes; `move_mesh` the axes values move along (the
        # mesh less a sequential axis whose blocks one device runs one after the other:
        # pipeline microbatches, whose sums accumulate instead of being all-reduced).
        self.part, self.prog, self.mesh = part, part.program, part.mesh
        self.move_mesh = part.mesh if move_mesh is None else move_mesh
        # Values a pipeline leaves partial over some axes when made (`ScanLayout.deferred`).
        self.left_partial: dict[int, tuple[str, ...]] = {}
        # Values a pipeline holds in another layout than at rest: a stage's weights
        # gathered once before its tick loop (`ScanLayout.gathered`), its gradients
        # accumulated whole along their reduce-scatter's axes (`ScanLayout.widened`).
        self.held: dict[int, Tiling] = {}
        # Ops a pipeline runs on blocks whole along some axes (op id -> those axes): the
        # linear ops after a weight gradient's deferred reduce-scatter (`ScanLayout.widened_ops`).
        self.widened: dict[int, tuple[str, ...]] = {}
        # A pipelined body's inputs given as the cast of them its layers read (input ->
        # that value), and the casts that made them before its tick loop, not run again.
        self.aliases: dict[int, int] = {}
        self.skipped: set[int] = set()
        self.free = free
        self.order = Reordering(part)
        self.rings = ring_moves(part)  # the dots that move a value round a ring (`_ring`)
        self.online = OnlineRings(self, online_softmax)  # attentions run blockwise (`_online`)
        self.backward = self.prog.backward
        self.values, self.wholes = _Blocks(self), {}
        self.remat = BlockRecomputation(part, self) if part.rematerialized or part.reused else None
        # (region, first equation) -> (how, what, the equation after them) of the equations
        # run per microbatch: the head between two layer scans (`_pipeline_head.run_head`
        # on the microbatched plan's interpreter and the `partir.HeadLayout`), or both scans
        # and the head as the 1F1B tick loop (`_onef.run_onef`).
        self.heads: dict = {}
        self.pipelined = _pipelined(self) if part.pipelines else {}

    def top(self, args) -> list:
        self.values, self.wholes = _Blocks(self), {}
        self.online.clear()
        if self.remat is not None:
            self.remat.clear()
        return self.region(0, list(args))

    def region(self, rid: int, args, whole=None) -> list:
        """The blocks of region `rid`'s outputs at rest, from its inputs' blocks at rest
        (`args`) and the inputs also given whole (`whole`: input position -> array)."""
        region = self.prog.regions[rid]
        frame = Frame(self)
        for v, c in zip(region.constvars, region.consts):
            frame.make_whole(v, jnp.asarray(c))
        for v, a in zip(region.invars, args):
            frame.put(self.aliases.get(v, v), a)
        for k, x in (whole or {}).items():
            frame.make_whole(region.invars[k], x)
        skip = 0  # the equations of a region run per microbatch (`_pipeline_head`) after its first
        for i, eqn in enumerate(region.jaxpr.eqns):
            if i < skip:
                continue
            head = self.heads.get((rid, i))
            if head is not None:
                run, given, skip = head
                run(self, *given, frame)
                continue
            self.eqn(frame, rid, i, eqn)
        return [jnp.asarray(x.val) if isinstance(x, Literal) else frame.read(v, self.given_out(v))
                for x, v in zip(region.jaxpr.outvars, region.outvars)]

    def given_out(self, v: int) -> Tiling | None:
        """The layout region output `v` leaves in: at rest (None), but a weight a stage
        gathered before its tick loop leaves as the plan holds it (`aliases`), cut from
        the gathered block."""
        return self.part.tiling(v) if v in self.aliases.values() else None

    def eqn(self, frame: Frame, rid: int, i: int, eqn) -> None:
        """Run equation `i` (`eqn`) of region `rid` on the blocks of `frame`."""
        with jax.named_scope(str(eqn.source_info.name_stack) or "_"):
            if self.remat is not None:
                self.remat.reads(frame, rid, i, eqn)
            region = self.prog.regions[rid]
            if i in region.children:
                if not self.online.skips(frame, region.eqn_results[i]):  # else inside a blockwise attention
                    self._nested(frame, rid, i, eqn)
            else:
                self.op(frame, eqn, region.eqn_ops[i])

    # -- ops ---------------------------------------------------------------------------
    def op(self, frame: Frame, eqn, oid: int) -> None:
        """Run op `oid` (equation `eqn`) on the blocks of `frame`."""
        part, op = self.part, self.prog.ops[oid]
        if oid in self.skipped:
            return  # (its result given: `aliases`)
        if oid in self.online.ops:
            self.online.run(frame, oid)  # the blockwise attention does this op's work
            return
        if self._made_whole(frame, eqn, op):
            return
        slots, partial, _ = self.block_layout(oid)
        need = {k: Tiling(d) for side, k, _, d in slots if side == "operand"}
        made = {k: d for side, k, _, d in slots if side == "result"}
        backward = self.backward[oid]
        after = self._anchor(frame, op) if backward else None
        ring = self.rings.get(oid)
        operands = [x.val if v < 0 else self.read_operand(frame, oid, k, after) for k, (x, v)
                    in enumerate(zip(eqn.invars, op.operands))]
        if eqn.primitive.name in LAYOUT_ONLY:
            outs = operands  # the identity: the plan's layouts replace the program's requests
        elif ring is not None:
            outs = self._ring(ring, eqn, op, operands, after if backward else None)
        else:
            local = LocalOp(eqn, tuple(need.get(k) for k in range(len(eqn.invars))),
                            tuple(Tiling(made[k]) if k in made else None for k in range(len(eqn.outvars))),
                            tuple(tuple(getattr(x.aval, "shape", ())) for x in eqn.invars),
                            tuple(tuple(getattr(x.aval, "shape", ())) for x in eqn.outvars), self.mesh, partial)
            outs = bind_local(local, operands)
            outs = [o if v < 0 else self.order.made(v, o) for v, o in zip(op.results, outs)]
        self.put_results(frame, oid, outs)

    def read_operand(self, frame: Frame, oid: int, k: int, after=None):
        """Operand `k` of op `oid` in the layout the op reads it in (at rest when a ring
        brings it); `after`: the backward value a forward one moved again waits for."""
        op = self.prog.ops[oid]
        v = op.operands[k]
        ring = self.rings.get(oid)
        need = None
        if ring is None or ring.kind != "gather" or ring.slot != k:  # a ring reads its block at rest
            need = next(Tiling(d) for side, j, _, d in self.block_layout(oid)[0] if side == "operand" and j == k)
        again = self.backward[oid] and made_in_forward(self.prog, v)
        return frame.read(v, need, self.backward[oid], again, after if again else None)

    def put_results(self, frame: Frame, oid: int, outs) -> None:
        """Put op `oid`'s results `outs` (as it makes them) in `frame`, moved to rest."""
        op = self.prog.ops[oid]
        slots, partial, kind = self.block_layout(oid)
        made = {k: d for side, k, _, d in slots if side == "result"}
        ring = self.rings.get(oid)
        for k, v in enumerate(op.results):
            if v >= 0:
                left = self.left_partial.get(v, ())
                made_k = Tiling(made[k], tuple(a for a in partial if a not in left), kind)
                if ring is not None and ring.kind == "scatter" and k == ring.slot:
                    made_k = ring.made(made_k)
                frame.put(v, move(outs[k], made_k, self.rest(v), self.move_mesh))
        if self.backward[oid] and outs:
            frame.last = outs[0]

    def _ring(self, ring, eqn, op, operands, after) -> list:
        """Op `op` run as `ring` moves its value (`_ring`); `after`: a value of the
        backward pass, when it runs there."""
        again = ring.kind == "gather" and after is not None and made_in_forward(self.prog, ring.value)
        if again:
            # A forward value read again: rotated after the backward value and apart from
            # the forward's ring, not merged with it (which would keep every block alive).
            operands[ring.slot], _ = jax.lax.optimization_barrier((operands[ring.slot], after))
        outs = run_ring(ring, eqn, operands, self.mesh, again)
        return [self.order.made(v, o) for v, o in zip(op.results, outs)]

    def _anchor(self, frame: Frame, op):
        """A value of the backward pass that op `op` reads (else the latest one made)."""
        for v in op.operands:
            if v >= 0 and v in frame.env and not made_in_forward(self.prog, v):
                return frame.env[v]
        return frame.last

    def _made_whole(self, frame: Frame, eqn, op) -> bool:
        """Make a value from scalars whole (where all it is made from is whole or a
        scalar): its readers each take their block, and nothing is moved."""
        if not all(v < 0 or self.free[v] for v in op.results) or not any(v >= 0 for v in op.results):
            return False
        if not all(v < 0 or v in frame.whole or not self.prog.values[v].shape for v in op.operands):
            return False
        args = [x.val if v < 0 else frame.whole[v] if v in frame.whole else frame.read(v)
                for x, v in zip(eqn.invars, op.operands)]
        outs = bind_equation(eqn, args)
        for v, o in zip(op.results, outs):
            if v >= 0:
                frame.make_whole(v, self.order.made(v, o))
        return True

    # -- region boundaries ------------------------------------------------------------
    def block_layout(self, oid: int):
        """`Partitioning.block_layout` of op `oid` as this interpreter runs it: with the
        axes of `widened` taken off its slots."""
        slots, partial, kind = self.part.block_layout(oid)
        axes = self.widened.get(oid)
        if not axes:
            return slots, partial, kind
        return tuple((side, k, v, tuple(tuple(a for a in d if a not in axes) for d in dims))
                     for side, k, v, dims in slots), partial, kind

    def link(self, src: int, dst: int) -> int | None:
        """The link op carrying value `src` to value `dst`, if there is one."""
        for o in self.prog.users[src]:
            op = self.prog.ops[o]
            if op.link and op.results[0] == dst:
                return o
        return None

    def rest(self, v: int) -> Tiling:
        """Value `v`'s at-rest tiling (where a pipeline holds it: `held`)."""
        return self.held.get(v) or self.part.tiling(v)

    def _var_ids(self, rid: int) -> dict:
        """Region `rid`'s jaxpr variables -> their value ids (made once per region)."""
        return var_ids(self.prog, rid)

    def _nested(self, frame: Frame, rid: int, i: int, eqn) -> None:
        region = self.prog.regions[rid]
        children, results = region.children[i], region.eqn_results[i]
        ids = self._var_ids(rid)
        ins = [-1 if isinstance(x, Literal) else ids[x] for x in eqn.invars]
        operands = [x.val if v < 0 else frame.read(v) for x, v in zip(eqn.invars, ins)]
        whole = {k: frame.whole[v] for k, v in enumerate(ins) if v >= 0 and v in frame.whole}
        if children and children[0] in self.pipelined:
            outs = run_pipelined(self, *self.pipelined[children[0]], eqn, ins, results, operands, whole)
        else:
            outs = BOUNDARIES.get(eqn.primitive.name, call)(self, eqn, children, ins, results, operands, whole)
        for v, o in zip(results, outs):
            if v >= 0:
                frame.put(v, o)
