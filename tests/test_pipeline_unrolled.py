"""Pipelines over unrolled layers: a step whose layers are a Python list of alike pytrees
(`scan_layers=False`), rolled into the scan form (`partir.roll_layers`) and pipelined.
The per-layer arrays are stacked in the step; the stage axis splits each along another
dim at rest and each step exchanges the stage's layers in and their gradients out. The
step computes what plain `jax.jit` computes (loss, updated parameters, Adam moments)."""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import automap
import partir
import search
import tactics as T
from examples import gpt, llama
from partir import MeshSpec
from test_pipeline_circular import _collectives  # (the step and arguments are the unrolled ones)
from test_pipeline_uneven import _same_step

EPS = 1e-3  # Adam eps large enough that near-zero gradients cannot flip updates
#: The GPT example unrolled, two layers: one per stage of two.
TWO = gpt.GPTConfig(n_layers=2, d_model=16, n_heads=2, d_ff=32, vocab=32, seq_len=8, batch=16, adam_eps=EPS)
#: The Llama example unrolled, four layers: two per stage of two.
FOUR = llama.LlamaConfig(n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, vocab=32, seq_len=8, batch=16,
                         adam_eps=EPS)


@functools.cache
def _rolled(config):
    step, args = (llama if isinstance(config, llama.LlamaConfig) else gpt).make_train_step(config)
    return step, args, partir.roll_layers(partir.lift(step, *args))


def _plan(config, mesh, others, microbatches, repeats=1):
    _, _, prog = _rolled(config)
    pipeline = T.Pipeline("stage", microbatches=microbatches, repeats=repeats)
    return T.apply_schedule(prog, mesh, others + [pipeline]).partitioning


def _layer_state(prog):
    return [v for v in prog.inputs if "['layers']" in prog.name(v)]


def test_unrolled_gpt_pipelines_as_its_scan_form_does():
    """Two stages of one layer, two microbatches, data parallel on the other axis: each
    layer's parameters and Adam moments are held split over the stage axis (1/S of the
    stack per device) and the step equals `jax.jit`'s."""
    part = _plan(TWO, MeshSpec.of(data=4, stage=2), [T.DataParallel("data")], 2)
    prog = part.program
    assert [s.forward.rolled for s in partir.layer_scans(prog)] == [True]
    assert all("stage" in part.tiling(v).axes() for v in _layer_state(prog))
    _same_step(part, TWO, "shard_map")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["shard_map", "jit"])
def test_unrolled_llama_pipelines_with_megatron(backend):
    """Llama, four layers over two stages, four microbatches, data parallel and Megatron
    on the other axes: Megatron finds each layer's weights through the stacking (they
    are split over 'model' as in the scan form) and the step equals `jax.jit`'s."""
    part = _plan(FOUR, MeshSpec.of(data=2, model=2, stage=2), [T.DataParallel("data"), T.Megatron("model")], 4)
    prog = part.program
    assert all("model" in part.tiling(v).axes() for v in _layer_state(prog) if "['mlp']['w_up']" in prog.name(v))
    _same_step(part, FOUR, backend)


@pytest.mark.slow
def test_unrolled_gpt_under_the_jit_lowering():
    _same_step(_plan(TWO, MeshSpec.of(data=4, stage=2), [T.DataParallel("data")], 2), TWO, "jit")


@pytest.mark.slow
@pytest.mark.parametrize("config,backend", [(TWO, "shard_map"), (TWO, "jit"), (FOUR, "shard_map"), (FOUR, "jit")])
def test_compiled_collectives_are_the_modeled_ones(config, backend):
    """One all-to-all over the stage axis per layer parameter each way (the stage's
    layers in, their gradients out), the tick loops' permutes, the other axes'
    collectives: XLA's are exactly the modeled ones."""
    if config is TWO:
        part = _plan(TWO, MeshSpec.of(data=4, stage=2), [T.DataParallel("data")], 2)
    else:
        part = _plan(FOUR, MeshSpec.of(data=2, model=2, stage=2), [T.DataParallel("data"), T.Megatron("model")], 4)
    _exchanged_once_each_way_as_modeled(part, config, backend)


def _exchanged_once_each_way_as_modeled(part, config, backend):
    """XLA's collectives of `part`'s step are exactly the modeled ones, with one
    all-to-all over the stage axis per layer parameter each way."""
    compiled, modeled = _collectives(part, config, backend)
    per_layer = len(_layer_state(part.program)) // 3 // config.n_layers  # parameters, not the Adam moments
    exchanges = sum(n for (kind, axes, _), n in compiled.items()
                    if kind == partir.Kind.ALL_TO_ALL and axes == ("stage",))
    assert exchanges == 2 * per_layer
    assert compiled == modeled


