"""The cost of a partitioned program: per-device compute, communication and peak memory.

Objective (what the search minimises), per device and per training step:

    compute_time = sum over ops of  trips(op) * (max((flops + transcendentals) / k
                                                        / (peak(dtype) * efficiency(op)),
                                                        bytes_moved / hbm_bandwidth)
                                                    + op_overhead if a matmul)
    comm_time    = sum over collectives of  trips * alpha-beta ring time   (see `_comm`)
    step_time    = compute_time + exposed communication          (see `_achieved`)
    step_time_overlap = step_time where the device overlaps; else compute_time
                        + comm_time - min(gradient_comm, backward_compute)  (gradient
                        reductions hidden behind the backward pass)
    memory_peak  = max over program order of live bytes          (see `_memory`)

where `k` is the number of devices an op's factor tiling splits it over, `trips` is the
product of the trip counts of the loops around the op (a scan body counts `length`
times; XLA's own analysis counts it once), and a plan is feasible when `memory_peak`
fits the memory limit (the device's HBM unless given).

The device's time model (`search._device`) says what the hardware achieves: a matmul's
`efficiency(op)` (`_achieved.dot_efficiency`: below the datasheet, lower for small and
skinny matmuls), a per-kernel `op_overhead`, which collectives run behind compute
(`_achieved`), and whether attention is the fused kernel (`_attention`): then the
kernel's ops take no time of their own and its matmuls run at `attention_efficiency`
of peak, on the tiles a causal mask leaves, plus `Q K^T` again in the backward kernel.
On the `cpu` preset all of it is the identity: the model is the roofline XLA:CPU runs.

The model is three modules: this one keeps the per-op prices up to date and adds them
up (`evaluate`, `cost`); `_time` assembles the step's time, `_peak` its peak
memory; `_breakdown` holds the readable `Cost`.

Re-costing is incremental: the model consumes what the partitioning reports changed
(`Partitioning.take_touched`), recomputes only the non-trivial ops involved, and
re-derives the totals with vectorised sums over per-op arrays.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

from partir import Kind, ring_moves

from ._breakdown import Cost, bytes_str, time_str
from ._comm import CollectiveCost, LinkModel, per_contracted_dim
from ._peak import CostMemory, op_label
from ._pipeline import PipelinePricing
from ._reassociate import sum_parents
from ._time import WEIGHT_GRADIENT_OPS, CostTime, feeds_backward, op_dtype
from ._device import DEFAULT_DEVICE, get_device, link_levels
from ._flops import op_work
from ._fusion import materialization
from ._manual import body_collectives
from ._memory import Liveness
from ._move_buffers import MoveBuffers
from ._rings import OnlineMemory, is_ring_reshard, ring_collectives, ring_signature
from ._achieved import dot_efficiency, shard_shape

__all__ = ["Cost", "CostModel", "bytes_str", "time_str"]


#: Memoised op prices kept before the memo is cleared (bounds memory in long searches).
_MEMO_LIMIT = 200_000
#: The lowerings the model prices (`partir.lower`'s backends). Under 'jit' XLA's SPMD
#: partitioner writes the collectives: a dot summed over several split dims is
#: all-reduced once per dim (`per_contracted_dim`), and a backend without a native
#: reduce-scatter all-reduces and slices. Under 'shard_map' the program writes them: one
#: `psum` over every axis a sum is partial over, and `psum_scatter` a reduce-scatter.
BACKENDS = ("jit", "shard_map")


class CostModel(CostTime, CostMemory):
    """Costs one `Partitioning` on one device, incrementally as it changes.

    `device` is a preset name, a `DeviceSpec` or a JSON/TOML path; `memory_limit`
    defaults to the device's HBM; `donate_argnums` lists donated (non-static) arguments;
    `links` overrides the link level ('intra'/'inter') of mesh axes; `while_trips` is
    the trip count assumed for `while` loops (unknown statically); `backend` is the
    lowering the plan runs under (`BACKENDS`); `grad_accum` the micro-batches a step the
    program (the train step of one) runs with: above 1, the peak holds a gradient
    accumulator beside the step's own buffers (`CostMemory`).
    """

    def __init__(self, part, device=DEFAULT_DEVICE, *, memory_limit: float | None = None, donate_argnums=(),
                 links: dict[str, str] | None = None, while_trips: int = 1, backend: str = "jit",
                 grad_accum: int = 1):
        if backend not in BACKENDS:
            raise ValueError(f"CostModel backend={backend!r}: choose one of {BACKENDS}")
        if isinstance(grad_accum, bool) or not isinstance(grad_accum, numbers.Integral) or grad_accum < 1:
            raise ValueError(f"CostModel grad_accum={grad_accum!r}: give the micro-batches a step as a positive "
                             "integer, e.g. grad_accum=32 (1: no gradient accumulation)")
        self.grad_accum = grad_accum
        prog = part.program
        self.part, self.program, self.backend = part, prog, backend
        self._device_and_links(device, memory_limit, links)
        cls = part.classes
        self._cls = cls
        n_ops = len(prog.ops)
        mult = [prog.multiplicity(r.id, while_trips) for r in prog.regions]
        self._mult = np.array([mult[op.region] for op in prog.ops], dtype=float)
        self._pipelines, self._links_given, self._while_trips = part.pipelines, links, while_trips
        piped = self._price_pipelines(n_ops)
        work = np.array([op_work(op, prog) for op in prog.ops], dtype=float).reshape(n_ops, 2)
        self._flops, self._trans = work[:, 0], work[:, 1]
        self._peak = np.array([self.device.flops_for(op_dtype(op, prog)) for op in prog.ops])
        self._backward = np.array(prog.backward, dtype=bool)
        self._op_region = [op.region for op in prog.ops]
        self._trivial = np.array(cls.trivial, dtype=bool) & ~piped
        self._op_class = np.array([s[0][0] if (t and s) else 0 for s, t in zip(cls.single, cls.trivial)], dtype=np.int64)
        # What XLA really runs and keeps (`_fusion`): dead ops cost nothing; fused values
        # (broadcasts, iotas, what is made from them) are no buffer and no memory traffic.
        self.materialization = mat = materialization(prog, self.device.fused_attention, self.device.priority_fusion)
        # The attentions a ring plan runs blockwise under shard_map (`partir.lowering._online`).
        self._online = OnlineMemory(part, self.device) if backend == "shard_map" else None
        self._timing_setup(prog, mat)
        self._bytes_setup(prog, mat)
        heavy = np.array([op.primitive in WEIGHT_GRADIENT_OPS for op in prog.ops], dtype=bool)
        self._feeds_backward = feeds_backward(prog, self._backward & heavy)
        self._donated = tuple(donate_argnums)
        self.liveness = Liveness(prog, mat, donate_argnums)
        self._move_buffers = MoveBuffers(part, self.device, mat)  # the backend's ways with moves
        self._views: dict = {}  # recomputed residuals -> RematView
        self._buffer_name = {}
        self._op_cols: dict[int, list] = {}
        self._memo: dict = {}
        self._signatures(n_ops)
        self._dedup: dict = {}
        part.take_touched()
        self._refresh_classes(range(len(cls)))
        self._refresh_ops([o for o in range(n_ops) if not self._trivial[o] and mat.live_op[o]])
        self._add_pipeline_collectives()

    def _device_and_links(self, device, memory_limit, links) -> None:
        """The device (with a native reduce-scatter under shard_map, whose program writes
        one), the memory limit, and each mesh axis's link level and model."""
        self.device = get_device(device)
        if self.backend == "shard_map" and not self.device.reduce_scatter:
            self.device = dataclasses.replace(self.device, reduce_scatter=True)
        self.memory_limit = float(memory_limit if memory_limit is not None else self.device.hbm_bytes)
        self.levels = link_levels(self.part.mesh.axes, self.device, links)
        self.links = LinkModel(self.part.mesh, self.device, self.levels)

    def _bytes_setup(self, prog, mat) -> None:
        """Which ops take time, and the bytes of values and of ops' operands and results
        as XLA keeps them (`mat`), whole and per device."""
        vals, cls = prog.values, self._cls
        self._virtual = mat.virtual
        # Ops that take time: live, not fused away, not a link (links only rename buffers;
        # a scan's per-iteration slices and stacked outputs are read and written by the
        # ops that use them, which pay for those bytes).
        self._runs = mat.live_op & ~np.array([op.link or (bool(op.results) and all(v < 0 or mat.virtual[v]
                                                                                 for v in op.results))
                                              for op in prog.ops], dtype=bool)
        self._nbytes = np.array([v.nbytes for v in vals], dtype=float)
        # A pipelined layer's values hold one microbatch (`PipelinePricing.value_div`).
        self._value_div = self._pipeline.value_div(len(vals)) if self._pipeline else np.ones(len(vals))
        self._value_class = np.array(cls.of, dtype=np.int64)
        self._mat_sources = mat.sources
        self._op_bytes_full = np.array([self._moved(_whole_slots(op), lambda dims: 1) for op in prog.ops], dtype=float)
        self._class_div = np.ones(len(cls))
        self._op_div = np.ones(len(prog.ops))
        self._op_bytes = self._op_bytes_full.copy()
        # Values made from scalars alone (a broadcast constant, an iota, a causal mask) can
        # be made in any layout where they are needed: XLA makes them, never moves them.
        self._free = set(np.nonzero(mat.from_scalars)[0].tolist())
        # Values whose one reader is an add (what `DeviceSpec.reassociate` merges).
        self._sum_parents = sum_parents(prog)

    def _price_pipelines(self, n_ops: int) -> np.ndarray:
        """Ops of pipelined layers are priced on microbatches, (M+S-1)/S as often
        (`_pipeline`): their trips scaled; which ops those are."""
        part = self.part
        self._pipeline = PipelinePricing(part, self.links, self.device) if part.pipelines else None
        piped = np.zeros(n_ops, dtype=bool)
        for o, scale in (self._pipeline.scale.items() if self._pipeline else ()):
            self._mult[o] *= scale
            piped[o] = True
        self._piped = piped
        return piped

    def _signatures(self, n_ops: int) -> None:
        """Static signature of each op for the memo: its rule, its values' sizes and roles
        (rematerialisable, part of an input's class), its loop trips and pass."""
        prog = self.program
        self._slot_values = [tuple(v for _, _, v, _ in self.part.op_layout(o)[0]) if not self._trivial[o] else ()
                             for o in range(n_ops)]
        sigs: dict = {}
        held = self._pipeline.gathered if self._pipeline else {}  # (read where the stage gathered it)
        self._sig = [sigs.setdefault((id(prog.ops[o].rule), self._mult[o], bool(self._backward[o]),
                                      tuple((self._nbytes[v], v in self._free, bool(self._virtual[v]),
                                             bool(self._feeds_backward[v]), v in held,
                                             tuple(self._nbytes[u] for u in self._mat_sources.get(v, ())))
                                            for v in self._slot_values[o])), len(sigs))
                     for o in range(n_ops)]

    def _moved(self, slots, shards) -> float:
        """The bytes a device's op reads and writes, its layout's `slots` as
        `Partitioning.op_layout` gives them and `shards(dims)` the devices a value tiled
        `dims` is split over: its materialized operands and results, and for a fused
        (virtual) operand the materialized values its fusion re-derives it from
        (`Materialization.sources`: a chain of cheap ops fused into a reader reads the
        chain's inputs), once each, split as the operand is (an elementwise chain's
        values share its tiling; a broadcast's source is smaller)."""
        direct = {v: dims for _, _, v, dims in slots if not self._virtual[v]}
        fused = {u: dims for side, _, v, dims in slots if side == "operand" and self._virtual[v]
                 for u in self._mat_sources.get(v, ()) if u not in direct}
        return sum(float(self._nbytes[v]) / shards(dims) for v, dims in (direct | fused).items())

    def _value_bytes(self) -> np.ndarray:
        """Each value's bytes per device in the current state: split as its class is, and
        one microbatch's where a pipeline runs it (`PipelinePricing.value_div`), and as
        the shard_map lowering's blockwise attentions keep them (`OnlineMemory`)."""
        out = self._nbytes / self._class_div[self._value_class] / self._value_div
        return out if self._online is None else self._online.value_bytes(out, self._rings)

    # -- incremental bookkeeping ---------------------------------------------------------
    def _refresh_classes(self, classes) -> None:
        mesh = self.part.mesh
        for c in classes:
            self._class_div[c] = mesh.devices_along(a for axes in self.part.class_dims(c) for a in axes)

    def _refresh_ops(self, ops) -> None:
        """Re-cost non-trivial ops: their division of work, bytes moved and reshard
        collectives. What an op costs depends only on its rule and value sizes (its
        static signature), its factor tiling and its values' tilings, so results are
        memoised on those: the ops of repeated layers are costed once."""
        part = self.part
        D, of = part.class_tilings, self._cls.of
        memo = self._memo
        if len(memo) > _MEMO_LIMIT:
            memo.clear()
        self._rings = ring_moves(part)
        for o in ops:
            slot_values = self._slot_values[o]
            key = (self._sig[o], part.factor_tiling(o), tuple(D[of[v]] for v in slot_values),
                   ring_signature(self._rings.get(o)))
            entry = memo.get(key)
            if entry is None:
                entry = memo[key] = self._pipeline.price(self, o) if self._piped[o] else self._price(o)
            div, moved, reshards, eff = entry
            self._op_div[o] = div
            self._eff[o] = eff
            self._op_bytes[o] = moved
            for dkey in self._op_cols.pop(o, ()):
                e = self._dedup[dkey]
                del e[o]
                if not e:
                    del self._dedup[dkey]
            if not reshards:
                continue
            keys = []
            for slot, side, index, dst, cols, buf in reshards:
                v = slot_values[slot]
                # One value moved to one layout once per pass, however many ops of that pass
                # read it there (XLA reuses the gathered buffer, which stays live from the
                # first reader to the last; the backward pass gathers again, as FSDP and
                # sequence parallelism do, and the lowering makes XLA do); it is
                # attributed to the first such op. A ring is each dot's own.
                if side == "ring":
                    dkey = ("ring", o, index)
                elif side == "operand":
                    # (a read in a pipeline's tick loops is not one outside them)
                    dkey = ("read", v, dst, bool(self._backward[o]), bool(self._piped[o]))
                elif side == "inside":  # a hand-partitioned region's own collectives
                    dkey = ("inside", o)
                else:
                    dkey = ("made", o, index)
                if dkey not in keys:  # an op reading one value twice (concat [x, x]) moves it once
                    keys.append(dkey)
                self._dedup.setdefault(dkey, {})[o] = (v, cols, buf)
            self._op_cols[o] = keys

    def _price(self, o: int):
        """(work division, bytes moved, reshards) of op `o` in the current state; each
        reshard is (slot, side, index, dst dims, collectives, bytes of its buffer): an
        operand's buffer in the layout the op reads, or what a result needs beyond its
        at-rest shard before a reduce-scatter or slice."""
        part, mesh = self.part, self.part.mesh
        layout = part.op_layout(o)
        div = _shards(part.factor_tiling(o), mesh)
        moved = self._moved(layout[0], lambda dims: _shards(dims, mesh))
        slot_of = {(side, k): i for i, (side, k, _, _) in enumerate(layout[0])}
        out = []
        eff = self._shard_efficiency(o, layout[0])
        ring = self._rings.get(o)
        for r in part.layout_reshards(o, layout):
            if r.value in self._free and not r.src.partial:
                continue
            if ring is not None and is_ring_reshard(ring, r):
                slot = slot_of[(r.side, r.index)]
                cols, buf, r = ring_collectives(self, o, ring, r, div, eff)
                out.append((slot, "ring", ring.slot, None, cols, buf))
                if r is None:  # all the ring does
                    continue
            cols = tuple(self._collectives(o, r))
            full = float(self._nbytes[r.value])
            if r.side == "operand":
                buf = full / _shards(r.dst.dims, mesh)
            else:
                buf = max(0.0, full / _shards(r.src.dims, mesh) - full / _shards(r.dst.dims, mesh))
            out.append((slot_of[(r.side, r.index)], r.side, r.index, r.dst.dims if r.side == "operand" else None,
                        cols, buf))
        inside = self._inside(o)
        if inside:
            out.append((0, "inside", 0, None, inside, 0.0))
        return div, moved, tuple(out), eff

    def _shard_efficiency(self, o: int, slots) -> float:
        """A matmul's efficiency on the shards the op computes (`_achieved`)."""
        op = self.program.ops[o]
        if op.primitive != "dot_general" or op.link:
            return 1.0
        mesh, vals = self.part.mesh, self.program.values
        shapes = {k: shard_shape(vals[v].shape, dims, mesh) for side, k, v, dims in slots if side == "operand"}
        if 0 not in shapes or 1 not in shapes:
            return float(self._eff[o])
        return dot_efficiency(op, shapes[0], shapes[1], self.device)

    def _inside(self, o: int) -> tuple[CollectiveCost, ...]:
        """The collectives a region the user partitioned by hand runs itself."""
        op = self.program.ops[o]
        if op.rule.fixed is None:
            return ()
        v = next((u for u in op.results + op.operands if u >= 0), -1)
        # `LinkModel.time` takes a reduce-scatter's operand; the HLO shows its result.
        operand = {Kind.REDUCE_SCATTER: self.part.mesh.devices_along}
        return tuple(CollectiveCost(kind, axes, nbytes,
                                    self.links.time(kind, axes, nbytes * operand.get(kind, lambda a: 1)(axes)), o, v,
                                    float(self._mult[o]) * trips)
                     for kind, axes, nbytes, trips in body_collectives(op.eqn.params["jaxpr"]))

    def _collectives(self, o: int, r) -> list[CollectiveCost]:
        val = self.program.values[r.value]
        full = float(self._nbytes[r.value])
        item = full / max(1, math.prod(val.shape))
        grad = bool(r.src.partial) and self._backward[o] and not self._feeds_backward[r.value]
        cols = self.links.reshard(r.src, r.dst, full, self.part.mesh)
        if (self.backend == "jit" and r.side == "result" and r.src.partial
                and self.program.ops[o].primitive == "dot_general"):
            cols = per_contracted_dim(cols, self._contracted_axes(o), self.links)
        return [CollectiveCost(kind, axes, nbytes, t, o, r.value, float(self._mult[o]), bool(grad),
                               nbytes / item if kind == Kind.ALL_REDUCE else 0.0)
                for kind, axes, nbytes, t in cols]

    def _order_cols(self) -> list:
        """(op, collective, value) of the permutations into and out of a balanced token
        order (`Partitioning.reorder`): each input along a reordered sequence moved to its
        permuted blocks where the step starts, each such output back where it ends, a
        collective-permute of its shard over the axes splitting the sequence (none where
        they do not split it)."""
        from partir import order_sites

        prog, part, out = self.program, self.part, []
        for label in sorted(part.orders):
            sites = order_sites(prog, label)
            for v, dims in [(prog.inputs[k], d) for k, d in sites.inputs] + [(prog.outputs[k], d)
                                                                            for k, d in sites.outputs]:
                tiling = part.tiling(v)
                axes = tuple(a for d in dims for a in tiling.dims[d] if part.mesh.size(a) > 1)
                if not axes:
                    continue
                o = prog.users[v][0] if prog.producer[v] < 0 or v in prog.inputs else prog.producer[v]
                nbytes = float(self._nbytes[v]) / tiling.num_shards(part.mesh)
                t = self.links.time(Kind.COLLECTIVE_PERMUTE, axes, nbytes)
                out.append((o, CollectiveCost(Kind.COLLECTIVE_PERMUTE, axes, nbytes, t, o, v), v))
        return out

    def _contracted_axes(self, o: int) -> list[tuple[str, ...]]:
        """The axes splitting each contracted dim of dot `o`, minor dim first (the order
        XLA reduces them in, `_comm.per_contracted_dim`)."""
        op = self.program.ops[o]
        F, reduction = self.part.factor_tiling(o), op.rule.reduction
        lhs = [fs for fs in op.rule.operands[0] if any(f in reduction for f in fs)]
        return [tuple(a for f in fs for a in F[f]) for fs in reversed(lhs)]

    def _sync(self) -> None:
        if self.part.pipelines != self._pipelines:  # what every op's price rests on changed
            self.__init__(self.part, self.device, memory_limit=self.memory_limit, donate_argnums=self._donated,
                          links=self._links_given, while_trips=self._while_trips, backend=self.backend)
            return
        classes, ops = self.part.take_touched()
        if not classes and not ops:
            return
        self._refresh_classes(classes)
        todo = {o for o in ops if not self._trivial[o]}
        for c in classes:
            todo.update(self._cls.ops[c])
        if self._pipeline is not None:  # the microbatched plan follows the whole plan
            self._pipeline = PipelinePricing(self.part, self.links, self.device)
            todo.update(self._pipeline.ops)
        live = self.materialization.live_op
        self._refresh_ops([o for o in todo if live[o]])
        self._add_pipeline_collectives()

    def _add_pipeline_collectives(self) -> None:
        """The pipelines' own collectives, as moves of the ops they are charged at."""
        for key in [k for k in self._dedup if k[0] == "pipeline"]:
            del self._dedup[key]
        for n, (o, v, cols, *live) in enumerate(self._pipeline.collectives(self) if self._pipeline else ()):
            # (A weight gathered before a tick loop: its buffer, live from `o` to `last`.)
            last, buf = live[0] if live else (o, 0.0)
            self._dedup[("pipeline", n)] = {o: (v, cols, buf), **({last: (v, (), buf)} if last > o else {})}

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self) -> tuple[float, float]:
        """(step time, fast estimate of the peak memory): the search's fast path."""
        parts, peak = self.evaluate_parts()
        return parts.step(self.device)[0], peak

    def evaluate_parts(self):
        """(the step's `TimeParts`, fast estimate of the peak memory): `evaluate` before
        overlap is applied, for shallow twins to extrapolate term by term."""
        parts, _, peak = self._evaluate(repeated=False)
        return parts, peak

    def accumulation_parts(self):
        """`evaluate_parts` with, between them, the `TimeParts` (no compute) of the
        collectives that do not grow with the batch yet run every micro-batch of a step
        that accumulates gradients: FSDP's parameter gathers and its gradients'
        reduce-scatters (`_achieved.repeated_per_micro_batch`, `search._accum`)."""
        return self._evaluate(repeated=True)

    def _evaluate(self, *, repeated: bool):
        self._sync()
        times, _, extra = self._op_times()
        again, again_cols = self._recomputed(times)
        compute = float(times.sum()) + again + float(extra.sum())
        cols_again = again_cols + self._order_cols()
        parts = self._parts(times, self._again_ops(extra), compute, cols_again)
        peak = self._memory(self._value_bytes(), exact=False)[0]
        return parts, self._repeated_parts(cols_again) if repeated else None, peak

    def cost(self, *, top: int = 10) -> Cost:
        """The full breakdown of the current partitioning."""
        self._sync()
        prog = self.program
        times, div, kernel_again = self._op_times()
        again, again_cols = self._recomputed(times)
        again_cols += self._order_cols()
        compute = float(times.sum()) + again + float(kernel_again.sum())
        step, exposed = self._step(times, self._again_ops(kernel_again), compute, again_cols)
        firsts = sorted(((min(e), e[min(e)]) for _, e in self._timed_moves()), key=lambda t: (t[0], t[1][0]))
        cols = tuple(dataclasses.replace(c, op=o, value=v) for o, (v, cs, _) in firsts for c in cs) + tuple(
            c for _, c, _ in again_cols)
        value_bytes = self._value_bytes()
        peak, t, buf, liveness, extra = self._memory(value_bytes, exact=True)
        live = liveness.live_at(t, extra[:3])
        live = live[np.argsort(-buf[live], kind="stable")][:top]
        order = np.argsort(-times, kind="stable")[:top]
        work = self._flops / div * self.materialization.live_op
        view = self._view()
        redo = view.work(work, self._mult) if view is not None else 0.0
        # Loops once, as XLA's cost analysis counts a loop body: the recomputation too.
        once = view.work(work, np.ones_like(work)) if view is not None else 0.0
        if self._online is not None:  # the blockwise attentions' backward Q K^T, computed again
            redo += sum(float(work[o] * self._mult[o]) for o in self._online.recomputed(self._rings))
        return Cost(
            device=self.device.name,
            mesh=str(self.part.mesh),
            flops=float((work * self._mult).sum() + redo) + sum(c.flops * c.count for c in cols),
            flops_loops_once=float(work.sum()) + once + sum(c.flops for c in cols),
            transcendentals=float((self._trans / div * self._mult * self.materialization.live_op).sum()),
            compute_time=compute,
            backward_compute_time=float(times[self._backward].sum()) + again + float(kernel_again.sum()),
            comm_time=self.links.total_time(cols),
            exposed_comm_time=exposed,
            overlap=self.device.overlap,
            gradient_comm_time=self.links.total_time(c for c in cols if c.gradient),
            collectives=cols,
            memory_peak=peak,
            memory_at_peak=tuple((self._name_of_buffer(b, liveness, extra[3]), float(buf[b])) for b in live
                                 if buf[b] > 0),
            argument_bytes=float(sum(value_bytes[v] for v in prog.inputs)),
            memory_limit=self.memory_limit,
            top_ops=tuple((op_label(prog, o), float(times[o])) for o in order if times[o] > 0),
            pipeline_ticks=self._pipeline.tick_times(self, times) if self._pipeline else (),
        )


def _whole_slots(op) -> list:
    """`op`'s operands and results as `CostModel._moved` takes a layout's slots, whole
    (each one shard: no dims)."""
    return [(side, 0, v, ()) for side, values in (("operand", op.operands), ("result", op.results))
            for v in values if v >= 0]


def _shards(dims, mesh) -> int:
    """Devices along the axes of a dim tiling (or factor tiling)."""
    return mesh.devices_along(a for axes in dims for a in axes)

