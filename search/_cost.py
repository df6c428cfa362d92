"""The cost of a partitioned program: per-device compute, communication and peak memory.

Objective (what the search minimises), per device and per training step:

    compute_time = sum over ops of  trips(op) * (max((flops + transcendentals) / k
                                                        / (peak(dtype) * efficiency(op)),
                                                        bytes_moved / hbm_bandwidth)
                                                    + op_overhead if a matmul)
    comm_time    = sum over collectives of  trips * alpha-beta ring time   (see `_comm`)
    step_time    = compute_time + exposed communication          (see `_timing`)
    step_time_overlap = step_time where the device overlaps; else compute_time
                        + comm_time - min(gradient_comm, backward_compute)  (gradient
                        reductions hidden behind the backward pass)
    memory_peak  = max over program order of live bytes          (see `_memory`)

where `k` is the number of devices an op's factor tiling splits it over, `trips` is the
product of the trip counts of the loops around the op (a scan body counts `length`
times; XLA's own analysis counts it once), and a plan is feasible when `memory_peak`
fits the memory limit (the device's HBM unless given).

The device's time model (`search._device`) says what the hardware achieves: a matmul's
`efficiency(op)` (`_timing.dot_efficiency`: below the datasheet, lower for small and
skinny matmuls), a per-kernel `op_overhead`, which collectives run behind compute
(`_timing`), and whether attention is the fused kernel (`_attention`): then the
kernel's ops take no time of their own and its matmuls run at `attention_efficiency`
of peak, on the tiles a causal mask leaves, plus `Q K^T` again in the backward kernel.
On the `cpu` preset all of it is the identity: the model is the roofline XLA:CPU runs.

Re-costing is incremental: the model consumes what the partitioning reports changed
(`Partitioning.take_touched`), recomputes only the non-trivial ops involved, and
re-derives the totals with vectorised sums over per-op arrays.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from partir import Tiling

from ._comm import CollectiveCost, LinkModel, gradient_groups
from ._device import get_device, link_levels
from ._flops import op_work
from ._fusion import materialization
from ._manual import body_collectives
from ._memory import Liveness
from ._moves import MoveBuffers
from ._remat import RematView
from ._timing import batch_free, dot_efficiency, overlappable, shard_shape, step_time


#: Memoised op prices kept before the memo is cleared (bounds memory in long searches).
_MEMO_LIMIT = 200_000

#: The backward ops that turn an activation's gradient into a weight's: contractions
#: (`dW = X^T dY`) and the transpose of a lookup (an embedding table's gradient is a
#: scatter-add of the rows' gradients). A partial sum one of them depends on is an
#: activation gradient, reduced on the critical path; one none of them depends on is a
#: weight's gradient. Without the scatter-add, the first layer's input gradient of an
#: unrolled model (read by the embedding's scatter-add alone) passed for a weight's,
#: where a scan's carry gradient, read by the next trip's contractions, does not.
WEIGHT_GRADIENT_OPS = frozenset(("dot_general", "conv_general_dilated", "scatter-add"))


@dataclass(frozen=True)
class Cost:
    """A readable cost breakdown; `print(cost)` or `rich.print(cost)` shows the tables."""

    device: str
    mesh: str
    flops: float
    flops_loops_once: float
    transcendentals: float
    compute_time: float
    backward_compute_time: float
    comm_time: float
    exposed_comm_time: float
    overlap: bool
    gradient_comm_time: float
    collectives: tuple[CollectiveCost, ...]
    memory_peak: float
    memory_at_peak: tuple[tuple[str, float], ...]
    argument_bytes: float
    memory_limit: float
    top_ops: tuple[tuple[str, float], ...]

    @property
    def step_time(self) -> float:
        """Compute plus the communication it does not hide (seconds): all of it where
        the device does not overlap (`DeviceSpec.overlap`), see `_timing`."""
        return self.compute_time + self.exposed_comm_time

    @property
    def step_time_overlap(self) -> float:
        """Step time with gradient reductions overlapping the backward pass (seconds):
        `step_time` where the device's model overlaps already."""
        if self.overlap:
            return self.step_time
        hidden = min(self.gradient_comm_time, self.backward_compute_time)
        return self.compute_time + self.comm_time - hidden

    @property
    def fits(self) -> bool:
        """Whether the peak memory fits the memory limit."""
        return self.memory_peak <= self.memory_limit

    def by_kind(self) -> dict[str, tuple[float, float]]:
        """Collective kind -> (count per step, bytes per device per step)."""
        out: dict[str, list] = {}
        for c in self.collectives:
            e = out.setdefault(c.kind, [0.0, 0.0])
            e[0] += c.count
            e[1] += c.bytes * c.count
        return {k: tuple(v) for k, v in sorted(out.items())}

    def by_axis(self) -> dict[tuple[str, ...], tuple[float, float, float]]:
        """Mesh axes -> (count, bytes, seconds) per step, over all kinds."""
        out: dict[tuple, list] = {}
        for c in self.collectives:
            e = out.setdefault(c.axes, [0.0, 0.0, 0.0])
            e[0] += c.count
            e[1] += c.bytes * c.count
            e[2] += c.time * c.count
        return {k: tuple(v) for k, v in sorted(out.items())}

    def __rich_console__(self, console, options):
        from ._report import cost_tables

        yield from cost_tables(self)

    def __str__(self) -> str:
        import io

        from rich.console import Console

        console = Console(width=120, file=io.StringIO())
        console.print(self)
        return console.file.getvalue()


