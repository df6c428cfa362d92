"""The time half of `CostModel` (`search.cost._model`): the static arrays of the device's
time model, each op's seconds, and the step's time with communication overlapped
(`_achieved`) and recomputation (`_remat`) added."""

from __future__ import annotations

import numpy as np

from partir import computations, depended_on

from ._achieved import TimeParts, batch_free, dot_efficiency, overlappable, repeated_per_micro_batch, time_parts
from ._attention import causal_imbalance


#: The backward ops that turn an activation's gradient into a weight's: contractions
#: (`dW = X^T dY`) and the transpose of a lookup (an embedding table's gradient is a
#: scatter-add of the rows' gradients). A partial sum one of them depends on is an
#: activation gradient, reduced on the critical path; one none of them depends on is a
#: weight's gradient. Without the scatter-add, the first layer's input gradient of an
#: unrolled model (read by the embedding's scatter-add alone) passed for a weight's,
#: where a scan's carry gradient, read by the next trip's contractions, does not.
WEIGHT_GRADIENT_OPS = frozenset(("dot_general", "conv_general_dilated", "scatter-add"))


class CostTime:
    """What `CostModel` adds up into a step's time (it mixes this class in: the methods
    read the model's per-op arrays)."""

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
        comp = computations(prog)  # calls run inlined in their caller's computation
        self._bucket = np.array([keys.setdefault((comp[op.region], bool(b)), len(keys))
                                 for op, b in zip(prog.ops, prog.backward)], dtype=np.int64)
        self._bucket_bwd = np.array([keys.setdefault((comp[op.region], True), len(keys)) for op in prog.ops],
                                    dtype=np.int64)
        self._n_buckets = len(keys)
        self._bucket_parents = bucket_parents(prog, keys)

    def _op_times(self):
        """(seconds per op per step, work division, seconds the backward attention
        kernel, or the shard_map lowering's blockwise attention, spends recomputing each
        forward score dot's `Q K^T`)."""
        dev = self.device
        div = np.where(self._trivial, self._class_div[self._op_class], self._op_div)
        moved = np.where(self._trivial, self._op_bytes_full / div, self._op_bytes)
        work = (self._flops + self._trans) / div
        eff = np.where(self._is_dot, self._eff * dev.matmul_efficiency, 1.0)
        times = np.maximum(work / (self._peak * eff), moved / dev.hbm_bandwidth) * self._mult * self._runs
        kernel = self._flops / div / (self._peak * dev.attention_efficiency) * self._mult
        if self._kernel.any():  # a causal kernel split by its queries: the busiest device
            kernel = np.where(self._kernel_work < 1, kernel * causal_imbalance(self.part), kernel)
        times = np.where(self._kernel, kernel * self._kernel_work, times)
        if dev.op_overhead > 0:
            # Matmuls and attention kernels, each a kernel of its own in any form of the
            # program; elementwise ops fuse into them or into few loop fusions, as many
            # in a scan as unrolled, which the op list does not follow one to one.
            times = times + dev.op_overhead * self._mult * ((times > 0) & self._is_dot)
        again = kernel * self._kernel_again
        if self._online is not None:  # a blockwise attention's backward computes Q K^T again
            for o in self._online.recomputed(self._rings):
                again[o] = max(again[o], times[o])
        return times, div, again

    def _step(self, times, again_ops, compute: float, cols_again) -> tuple[float, float]:
        """(step time, exposed communication) of the current state (`_achieved`)."""
        return self._parts(times, again_ops, compute, cols_again).step(self.device)

    def _parts(self, times, again_ops, compute: float, cols_again) -> TimeParts:
        """The step's `TimeParts` in the current state (`_achieved`)."""
        if not self.device.overlap:
            cols = [c for _, c, _, _ in self._move_list(cols_again)]
            return time_parts(self.device, self.links, compute, {}, [(None, c, False) for c in cols])
        buckets = np.bincount(self._bucket, weights=times, minlength=self._n_buckets)
        redo, skipped, extra = again_ops
        buckets += np.bincount(self._bucket_bwd, weights=extra, minlength=self._n_buckets)
        if redo is not None:
            buckets += np.bincount(self._bucket_bwd[redo], weights=times[redo], minlength=self._n_buckets)
            buckets -= np.bincount(self._bucket[skipped], weights=times[skipped], minlength=self._n_buckets)
        moves = [(k, c, over) for k, c, over, _ in self._move_list(cols_again)]
        return time_parts(self.device, self.links, compute, dict(enumerate(buckets.tolist())), moves,
                          self._bucket_parents)

    def _move_list(self, cols_again) -> list:
        """(computation, collective, overlappable, value) of every collective of the
        step: each reshard's, then the recomputed ops' and the others of `cols_again`."""
        out = []
        for _, e in self._timed_moves():
            first = min(e)
            v, cs, _ = e[first]
            out += [(int(self._bucket[first]), c, overlappable(c, v, self._weights, self.device), v) for c in cs]
        out += [(int(self._bucket_bwd[o]), c, overlappable(c, v, self._weights, self.device), v)
                for o, c, v in cols_again]
        return out

    def _repeated_parts(self, cols_again) -> TimeParts:
        """The `TimeParts` of the collectives that do not grow with the batch but run
        again every micro-batch of an accumulated step (`repeated_per_micro_batch`),
        with no compute: what `search._accum` adds once per further micro-batch."""
        every = self._move_list(cols_again)
        again = repeated_per_micro_batch([(c, v) for _, c, _, v in every], self._weights)
        moves = [(k, c, over and self.device.overlap) for (k, c, over, _), r in zip(every, again) if r]
        if not self.device.overlap:
            return time_parts(self.device, self.links, 0.0, {}, moves)
        return time_parts(self.device, self.links, 0.0, dict.fromkeys(range(self._n_buckets), 0.0), moves,
                          self._bucket_parents)

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


def bucket_parents(prog, keys: dict) -> dict:
    """Computation id -> the id of the one enclosing it (the computation its region's
    parent runs in, same pass; None at the top), innermost first (`_achieved`)."""
    regions, comp = prog.regions, computations(prog)

    def enclosing(r):
        parent = regions[r].parent
        return comp[parent] if parent is not None and parent >= 0 else None

    def depth(r):
        d = 0
        while enclosing(r) is not None:
            r, d = enclosing(r), d + 1
        return d

    out = {}
    for (region, backward), k in sorted(keys.items(), key=lambda kv: -depth(kv[0][0])):
        parent = enclosing(region)
        out[k] = None if parent is None else keys.setdefault((parent, backward), len(keys))
    return out


def feeds_backward(prog, backward) -> np.ndarray:
    """Per value: does any of the `backward` ops (the backward pass's contractions and
    lookups' transposes, `WEIGHT_GRADIENT_OPS`) depend on it? Activation gradients do; a
    weight gradient feeds only reshapes and the optimizer, so its reduction can overlap
    the rest of the backward pass."""
    return depended_on(prog, [v for op in prog.ops if backward[op.id] for v in op.operands])[0]


def op_dtype(op, prog):
    for v in op.operands + op.results:
        if v >= 0:
            return prog.values[v].dtype
    return np.float32
