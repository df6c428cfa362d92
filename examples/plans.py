"""Hand-written reference plans for the examples, applied through `tile` actions:
data parallel, Megatron-style and FSDP-style. Tests and benchmarks use them as the
expert baselines that tactics and search are checked against."""

from __future__ import annotations

import partir
from partir import PartitioningError

#: Per example, the (input name glob, dim) whose split over the model axis yields
#: Megatron-style tensor parallelism once propagated (everything else follows).
MEGATRON_SEEDS = {
    "mlp": [("params/w1", 1)],
    "gpt": [("params/embed/tokens", 0), ("params/layers/*/attn/wq", -1), ("params/layers/*/mlp/w1", -1),
            ("params/layers/attn/wq", -1), ("params/layers/attn/wqkv", -1), ("params/layers/*/attn/wqkv", -1),
            ("params/layers/mlp/w1", -1), ("params/head/w", 1)],
    "convnet": [("params/conv1/w", 3)],
    "moe": [("params/moe/*/experts/w1", -1)],
    "nnx_mlp": [("params/linear1/kernel", 1)],
}


def data_parallel(part: partir.Partitioning, axis: str) -> None:
    """Split dim 0 of every batch input over `axis`."""
    for v, name in zip(part.program.inputs, part.program.input_names):
        if name.startswith("batch"):
            part.tile(v, 0, axis)


def megatron(part: partir.Partitioning, model: str, axis: str) -> None:
    """Split the seeds of example `model` ('gpt', 'mlp', ...) over `axis`."""
    for pattern, dim in MEGATRON_SEEDS[model]:
        for v in part.program.match_inputs(pattern):
            part.tile(v, dim, axis)


def fsdp(part: partir.Partitioning, *axes: str) -> None:
    """Data parallel over `axes` (the batch split over all of them), then every parameter
    split over them on its largest dim that they divide (where propagation has not
    already decided otherwise): ZeRO-3 over the whole mesh."""
    for axis in axes:
        data_parallel(part, axis)
    size = 1
    for axis in axes:
        size *= part.mesh.size(axis)
    for v, name in zip(part.program.inputs, part.program.input_names):
        if not name.startswith("params"):
            continue
        shape = part.program.values[v].shape
        for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
            if shape[d] % size == 0:
                mark = part.mark()
                try:
                    for axis in axes:
                        part.tile(v, d, axis)
                    break
                except PartitioningError:
                    part.rollback(mark)  # all the axes on this dim, or none


#: Strategy name -> function(partitioning, example name, data axis, model axis).
STRATEGIES = {
    "dp": lambda p, m, data, model: data_parallel(p, data),
    "megatron": lambda p, m, data, model: megatron(p, m, model),
    "fsdp": lambda p, m, data, model: fsdp(p, data, model),
    "dp+megatron": lambda p, m, data, model: (data_parallel(p, data), megatron(p, m, model)),
}