class CostModel:
    """Costs one `Partitioning` on one device, incrementally as it changes.

    `device` is a preset name, a `DeviceSpec` or a JSON/TOML path; `memory_limit`
    defaults to the device's HBM; `donate_argnums` lists donated (non-static) arguments;
    `links` overrides the link level ('intra'/'inter') of mesh axes; `while_trips` is
    the trip count assumed for `while` loops (unknown statically).
    """

    def __init__(self, part, device="h100", *, memory_limit: float | None = None, donate_argnums=(),
                 links: dict[str, str] | None = None, while_trips: int = 1):
        prog = part.program
        self.part, self.program = part, prog
        self.device = get_device(device)
        self.memory_limit = float(memory_limit if memory_limit is not None else self.device.hbm_bytes)
        self.levels = link_levels(part.mesh.axes, self.device, links)
        self.links = LinkModel(part.mesh, self.device, self.levels)
        cls = part.classes
        self._cls = cls
        n_ops = len(prog.ops)
        mult = [prog.multiplicity(r.id, while_trips) for r in prog.regions]
        self._mult = np.array([mult[op.region] for op in prog.ops], dtype=float)
        work = np.array([op_work(op, prog) for op in prog.ops], dtype=float).reshape(n_ops, 2)
        self._flops, self._trans = work[:, 0], work[:, 1]
        self._peak = np.array([self.device.flops_for(_dtype(op, prog)) for op in prog.ops])
        self._backward = np.array(prog.backward, dtype=bool)
        self._op_region = [op.region for op in prog.ops]
        self._trivial = np.array(cls.trivial, dtype=bool)
        self._op_class = np.array([s[0][0] if (t and s) else 0 for s, t in zip(cls.single, cls.trivial)], dtype=np.int64)
        vals = prog.values
        # What XLA really runs and keeps (`_fusion`): dead ops cost nothing; fused values
        # (broadcasts, iotas, what is made from them) are no buffer and no memory traffic.
        self.materialization = mat = materialization(prog, self.device.fused_attention)
        self._timing_setup(prog, mat)
        self._virtual = mat.virtual
        # Ops that take time: live, not fused away, not a link (links only rename buffers;
        # a scan's per-iteration slices and stacked outputs are read and written by the
        # ops that use them, which pay for those bytes).
        self._runs = mat.live_op & ~np.array([op.link or (bool(op.results) and all(v < 0 or mat.virtual[v]
                                                                                 for v in op.results))
                                              for op in prog.ops], dtype=bool)
        self._nbytes = np.array([v.nbytes for v in vals], dtype=float)
        self._value_class = np.array(cls.of, dtype=np.int64)
        self._op_bytes_full = np.array([sum(vals[v].nbytes for v in op.operands + op.results
                                            if v >= 0 and not mat.virtual[v]) for op in prog.ops], dtype=float)
        self._class_div = np.ones(len(cls))
        self._op_div = np.ones(n_ops)
        self._op_bytes = self._op_bytes_full.copy()
        # Values made from scalars alone (a broadcast constant, an iota, a causal mask) can
        # be made in any layout where they are needed: XLA makes them, never moves them.
        self._free = set(np.nonzero(mat.from_scalars)[0].tolist())
        heavy = np.array([op.primitive in WEIGHT_GRADIENT_OPS for op in prog.ops], dtype=bool)
        self._feeds_backward = _feeds_backward(prog, self._backward & heavy)
        self._donated = tuple(donate_argnums)
        self.liveness = Liveness(prog, mat, donate_argnums)
        self._move_buffers = MoveBuffers(part, self.device, mat)  # the backend's ways with moves
        self._views: dict = {}  # recomputed residuals -> RematView
        self._buffer_name = {}
        self._op_cols: dict[int, list] = {}
        self._memo: dict = {}
        # Static signature of each op for the memo: its rule, its values' sizes and roles
        # (rematerialisable, part of an input's class), its loop trips and pass.
        self._slot_values = [tuple(v for _, _, v, _ in part.op_layout(o)[0]) if not cls.trivial[o] else ()
                             for o in range(n_ops)]
        sigs: dict = {}
        self._sig = [sigs.setdefault((id(prog.ops[o].rule), self._mult[o], bool(self._backward[o]),
                                      tuple((self._nbytes[v], v in self._free, bool(self._virtual[v]),
                                             bool(self._feeds_backward[v]))
                                            for v in self._slot_values[o])), len(sigs))
                     for o in range(n_ops)]
        self._dedup: dict = {}
        part.take_touched()
        self._refresh_classes(range(len(cls)))
        self._refresh_ops([o for o in range(n_ops) if not cls.trivial[o] and mat.live_op[o]])

    def _timing_setup(self, prog, mat) -> None:
        """Static arrays of the device's time model: each op's matmul efficiency on its
        whole shapes (a partitioned op's is re-derived on its shards), the fused
        attention kernel's matmuls, the values the batch does not reach (weights), and
        each op's computation (region, pass) for overlap."""
        from tactics import roles

        vals, dev = prog.values, self.device
        self._eff = np.array([dot_efficiency(op, vals[op.operands[0]].shape, vals[op.operands[1]].shape, dev)
                              if op.primitive == "dot_general" and not op.link else 1.0 for op in prog.ops])
        self._is_dot = np.array([op.primitive == "dot_general" and not op.link for op in prog.ops], dtype=bool)
        att = mat.attention
        n_ops = len(prog.ops)
        self._kernel = att.dots & mat.live_op if att is not None else np.zeros(n_ops, dtype=bool)
        self._kernel_work = att.work if att is not None else np.ones(n_ops)
        self._kernel_again = att.recompute * mat.live_op if att is not None else np.zeros(n_ops)
        self._weights = batch_free(prog, roles(prog).batch)
        keys: dict = {}
        self._bucket = np.array([keys.setdefault((op.region, bool(b)), len(keys))
                                 for op, b in zip(prog.ops, prog.backward)], dtype=np.int64)
        self._bucket_bwd = np.array([keys.setdefault((op.region, True), len(keys)) for op in prog.ops],
                                    dtype=np.int64)
        self._n_buckets = len(keys)
        self._bucket_parents = _bucket_parents(prog, keys)

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
        for o in ops:
            slot_values = self._slot_values[o]
            key = (self._sig[o], part.factor_tiling(o), tuple(D[of[v]] for v in slot_values))
            entry = memo.get(key)
            if entry is None:
                entry = memo[key] = self._price(o)
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
                # attributed to the first such op.
                if side == "operand":
                    dkey = ("read", v, dst, bool(self._backward[o]))
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
        moved = sum(float(self._nbytes[v]) / _shards(dims, mesh) for _, _, v, dims in layout[0]
                    if not self._virtual[v])
        slot_of = {(side, k): i for i, (side, k, _, _) in enumerate(layout[0])}
        out = []
        for r in part.layout_reshards(o, layout):
            if r.value in self._free and not r.src.partial:
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
        return div, moved, tuple(out), self._shard_efficiency(o, layout[0])

    def _shard_efficiency(self, o: int, slots) -> float:
        """A matmul's efficiency on the shards the op computes (`_timing`)."""
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
        operand = {"reduce-scatter": self.part.mesh.devices_along}
        return tuple(CollectiveCost(kind, axes, nbytes,
                                    self.links.time(kind, axes, nbytes * operand.get(kind, lambda a: 1)(axes)), o, v,
                                    float(self._mult[o]) * trips)
                     for kind, axes, nbytes, trips in body_collectives(op.eqn.params["jaxpr"]))

    def _collectives(self, o: int, r) -> list[CollectiveCost]:
        val = self.program.values[r.value]
        full = float(self._nbytes[r.value])
        item = full / max(1, math.prod(val.shape))
        grad = bool(r.src.partial) and self._backward[o] and not self._feeds_backward[r.value]
        return [CollectiveCost(kind, axes, nbytes, t, o, r.value, float(self._mult[o]), bool(grad),
                               nbytes / item if kind == "all-reduce" else 0.0)
                for kind, axes, nbytes, t in self.links.reshard(r.src, r.dst, full, self.part.mesh)]

    def _sync(self) -> None:
        classes, ops = self.part.take_touched()
        if not classes and not ops:
            return
        self._refresh_classes(classes)
        todo = {o for o in ops if not self._cls.trivial[o]}
        for c in classes:
            todo.update(self._cls.ops[c])
        live = self.materialization.live_op
        self._refresh_ops([o for o in todo if live[o]])

    # -- evaluation ------------------------------------------------------------------------
    def _op_times(self):
        """(seconds per op per step, work division, seconds the backward attention
        kernel spends recomputing each forward score dot's `Q K^T`)."""
        dev = self.device
        div = np.where(self._trivial, self._class_div[self._op_class], self._op_div)
        moved = np.where(self._trivial, self._op_bytes_full / div, self._op_bytes)
        work = (self._flops + self._trans) / div
        eff = np.where(self._is_dot, self._eff * dev.matmul_efficiency, 1.0)
        times = np.maximum(work / (self._peak * eff), moved / dev.hbm_bandwidth) * self._mult * self._runs
        kernel = self._flops / div / (self._peak * dev.attention_efficiency) * self._mult
        times = np.where(self._kernel, kernel * self._kernel_work, times)
        if dev.op_overhead > 0:
            # Matmuls and attention kernels, each a kernel of its own in any form of the
            # program; elementwise ops fuse into them or into few loop fusions, as many
            # in a scan as unrolled, which the op list does not follow one to one.
            times = times + dev.op_overhead * self._mult * ((times > 0) & self._is_dot)
        return times, div, kernel * self._kernel_again

    def _step(self, times, again_ops, compute: float, cols_again) -> tuple[float, float]:
        """(step time, exposed communication) of the current state (`_timing`)."""
        if not self.device.overlap:
            cols = [c for _, e in self._moves() for c in e[min(e)][1]] + [c for _, c, _ in cols_again]
            return step_time(self.device, self.links, compute, {}, [(None, c, False) for c in cols])
        buckets = np.bincount(self._bucket, weights=times, minlength=self._n_buckets)
        redo, skipped, extra = again_ops
        buckets += np.bincount(self._bucket_bwd, weights=extra, minlength=self._n_buckets)
        if redo is not None:
            buckets += np.bincount(self._bucket_bwd[redo], weights=times[redo], minlength=self._n_buckets)
            buckets -= np.bincount(self._bucket[skipped], weights=times[skipped], minlength=self._n_buckets)
        moves = []
        for _, e in self._moves():
            first = min(e)
            v, cs, _ = e[first]
            moves += [(int(self._bucket[first]), c, overlappable(c, v, self._weights, self.device)) for c in cs]
        moves += [(int(self._bucket_bwd[o]), c, overlappable(c, v, self._weights, self.device)) for o, c, v in cols_again]
        return step_time(self.device, self.links, compute, dict(enumerate(buckets.tolist())), moves,
                         self._bucket_parents)

    def _reshard_buffers(self):
        """(starts, ends, bytes, keys) of the buffers reshards make: a value in the layout
        its readers want, live from the first such reader to the last; the whole result of
        an op that is reduce-scattered or sliced after it, for that op. Gradient
        reductions are combined (see `gradient_groups`): a gradient's whole result waits
        for its group's collective, and a backend without reduce-scatter holds every
        member's all-reduced result there at once. `MoveBuffers` says how the backend
        differs."""
        starts, ends, sizes, keys = [], [], [], []
        grads = []
        for key, e in self._moves():
            first = min(e)
            v, cols, buf = e[first]
            if key[0] == "made" and any(c.gradient for c in cols):
                grads.append((first, key, cols, buf))
            elif buf > 0:
                mb = self._move_buffers
                starts.append(mb.start(key, v, first)), sizes.append(buf * mb.copies(key, v, e))
                ends.append(mb.end(key, e[first], max(e))), keys.append(key)
        for group in gradient_groups(sorted(grads, key=lambda g: g[0]), self._op_region):
            last = group[-1][0]
            for first, key, cols, buf in group:
                if buf > 0:
                    starts.append(first), ends.append(last), sizes.append(buf), keys.append(key)
            whole = sum(c.bytes for _, _, cols, _ in group for c in cols if c.kind == "all-reduce")
            if whole > 0:
                starts.append(last), ends.append(last), sizes.append(whole), keys.append(group[-1][1])
        return np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64), np.array(sizes), keys

    def _view(self):
        """The rematerialization view of the current recomputed residuals, or None."""
        rec, reused = self.part.rematerialized, self.part.reused
        if not rec and not reused:
            return None
        view = self._views.get((rec, reused))
        if view is None:
            view = self._views[(rec, reused)] = RematView(self.program, self.materialization, self._donated, rec,
                                                          reused)
        return view

    def _moves(self) -> list:
        """(key, entry) of the reshards (entry: op -> (value, collectives, buffer)) of the
        ops that run (a relaxed checkpoint's skipped ops move nothing)."""
        view = self._view()
        return list(self._dedup.items()) if view is None else view.running(self._dedup)

    def _memory(self, value_bytes, *, exact: bool):
        """(peak, op index, buffer bytes, liveness, keys of the extra buffers): the
        buffers of reshards and of recomputation beside the program's."""
        view = self._view()
        starts, ends, sizes, keys = self._reshard_buffers()
        if view is not None:
            vs, ve, vz = view.buffers(value_bytes)
            starts, ends, sizes = np.concatenate([starts, vs]), np.concatenate([ends, ve]), np.concatenate([sizes, vz])
            keys = keys + [("remat", v) for _, _, v, _ in view.extra]
        liveness = view.liveness if view is not None else self.liveness
        peak, t, buf = liveness.peak(value_bytes, (starts, ends, sizes), exact=exact)
        return peak, t, buf, liveness, (starts, ends, sizes, keys)

    def _recomputed(self, times) -> tuple[float, list]:
        """(seconds, (op, collective, value) triples) of the forward ops the backward
        pass runs again."""
        view = self._view()
        if view is None:
            return 0.0, []
        skipped = -float(times[view.skipped].sum())  # a relaxed checkpoint's ops that no longer run
        # A recomputed op runs in the backward pass, behind the barrier that keeps XLA
        # from merging it into the forward pass: what it reads it moves again, even in a
        # layout the backward pass moves the value to as well (an FSDP weight gathered
        # for the gradients), as XLA runs it in unrolled code and in a scan's backward
        # loop alike; recomputed ops that read a value in one layout move it once.
        cols, moved = [], set()
        for o in view.ops.tolist():
            for key in self._op_cols.get(o, ()):
                if key[0] == "read":
                    if key in moved:
                        continue
                    moved.add(key)
                v, cs, _ = self._dedup[key][o]
                cols += [(o, c, v) for c in cs]
        return float(times[view.ops].sum()) + skipped, cols

    def _again_ops(self, extra):
        """(recomputed ops, skipped ops, backward kernel recompute seconds) for `_step`."""
        view = self._view()
        return (None, None, extra) if view is None else (view.ops, view.skipped, extra)

    def exact_peak(self) -> float:
        """The peak memory as `cost()` gives it (XLA's buffer assignment emulated)."""
        self._sync()
        return self._memory(self._nbytes / self._class_div[self._value_class], exact=True)[0]

    def evaluate(self) -> tuple[float, float]:
        """(step time without overlap, fast estimate of the peak memory): the search's
        fast path."""
        self._sync()
        times, _, extra = self._op_times()
        again, again_cols = self._recomputed(times)
        compute = float(times.sum()) + again + float(extra.sum())
        step, _ = self._step(times, self._again_ops(extra), compute, again_cols)
        peak = self._memory(self._nbytes / self._class_div[self._value_class], exact=False)[0]
        return step, peak

    def cost(self, *, top: int = 10) -> Cost:
        """The full breakdown of the current partitioning."""
        self._sync()
        prog = self.program
        times, div, kernel_again = self._op_times()
        again, again_cols = self._recomputed(times)
        compute = float(times.sum()) + again + float(kernel_again.sum())
        step, exposed = self._step(times, self._again_ops(kernel_again), compute, again_cols)
        firsts = sorted(((min(e), e[min(e)]) for _, e in self._moves()), key=lambda t: (t[0], t[1][0]))
        cols = tuple(dataclasses.replace(c, op=o, value=v) for o, (v, cs, _) in firsts for c in cs) + tuple(
            c for _, c, _ in again_cols)
        value_bytes = self._nbytes / self._class_div[self._value_class]
        peak, t, buf, liveness, extra = self._memory(value_bytes, exact=True)
        live = liveness.live_at(t, extra[:3])
        live = live[np.argsort(-buf[live], kind="stable")][:top]
        order = np.argsort(-times, kind="stable")[:top]
        work = self._flops / div * self.materialization.live_op
        view = self._view()
        redo, skip = view.work(work, self._mult) if view is not None else (0.0, 0.0)
        return Cost(
            device=self.device.name,
            mesh=str(self.part.mesh),
            flops=float((work * self._mult).sum() + redo) + sum(c.flops * c.count for c in cols),
            flops_loops_once=float(work.sum()) - skip + sum(c.flops for c in cols),
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
            top_ops=tuple((_op_label(prog, o), float(times[o])) for o in order if times[o] > 0),
        )

    def _name_of_buffer(self, b: int, liveness, extra_keys) -> str:
        if b >= liveness.num_buffers:  # a reshard's or a recomputation's buffer
            key = extra_keys[b - liveness.num_buffers]
            if key[0] == "read":
                return f"{self.program.name(key[1])} as {Tiling(key[2])}"
            if key[0] == "remat":
                return f"{self.program.name(key[1])} recomputed"
            return f"{_op_label(self.program, key[1])} as computed"
        cache = self._buffer_name.setdefault(id(liveness), {})
        name = cache.get(b)
        if name is None:
            members = np.nonzero(liveness.buffer == b)[0]
            is_input = set(self.program.inputs)
            inputs = [v for v in members if v in is_input]
            name = cache[b] = self.program.name(int(inputs[0] if inputs else members[0]))
        return name