def _unlike_step(params, x):
    """A train step over two layers of one structure that run different activations."""
    def loss(params):
        h = x
        for p, act in zip(params, (jnp.tanh, jnp.sin)):
            h = act(h @ p["w"])
        return jnp.sum(h * h)

    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def _shifted(params, x):
    """A forward pass over two layers of one structure that add different constants."""
    for p, shift in zip(params, (2.0, 3.0)):
        x = jnp.tanh(x @ p["w"]) + shift
    return jnp.sum(x)


@pytest.mark.slow
@pytest.mark.parametrize("fn,match", [
    (_unlike_step, r"(?s)layers' forward passes differ: .*tanh.*sin.*jax\.lax\.scan"),
    (_shifted, r"(?s)forward passes differ: .*add.* reads a different constant in another layer.*jax\.lax\.scan"),
])
def test_layers_that_are_not_alike_are_refused_naming_the_difference(fn, match):
    """Different activations; different constants (which a roll reading the first
    layer's for every layer would silently get wrong)."""
    params = [{"w": jnp.ones((4, 4))}, {"w": jnp.ones((4, 4))}]
    prog = partir.lift(fn, params, jnp.ones((2, 4)))
    with pytest.raises(partir.PartitioningError, match=match):
        partir.roll_layers(prog)


#: `tests/test_pipeline.py`'s deep GPT on H100s (its stage axis across nodes), unrolled.
DEEP = gpt.GPTConfig(n_layers=16, d_model=2048, n_heads=16, d_ff=8192, vocab=1024, seq_len=512, batch=64)


@pytest.mark.slow
@pytest.mark.parametrize("memory_limit,pipelined", [(16e9, True), (80e9, False)])
def test_the_search_pipelines_rolled_layers_where_the_model_says_it_wins(memory_limit, pipelined):
    """As for the scan form: with 16 GB data parallelism over the stage axis does not
    fit and the search pipelines (the exchanges over the slow links priced); with 80 GB
    it does not. No twins: the rolled program is searched itself."""
    step, args = gpt.make_train_step(DEEP, abstract=True)
    prog = partir.roll_layers(partir.lift(step, *args))
    auto = search.AutomaticPartition(axes=("stage",), pipelines=(8,), memory_limit=memory_limit, max_episodes=30,
                                     device="h100")
    result = T.apply_schedule(prog, MeshSpec.of(stage=4, data=8), [T.DataParallel("data"), auto])
    assert bool(result.partitioning.pipelines) == pipelined


# -- the circular schedule -----------------------------------------------------------------
#: Unrolled layers for two stages of two repeats: four chunks of one layer.
CIRCULAR = {"gpt": dataclasses.replace(TWO, n_layers=4), "llama": FOUR}
#: The other axes: (mesh, tactics on them).
OTHERS = {"dp": (MeshSpec.of(data=4, stage=2), lambda: [T.DataParallel("data")]),
          "megatron": (MeshSpec.of(data=2, model=2, stage=2), lambda: [T.DataParallel("data"), T.Megatron("model")])}


def test_unrolled_gpt_is_planned_for_the_circular_schedule():
    """Four unrolled layers, two stages of two repeats: stage 0 runs layers 0 and 2,
    stage 1 layers 1 and 3, and the modeled step exchanges each layer parameter once
    each way over the stage axis, straight into (and out of) that order, its bubble
    (S-1)/(M*R+S-1). (The step's numerics and XLA's collectives: the slow matrix below.)"""
    config = CIRCULAR["gpt"]
    part = _plan(config, MeshSpec.of(data=4, stage=2), [T.DataParallel("data")], 2, repeats=2)
    assert part.pipelines[0].split(2).layers() == ((0, 2), (1, 3))
    cost = search.pipeline_cost(part, part.pipelines[0], "cpu")
    exchanged = collections.Counter(c.value for c in cost.collectives if c.kind == partir.Kind.ALL_TO_ALL)
    per_layer = len(_layer_state(part.program)) // 3 // config.n_layers  # parameters, not the Adam moments
    assert len(exchanged) == 2 * per_layer and set(exchanged.values()) == {1}
    assert cost.bubble == 1 / 5


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["shard_map", "jit"])
@pytest.mark.parametrize("microbatches", [2, 4])
@pytest.mark.parametrize("others", sorted(OTHERS))
@pytest.mark.parametrize("model", sorted(CIRCULAR))
def test_unrolled_layers_run_the_circular_schedule_as_modeled(model, others, microbatches, backend):
    """GPT and Llama, two stages of two repeats, two or four microbatches (four: they
    wait at the first stage for their next round), DataParallel with and without
    Megatron, both lowerings: the step equals `jax.jit`'s, and XLA's collectives are
    exactly the modeled ones: one all-to-all over the stage axis per layer parameter
    each way, which takes the stage's rows out of the [L, ...] layout in the circular
    schedule's chunk order directly (no second exchange into it), and the ring's
    permutes."""
    config, (mesh, make) = CIRCULAR[model], OTHERS[others]
    part = _plan(config, mesh, make(), microbatches, repeats=2)
    _same_step(part, config, backend)
    _exchanged_once_each_way_as_modeled(part, config, backend)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["uneven", "checkpoint", "remat"])
