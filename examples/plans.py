"""Hand-written reference plans for the examples, applied through `tile` actions:
data parallel, Megatron-style and FSDP-style. Tests and benchmarks use them as the
expert baselines that tactics and search are checked against."""

from __future__ import annotations

import random

import partir
from examples.convnet import ConvNetConfig
from examples.gpt import GPTConfig
from examples.mlp import MLPConfig
from examples.moe import MoEConfig
from partir import PartitioningError

#: Example -> the config at which the cost model is held to XLA (`tests/test_cost.py`,
#: `benchmarks/cost_fidelity.py`): big enough that the model's terms (matmuls,
#: activations, parameters) dominate XLA's fixed overheads (buffer alignment, scalars),
#: small enough to compile in seconds on the CPU. The convnet's second pool averages:
#: XLA:CPU has no native select-and-scatter and expands a max pool's gradient into index
#: iotas, a variadic reduce-window and a scatter, buffers GPU and TPU XLA never make.
FIDELITY_CONFIGS = {
    "mlp": MLPConfig(batch=64, d_in=256, d_hidden=1024, d_out=256, n_layers=3),
    "gpt": GPTConfig(d_model=128, d_ff=512, n_heads=8, seq_len=32, vocab=512, batch=8),
    "convnet": ConvNetConfig(batch=32, height=16, width=16, in_channels=8, channels1=32, channels2=64,
                             n_classes=16, second_pool="avg"),
    "moe": MoEConfig(groups=8, group_size=32, d_in=64, d_model=128, d_ff=512, d_out=32),
}

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


def searched_plan(program, mesh, *, episodes: int = 150, seed: int = 0) -> partir.Partitioning:
    """The partitioning the automatic search returns for `program` on `mesh` (CPU cost
    model, stopped after `episodes` so that it is deterministic)."""
    import search
    import tactics

    tactic = search.AutomaticPartition(budget_s=600, max_episodes=episodes, seed=seed, device="cpu")
    return tactics.apply_schedule(program, mesh, [tactic]).partitioning


def random_plan(program, mesh, *, seed: int, actions: int = 3) -> partir.Partitioning:
    """A random valid plan: up to `actions` tile actions on groups of parameters and batch
    inputs, each drawn among those that apply (the search's action space)."""
    import search
    import tactics

    part = partir.Partitioning(program, mesh)
    r = tactics.roles(program)
    groups = search.input_groups(program, r.params + r.batch)
    rng = random.Random(seed)
    for _ in range(actions):
        choices = search.valid_actions(part, groups, mesh.names)
        if not choices:
            break
        action = choices[rng.randrange(len(choices))]
        mark = part.mark()
        try:
            for v in groups[action.group].members:
                if action.axis not in part.tiling(v).dims[action.dim]:
                    part.tile(v, action.dim, action.axis)
        except PartitioningError:
            part.rollback(mark)
    return part
