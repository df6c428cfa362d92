"""What sets a real step's time beyond the roofline: achieved matmul throughput, and
communication overlapped with compute. `search.cost._model` uses both; the figures are the
device's time model (`DeviceSpec`, `search._device`), the ideal machine by default.

**Achieved matmul throughput.** A matmul of per-device sizes m x k by k x n (batch dims
aside, which batched GEMMs and the MXUs take in stride) reaches

    efficiency = matmul_efficiency * prod over d in (m, n, k) of  d / (d + matmul_knee)

of the dtype's peak: large matmuls reach `matmul_efficiency` (cuBLAS' and XLA's large
GEMMs stay below the datasheet), small or skinny ones fill the tensor cores (MXUs)
badly, and a dim of `matmul_knee` elements halves the rate along it.

**Overlap** (`DeviceSpec.overlap`, as XLA's latency-hiding scheduler runs on GPU and
TPU). Each collective is either *overlappable*, run behind compute:
- an all-gather of a weight (a value the batch does not reach: FSDP and ZeRO-3
  gathers, prefetched a layer ahead),
- a gradient reduction (reduce-scatter or all-reduce of a weight's gradient, run
  behind the rest of the backward pass),

or *exposed*, on the critical path: tensor- and sequence-parallel collectives of
activations, expert all-to-alls (what a plan does not overlap itself, e.g. by a
collective matmul), except on a backend that overlaps those too
(`DeviceSpec.overlap_activations`: XLA:TPU's async collective fusion, which MaxText's
TPU recipes turn on with `xla_tpu_enable_async_collective_fusion` and
`xla_tpu_overlap_compute_collective_tc`, runs them beside the independent matmuls of
the same computation). Overlappable collectives hide behind the compute of the same
*computation* (`partir.computations`: calls are inlined, a loop body or a branch is a
computation of its own) in one pass (a scan body's forward or backward trip, the
top-level forward or backward), recomputed ops in the backward pass of their region.
Per computation, innermost first,

    exposed = max(0, overlappable comm - window)
    slowed  = overlap_slowdown * min(overlappable comm, window)

where the window is the computation's compute plus what its nested computations (a
loop's body, in the same pass) left unused: a collective of the enclosing computation
runs beside a whole loop (the head's gradient reduction beside the backward layers),
so a scanned and an unrolled program hide the same.

and the step is compute + exposed collectives + sum of (exposed + slowed) over
computations. Without `overlap` (the `cpu` preset: XLA:CPU runs collectives in line),
nothing is hidden: compute + every collective.

`TimeParts` holds the terms before the max and min are taken: each adds up over layers,
so the search's shallow twins extrapolate them one by one to the deep program's depth
and take the max and min there (the step itself is not affine in the layer count: a
gather hidden behind 3 layers' compute is hidden behind 32, and exposed time does not
grow with depth as the twins' difference would say).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from partir import Kind


def dot_efficiency(op, lhs_shape, rhs_shape, device) -> float:
    """The shape part of the fraction of peak a `dot_general` with these (per-device)
    operand shapes reaches on `device`: the product over m, n, k (module docstring),
    which `matmul_efficiency` multiplies; 1 for other ops."""
    if op.link or op.primitive != "dot_general" or op.eqn is None:
        return 1.0
    (lc, rc), (lb, rb) = op.eqn.params["dimension_numbers"]
    k = math.prod(lhs_shape[d] for d in lc)
    m = math.prod(s for d, s in enumerate(lhs_shape) if d not in lc and d not in lb)
    n = math.prod(s for d, s in enumerate(rhs_shape) if d not in rc and d not in rb)
    knee = device.matmul_knee
    shape = 1.0 if knee <= 0 else (m / (m + knee)) * (n / (n + knee)) * (k / (k + knee))
    return shape


def shard_shape(shape, dims, mesh) -> tuple[int, ...]:
    """A value's per-device shape under dim tiling `dims` (ceil, as XLA pads)."""
    return tuple(-(-s // mesh.devices_along(axes)) for s, axes in zip(shape, dims))


def batch_free(program, batch_inputs) -> np.ndarray:
    """Per value: True when no batch input reaches it (weights and what is made from
    them alone: a weight cast, sliced per layer or gathered). Ops are in execution order
    except loop-carry links, hence a second sweep."""
    reached = np.zeros(len(program.values), dtype=bool)
    for v in batch_inputs:
        reached[v] = True
    for _ in range(2):
        for op in program.ops:
            if any(v >= 0 and reached[v] for v in op.operands):
                for v in op.results:
                    if v >= 0:
                        reached[v] = True
    return ~reached


def overlappable(col, value: int, weights, device) -> bool:
    """Whether a collective may run behind compute (module docstring)."""
    return (bool(col.gradient) or (col.kind == Kind.ALL_GATHER and bool(weights[value]))
            or device.overlap_activations)


def repeated_per_micro_batch(moves, weights) -> list[bool]:
    """Per (collective, value) of `moves`: whether it still runs every micro-batch of a
    step that accumulates gradients though the batch does not grow it (`search._accum`).
    So run an all-gather of a weight (FSDP's and ZeRO-3's parameter gathers: over
    scanned layers XLA gathers each layer's slice in every trip of every micro-batch,
    as MaxText's accumulation scan runs it), and a gradient's reduce-scatter over an
    axis the plan gathers weights over (the parameter is sharded there, and so is the
    accumulator, as in XLA's accumulation loop and MaxText's FSDP: each micro-batch's
    gradient is reduced before it is added). A gradient reduction where the parameters
    stay whole (data parallelism, ZeRO-1's reduce-scatter to its sharded update) runs
    once a step on the summed gradient, and so does ZeRO's all-gather of the updated
    parameters (the batch reaches it: no weight)."""
    def gathers(c, v) -> bool:
        return c.kind == Kind.ALL_GATHER and bool(weights[v]) and not c.gradient

    sharded = {a for c, v in moves if gathers(c, v) for a in c.axes}
    return [gathers(c, v) or (bool(c.gradient) and c.kind == Kind.REDUCE_SCATTER and bool(sharded & set(c.axes)))
            for c, v in moves]


@dataclass(frozen=True)
class TimeParts:
    """A step's time before overlap: `compute`, the communication on the critical path
    whatever the compute (`exposed`), and per computation (innermost first) its compute
    `windows`, its overlappable communication `hidden` and the index of the computation
    enclosing it (`parents`, None at the top). Each term adds up over layers."""

    compute: float
    exposed: float
    windows: tuple[float, ...] = ()
    hidden: tuple[float, ...] = ()
    parents: tuple[int | None, ...] = ()

    def step(self, device) -> tuple[float, float]:
        """(step seconds, seconds of communication added to compute) on `device`."""
        exposed = self.exposed
        window = [max(0.0, w) for w in self.windows]
        for k, (comm, parent) in enumerate(zip(self.hidden, self.parents)):
            room = window[k]
            exposed += max(0.0, comm - room) + device.overlap_slowdown * min(comm, room)
            if parent is not None:
                window[parent] += max(0.0, room - comm)
        return self.compute + exposed, exposed

    def plus(self, other: "TimeParts", k: float) -> "TimeParts":
        """`self + k * other`, term by term (`other` has the same computations)."""
        return TimeParts(self.compute + k * other.compute, self.exposed + k * other.exposed,
                         tuple(a + k * b for a, b in zip(self.windows, other.windows)),
                         tuple(a + k * b for a, b in zip(self.hidden, other.hidden)), self.parents)

    def extrapolate(self, deeper: "TimeParts", k: float) -> "TimeParts":
        """`self + k * (deeper - self)`, term by term (the twins' affine extrapolation;
        `deeper` has the same computations)."""
        def line(a, b):
            return a + k * (b - a)

        return TimeParts(line(self.compute, deeper.compute), line(self.exposed, deeper.exposed),
                         tuple(map(line, self.windows, deeper.windows)),
                         tuple(map(line, self.hidden, deeper.hidden)), self.parents)


def time_parts(device, links, compute: float, bucket_compute: dict, moves, parents=None) -> TimeParts:
    """The `TimeParts` of a step: `moves` holds (computation key, collective,
    overlappable) triples; `bucket_compute` the compute seconds of each computation;
    `parents` maps a computation to the one enclosing it (None at the top), innermost
    listed first; `links` the `LinkModel` that times collectives."""
    if not device.overlap:
        return TimeParts(compute, links.total_time([c for _, c, _ in moves]))
    exposed = links.exposed_time([c for _, c, over in moves if not over])
    hidden: dict = {}
    for key, c, over in moves:
        if over:
            hidden.setdefault(key, []).append(c)
    parents = parents or {k: None for k in bucket_compute}
    order = list(parents) + [p for p in dict.fromkeys(parents.values()) if p is not None and p not in parents]
    index = {key: i for i, key in enumerate(order)}
    windows = tuple(float(bucket_compute.get(key, 0.0)) for key in order)
    comm = tuple(links.exposed_time(hidden.pop(key, [])) for key in order)
    for cols in hidden.values():  # a computation without compute of its own
        exposed += links.exposed_time(cols)
    ups = tuple(None if parents.get(key) is None else index[parents[key]] for key in order)
    return TimeParts(compute, exposed, windows, comm, ups)