def test_rolled_layers_compose_as_the_scan_form_does(case):
    """Three layers over two stages (uneven: a padding slot), the user's
    `jax.checkpoint` on each layer, `Remat('full')`: the step equals `jax.jit`'s."""
    config = dataclasses.replace(TWO, n_layers=3) if case == "uneven" else \
        dataclasses.replace(TWO, remat=True) if case == "checkpoint" else TWO
    others = [T.DataParallel("data")] + ([T.Remat("full")] if case == "remat" else [])
    _same_step(_plan(config, MeshSpec.of(data=4, stage=2), others, 2), config, "shard_map")


@pytest.mark.slow
def test_a_plan_file_names_the_rolled_scan_by_its_layers_path():
    """The stacks of the layers' parameters are named by the layers' path with the layer
    index `[:]` (not by the roll's source line): the plan file's entry names the layer
    scan so, and reads back."""
    part = _plan(TWO, MeshSpec.of(data=4, stage=2), [T.DataParallel("data")], 2)
    prog, pipe = part.program, part.pipelines[0]
    entry = pipe.to_json(prog)
    assert entry["layers"] == "params['layers'][:]['ln1']['scale']"
    assert partir.Pipelining.from_json(entry, prog) == pipe


@pytest.mark.slow
def test_automap_rolls_the_layers_for_a_search_offering_pipelines():
    """`automap.partition` on the unrolled step: the search is offered pipelines, so the
    layers are rolled and the search pipelines them at 16 GB."""
    step, args = gpt.make_train_step(DEEP, abstract=True)
    auto = search.AutomaticPartition(axes=("stage",), pipelines=(8,), memory_limit=16e9, max_episodes=30,
                                     device="h100")
    plan = automap.partition(step, mesh={"stage": 4, "data": 8}, device="h100", memory_limit=16e9,
                             schedule=[T.DataParallel("data"), auto])(*args)
    assert plan.partitioning.program.rolled and plan.partitioning.pipelines


@pytest.mark.slow
def test_each_device_holds_what_the_scan_form_holds():
    """XLA's argument bytes (parameters, Adam moments, batch) of the pipelined step are
    the scan form's under the same plan: each device holds 1/S of the layer state."""
    def arguments(config, prog):
        part = T.apply_schedule(prog, MeshSpec.of(data=4, stage=2),
                                [T.DataParallel("data"), T.Pipeline("stage", microbatches=2)]).partitioning
        _, args = gpt.make_train_step(config)
        compiled = partir.lower(part, backend="shard_map").lower(*args).compile()
        return compiled.memory_analysis().argument_size_in_bytes

    scanned = dataclasses.replace(TWO, scan_layers=True)
    step, args = gpt.make_train_step(scanned)
    assert arguments(TWO, _rolled(TWO)[2]) == arguments(scanned, partir.lift(step, *args))


def test_a_mixed_precision_step_rolls_where_the_backward_reads_the_weights_copies():
    """The Llama example in bfloat16 without remat: the backward pass reads each layer's
    bfloat16 copies of its weights, which the forward made, not the float32 weights
    themselves (the roll once looked for the weights and refused the step)."""
    config = dataclasses.replace(FOUR, dtype=jnp.bfloat16)
    step, args = llama.make_train_step(config, abstract=True)
    rolled = partir.roll_layers(partir.lift(step, *args))
    assert [(s.forward.rolled, s.backward is not None) for s in partir.layer_scans(rolled)] == [(True, True)]


