"""Gradient accumulation priced as it runs (`search._accum`): FSDP gathers its
parameters every micro-batch, ZeRO-1 once a step, and the search may choose ZeRO-1."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import automap
import partir
import search
import tactics
from examples import llama

MESH = partir.MeshSpec.of(data=8)


def _llama(batch: int, **shape):
    """The lifted train step of a scanned two-layer Llama (abstract) on `batch` sequences."""
    config = llama.LlamaConfig(n_layers=2, n_kv_heads=2, batch=batch, scan_layers=True, **shape)
    step, args = llama.make_train_step(config, abstract=True)
    return partir.lift(step, *args)


@pytest.fixture(scope="module")
def small_steps():
    """A small scanned Llama's train step on one micro-batch of 8 sequences and on two."""
    shape = dict(d_model=64, n_heads=2, d_ff=128, vocab=128, seq_len=32, dtype=jnp.float32)
    return _llama(8, **shape), _llama(16, **shape)


def _increment(steps, plan) -> tuple[float, float]:
    """(modeled seconds one more micro-batch adds to an accumulated step of 4, seconds of
    the plan's all-gathers on one micro-batch) of `plan` on `steps` (one and two
    micro-batches) on the `cpu` preset, which overlaps nothing, so a collective's time
    adds up as it is paid."""
    one, two = (search.CostModel(tactics.apply_schedule(p, MESH, plan).partitioning, "cpu") for p in steps)
    parts, again, _ = one.accumulation_parts()
    other = two.evaluate_parts()[0]
    steps = [search.accumulated_step(parts, other, ga, one.device, again) for ga in (4, 5)]
    gathers = sum(c.time for c in one.cost().collectives if c.kind == "all-gather")
    return steps[1] - steps[0], gathers


def test_an_accumulated_step_gathers_fsdp_parameters_every_micro_batch_and_zero1_once(small_steps):
    # XLA runs FSDP's all-gathers of scanned layers inside the layer loop, so in every
    # micro-batch of an accumulation scan (MaxText's); ZeRO-1 gathers its updated
    # parameters once, after the update. Before, each micro-batch added only what grows
    # with the batch, the same for both plans (0.69 ms here), under FSDP's gathers.
    fsdp, fsdp_gathers = _increment(small_steps, [tactics.FSDP("data", leave_room=False)])
    zero1, zero1_gathers = _increment(small_steps, [tactics.DataParallel("data"), tactics.ZeRO("data", stage=1)])
    assert fsdp > fsdp_gathers > 0
    assert 0 < zero1 < zero1_gathers


@pytest.mark.slow
def test_a_zero1_plan_file_loads_with_the_layouts_it_was_saved_with(tmp_path):
    # ZeRO-1 keeps the parameters whole apart from their optimizer state (detached from
    # their tiling class); the plan file names what was detached, so its decisions
    # replay (before, the optimizer state's tiles conflicted with the parameters' pins).
    config = llama.LlamaConfig(n_layers=2, d_model=64, n_heads=2, n_kv_heads=2, d_ff=128, vocab=128, seq_len=32,
                               batch=8, dtype=jnp.float32, scan_layers=True)
    step, args = llama.make_train_step(config, abstract=True)
    plan = automap.partition(step, mesh="data=8", device="cpu",
                             schedule=[tactics.DataParallel("data"), tactics.ZeRO("data", stage=1)])(*args)
    plan.save(tmp_path / "zero1.json")
    back = automap.load_plan(tmp_path / "zero1.json").bind(step, *args)
    prog = plan.partitioning.program
    assert [back.partitioning.tiling(v) for v in prog.inputs] == [plan.partitioning.tiling(v) for v in prog.inputs]


#: The toy of `test_the_peak_holds_the_gradient_accumulator_as_xla_does`: width, hidden
#: width, scanned layers, sequences a micro-batch, micro-batches a step.
TOY = dict(d=512, f=1024, layers=4, micro_batch=64, grad_accum=4)


def _toy_loss(params, x):
    h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w[0]) @ w[1], None), x, params)
    return jnp.mean(h ** 2)


def _toy_step(params, batch):
    """A data-parallel train step of one micro-batch (SGD)."""
    grads = jax.grad(_toy_loss)(params, batch)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)


def _toy_accumulated(params, batch, mesh):
    """`_toy_step` over `TOY['grad_accum']` micro-batches a step, the gradients summed by
    a scan (MaxText's accumulation), each micro-batch split over `mesh`'s devices."""
    ga, mb, d = TOY["grad_accum"], TOY["micro_batch"], TOY["d"]
    batches = jax.lax.with_sharding_constraint(batch.reshape(mb, ga, d).transpose(1, 0, 2),
                                               NamedSharding(mesh, PartitionSpec(None, "d")))
    zero = jax.tree.map(jnp.zeros_like, params)
    grads, _ = jax.lax.scan(lambda acc, x: (jax.tree.map(jnp.add, acc, jax.grad(_toy_loss)(params, x)), None),
                            zero, batches)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)


@pytest.mark.slow
def test_the_peak_holds_the_gradient_accumulator_as_xla_does():
    # XLA keeps the summed gradients (here whole, as data parallelism holds them) live
    # through every micro-batch: the accumulation scan's temporaries exceed the step of
    # one micro-batch's by the parameters' bytes (16 MiB, measured 16.06 MiB); the model
    # adds the same buffer where the step accumulates (before, the peak was one
    # micro-batch's, whatever the plan's accumulator).
    d, f, layers, mb, ga = (TOY[k] for k in ("d", "f", "layers", "micro_batch", "grad_accum"))
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ("d",))
    whole, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("d"))
    params = tuple(jax.ShapeDtypeStruct(s, jnp.float32, sharding=whole) for s in ((layers, d, f), (layers, f, d)))
    temps = []
    for fn, batch in ((_toy_step, mb), (functools.partial(_toy_accumulated, mesh=mesh), ga * mb)):
        x = jax.ShapeDtypeStruct((batch, d), jnp.float32, sharding=split)
        compiled = jax.jit(fn, out_shardings=(whole, whole), donate_argnums=0).lower(params, x).compile()
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
    prog = partir.lift(_toy_step, tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in params),
                       jax.ShapeDtypeStruct((mb, d), jnp.float32))
    part = tactics.apply_schedule(prog, partir.MeshSpec.of(d=8), [tactics.DataParallel("d")]).partitioning
    peaks = [search.CostModel(part.copy(), "cpu", donate_argnums=(0,), grad_accum=k).cost().memory_peak
             for k in (1, ga)]
    assert peaks[1] - peaks[0] == pytest.approx(temps[1] - temps[0], rel=0.05)


@pytest.mark.slow
def test_a_search_with_gradient_accumulation_can_return_zero1():
    # 32 micro-batches a step and a limit that plain data parallelism does not fit (43 MB
    # with its gradient accumulator) and ZeRO-1 does (22 MB): FSDP fits too (8 MB) but
    # gathers its parameters every micro-batch, 20x ZeRO-1's step; the search starts
    # from a partitioning ZeRO-1 applies to in place and returns Megatron's distributed
    # optimizer.
    prog = _llama(8, d_model=256, n_heads=4, d_ff=512, vocab=512, seq_len=128, dtype=jnp.bfloat16)
    auto = search.AutomaticPartition(budget_s=600, max_episodes=100, device="h100", memory_limit=25e6, grad_accum=32)
    found = tactics.apply_schedule(prog, MESH, [auto])
    result = found.context.search[0]
    assert result.fits
    assert [a.tactic for a in result.actions] == [tactics.DataParallel("data"), tactics.ZeRO("data", stage=1)]
