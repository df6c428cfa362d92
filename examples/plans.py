"""Hand-written tilings applied through `tile` actions, for tests that need a plan
before (or besides) the tactics: data parallel, Megatron-style and FSDP-style."""

from __future__ import annotations

import partir
from partir import PartitioningError

#: Per example, the (input name glob, dim) whose split over the model axis yields
#: Megatron-style tensor parallelism once propagated (everything else follows).
MEGATRON_SEEDS = {
    "mlp": [("params/w1", 1)],
    "gpt": [("params/layers/*/attn/wq", -1), ("params/layers/*/mlp/w1", -1),
            ("params/layers/attn/wq", -1), ("params/layers/mlp/w1", -1), ("params/head/w", 1)],
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
    """Split the seeds of `model` over `axis` (the layers' inner dims)."""
    for pattern, dim in MEGATRON_SEEDS[model]:
        for v in part.program.match_inputs(pattern):
            part.tile(v, dim, axis)


def fsdp(part: partir.Partitioning, axis: str) -> None:
    """Data parallel on `axis`, then every parameter split on its largest dim that the
    axis divides (where propagation has not already decided otherwise)."""
    data_parallel(part, axis)
    size = part.mesh.size(axis)
    for v, name in zip(part.program.inputs, part.program.input_names):
        if not name.startswith("params"):
            continue
        shape = part.program.values[v].shape
        for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
            if shape[d] % size == 0 and shape[d] >= size:
                try:
                    part.tile(v, d, axis)
                    break
                except PartitioningError:
                    continue
