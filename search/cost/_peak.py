"""The memory half of `CostModel` (`search.cost._model`): the buffers reshards and
recomputation make beside the program's own (`_memory`, `_remat`, `_move_buffers`), the peak
they reach and the names of what is live there."""

from __future__ import annotations

import numpy as np

from partir import Kind, Tiling

from ._comm import gradient_groups
from ._reassociate import absorbed
from ._remat import RematView, carried_buffers, extra_buffers


class CostMemory:
    """What `CostModel` adds up into a step's peak memory (it mixes this class in: the
    methods read the model's reshards and liveness)."""

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
            # One whole result per gradient, however many all-reduces make it (one per
            # contracted dim, each reading the previous one's result).
            whole = sum(max((c.bytes for c in cols if c.kind == Kind.ALL_REDUCE), default=0.0)
                        for _, _, cols, _ in group)
            if whole > 0:
                starts.append(last), ends.append(last), sizes.append(whole), keys.append(group[-1][1])
        return np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64), np.array(sizes), keys

    def _view(self):
        """The rematerialization view of the current recomputed residuals, or None."""
        rec, reused, saved = self.part.rematerialized, self.part.reused, self.part.saved
        if not rec and not reused:
            return None
        view = self._views.get((rec, reused, saved))
        if view is None:
            view = self._views[(rec, reused, saved)] = RematView(self.program, self.materialization, self._donated,
                                                                 rec, reused, saved)
        return view

    def _moves(self) -> list:
        """(key, entry) of the reshards (entry: op -> (value, collectives, buffer)) of the
        ops that run (a relaxed checkpoint's skipped ops move nothing)."""
        view = self._view()
        return list(self._dedup.items()) if view is None else view.running(self._dedup)

    def _timed_moves(self) -> list:
        """`_moves` as the step's time sees them: on a backend that reduces a sum of
        reductions once (`DeviceSpec.reassociate`), the reductions it merges into
        another's move nothing (`_reassociate`); the buffers stay, for `_memory`."""
        moves = self._moves()
        if not self.device.reassociate:
            return moves
        gone = absorbed(self.program, moves, self._sum_parents)
        return [(k, {o: (v, (), b) for o, (v, _, b) in e.items()}) if k in gone else (k, e) for k, e in moves]

    def _memory(self, value_bytes, *, exact: bool):
        """(peak, op index, buffer bytes, liveness, keys of the extra buffers): the
        buffers of reshards and of recomputation beside the program's."""
        view = self._view()
        starts, ends, sizes, keys = self._reshard_buffers()
        carried = view.carried if view is not None else carried_buffers(self.materialization)
        liveness = view.liveness if view is not None else self.liveness
        ticks = self._pipeline.ticks if self._pipeline is not None else None
        if ticks is not None:  # the tick loops keep the residuals themselves, and buffers of their own
            carried = ticks.stacked_elsewhere(carried)
        for kind, entries in (("remat", view.extra if view is not None else ()), ("stacked", carried),
                              ("tick", ticks.entries(liveness.virtual, self._value_div, self.materialization.attention)
                               if ticks else ()), ("accumulated", self._accumulator(liveness.length))):
            if self._pipeline is not None and kind != "tick":
                entries = self._pipeline.stacks(entries, self._value_div)
            vs, ve, vz = extra_buffers(entries, value_bytes)
            starts, ends, sizes = np.concatenate([starts, vs]), np.concatenate([ends, ve]), np.concatenate([sizes, vz])
            keys = keys + [(kind, v) for _, _, v, _ in entries]
        # (`_arena`, rule 1; the fast estimate, which `evaluate` takes, packs nothing)
        hostable = np.array([k[0] != "tick" for k in keys], dtype=bool) if exact else None
        peak, t, buf = liveness.peak(value_bytes, (starts, ends, sizes), exact=exact, hostable=hostable)
        return peak, t, buf, liveness, (starts, ends, sizes, keys)

    def _accumulator(self, length: int) -> list:
        """The gradient accumulator of a step of several micro-batches (`grad_accum`), as
        `(start, end, value, scale)` entries: each parameter's gradient summed over the
        micro-batches, laid out as the parameter is (whole for data parallelism and
        ZeRO-1, sharded for FSDP, as XLA's accumulation loop and MaxText keep it), live
        through every micro-batch's forward and backward pass (a pipeline's tick loops
        accumulate within a micro-batch, and this sum is across them). None with one
        micro-batch; `length` is the liveness schedule's (the entries span it)."""
        if self.grad_accum <= 1:
            return []
        from tactics import roles

        return [(0, length - 1, p, 1.0) for p in roles(self.program).params]

    def exact_peak(self) -> float:
        """The peak memory as `cost()` gives it (XLA's buffer assignment emulated)."""
        self._sync()
        return self._memory(self._value_bytes(), exact=True)[0]

    def _name_of_buffer(self, b: int, liveness, extra_keys) -> str:
        if b >= liveness.num_buffers:  # a reshard's or a recomputation's buffer
            key = extra_keys[b - liveness.num_buffers]
            if key[0] == "read":
                return f"{self.program.name(key[1])} as {Tiling(key[2])}"
            if key[0] == "remat":
                return f"{self.program.name(key[1])} recomputed"
            if key[0] == "stacked":
                return f"{self.program.name(key[1])} stacked"
            if key[0] == "tick":
                return f"{self.program.name(key[1])} in the tick loop"
            if key[0] == "accumulated":
                return f"{self.program.name(key[1])}'s gradient accumulated"
            if key[0] == "pipeline":  # (`_pipeline_once`: what a stage moves once a step)
                v, cols, _ = next(iter(self._dedup[key].values()))
                held = "accumulated over the microbatches" if any(c.gradient for c in cols) else "gathered for the ticks"
                return f"{self.program.name(v)} {held}"
            return f"{op_label(self.program, key[1])} as computed"
        cache = self._buffer_name.setdefault(id(liveness), {})
        name = cache.get(b)
        if name is None:
            members = np.nonzero(liveness.buffer == b)[0]
            is_input = set(self.program.inputs)
            inputs = [v for v in members if v in is_input]
            name = cache[b] = self.program.name(int(inputs[0] if inputs else members[0]))
        return name


def op_label(prog, o: int) -> str:
    op = prog.ops[o]
    res = next((v for v in op.results if v >= 0), None)
    return prog.name(res) if res is not None else op.primitive