def _transposed_step(params, x):
    """Layers computing x @ w.T: their backward passes read the transposes the forward
    made, as a mixed-precision step reads its casts."""
    def loss(params):
        h = x @ params["in"]
        for p in params["layers"]:
            h = jnp.tanh(h @ p["w"].T)
        return jnp.mean(h ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


@pytest.mark.slow
def test_layers_whose_backward_reads_what_the_forward_made_of_the_weights_pipeline():
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    params = {"in": jnp.eye(8), "layers": [{"w": jax.random.normal(k, (8, 8)) / 3} for k in keys[:4]]}
    x = jax.random.normal(keys[4], (16, 8))
    prog = partir.roll_layers(partir.lift(_transposed_step, params, x))
    part = T.apply_schedule(prog, MeshSpec.of(data=4, stage=2),
                            [T.DataParallel("data"), T.Pipeline("stage", microbatches=2)]).partitioning
    ours, theirs = partir.lower(part, backend="shard_map")(params, x), jax.jit(_transposed_step)(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("config,others,microbatches,backend", [
    (FOUR, [T.DataParallel("data")], 4, "shard_map"),
    (dataclasses.replace(TWO, n_layers=4), [T.FSDP("data")], 8, "jit"),
], ids=["llama-dp-m4-shard_map", "gpt-fsdp-m8-jit"])
def test_unrolled_layers_over_four_stages(config, others, microbatches, backend):
    """Four stages of one unrolled layer each, data parallel or FSDP on the other axis,
    four or eight microbatches: the step equals `jax.jit`'s."""
    _same_step(_plan(config, MeshSpec.of(data=2, stage=4), others, microbatches), config, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["shard_map", "jit"])
def test_unrolled_layers_run_the_circular_schedule_in_chunks_of_unequal_lengths(backend):
    """Five unrolled layers in four chunks (2, 1, 1, 1: each padded to 2 slots), two
    stages of two repeats: the step equals `jax.jit`'s, XLA's collectives the modeled
    ones."""
    config = dataclasses.replace(TWO, n_layers=5)
    part = _plan(config, MeshSpec.of(data=4, stage=2), [T.DataParallel("data")], 2, repeats=2)
    assert part.pipelines[0].split(2).layers() == ((0, 1, 3), (2, 4))
    _same_step(part, config, backend)
    compiled, modeled = _collectives(part, config, backend)
    assert compiled == modeled


@pytest.mark.slow
def test_circular_stages_of_rolled_layers_gather_their_weights_once_as_gpipe_does():
    """FSDP on the other axis, four microbatches: the exchange brings each stage its
    rows in chunk order before the tick loop, so the stage's weights are gathered once
    before it (and their gradients reduced once after) as under GPipe, not per tick:
    XLA's all-gathers over 'data' are GPipe's, and its collectives the modeled ones."""
    config = CIRCULAR["gpt"]

    def gathers(repeats):
        part = _plan(config, MeshSpec.of(data=4, stage=2), [T.FSDP("data")], 4, repeats=repeats)
        compiled, modeled = _collectives(part, config, "shard_map")
        assert compiled == modeled
        return {key: n for key, n in compiled.items() if key[0] == partir.Kind.ALL_GATHER and key[1] == ("data",)}

    assert gathers(2) == gathers(1)


@pytest.mark.slow
def test_a_saved_circular_plan_of_unrolled_layers_loads_and_runs_as_it_was_made(tmp_path):
    """`automap.partition` rolls five unrolled layers for the circular schedule (chunks
    of 2, 1, 1, 1); the plan file reads back to the same pipeline and bytes, and the
    loaded plan's step equals `jax.jit`'s."""
    config = dataclasses.replace(TWO, n_layers=5)
    step, args = gpt.make_train_step(config)
    plan = automap.partition(step, mesh={"data": 4, "stage": 2}, lowering="shard_map", device="cpu",
                             schedule=[T.DataParallel("data"), T.Pipeline("stage", microbatches=2, repeats=2)])(*args)
    plan.save(tmp_path / "plan.json")
    loaded = automap.load_plan(tmp_path / "plan.json").bind(step, *args)
    assert loaded.partitioning.pipelines == plan.partitioning.pipelines
    loaded.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == (tmp_path / "plan.json").read_bytes()
    for a, b in zip(jax.tree_util.tree_leaves(loaded.jit()(*args)), jax.tree_util.tree_leaves(jax.jit(step)(*args))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