def _bucket_parents(prog, keys: dict) -> dict:
    """Computation id -> the id of the one enclosing it (its region's parent, same pass;
    None at the top), innermost first (`_timing.step_time`)."""
    regions = prog.regions

    def depth(r):
        d = 0
        while regions[r].parent is not None and regions[r].parent >= 0:
            r, d = regions[r].parent, d + 1
        return d

    out = {}
    for (region, backward), k in sorted(keys.items(), key=lambda kv: -depth(kv[0][0])):
        parent = regions[region].parent
        if parent is not None and parent >= 0:
            out[k] = keys.setdefault((parent, backward), len(keys))
        else:
            out[k] = None
    return out


def _shards(dims, mesh) -> int:
    """Devices along the axes of a dim tiling (or factor tiling)."""
    return mesh.devices_along(a for axes in dims for a in axes)


def _feeds_backward(prog, backward) -> np.ndarray:
    """Per value: does any of the `backward` ops (the backward pass's contractions and
    lookups' transposes, `WEIGHT_GRADIENT_OPS`) depend on it? Activation gradients do; a
    weight gradient feeds only reshapes and the optimizer, so its reduction can overlap
    the rest of the backward pass. Ops are in
    execution order except loop-carry links, hence a second sweep."""
    feeds = np.zeros(len(prog.values), dtype=bool)
    for _ in range(2):
        for op in reversed(prog.ops):
            out = bool(backward[op.id]) or any(feeds[v] for v in op.results if v >= 0)
            if out:
                for v in op.operands:
                    if v >= 0:
                        feeds[v] = True
    return feeds


def _dtype(op, prog):
    for v in op.operands + op.results:
        if v >= 0:
            return prog.values[v].dtype
    return np.float32


def _op_label(prog, o: int) -> str:
    op = prog.ops[o]
    res = next((v for v in op.results if v >= 0), None)
    return prog.name(res) if res is not None else op.primitive


def bytes_str(n: float) -> str:
    """Human-readable bytes (KiB/MiB/GiB)."""
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def time_str(s: float) -> str:
    """Human-readable seconds."""
    return f"{s * 1e3:.3f} ms" if s >= 1e-4 else f"{s * 1e6:.2f} us"
