"""The shard_map lowering: the compiled program holds exactly the collectives the cost
model lists, it computes what plain `jax.jit` and the jit lowering compute (examples,
nested jaxprs, rematerialized residuals, local rules of primitives with shapes in their
params), and `automap` runs plans with it."""

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
from examples import REGISTRY, gpt, llama
from examples.plans import STRATEGIES
from partir import MeshSpec, PartitioningError, Tiling
from partir.lowering._local import LocalOp, bind_local
from partir.lowering._spmd import move
from search import materialization

MESH = MeshSpec.of(data=2, model=4)
EPS = 1e-3  # Adam eps large enough that near-zero gradients cannot flip updates


def _config(name):
    if name.startswith("gpt"):
        return gpt.GPTConfig(adam_eps=EPS, scan_layers="scan" in name, remat="remat" in name)
    mod = __import__(f"examples.{name}", fromlist=["x"])
    return next(getattr(mod, a) for a in dir(mod) if a.endswith("Config"))(adam_eps=EPS)


@functools.cache
def _program(name):
    step, args = REGISTRY[name.split("-")[0]](_config(name), abstract=True)
    return step, args, partir.lift(step, *args)


def _lower(part):
    return partir.lower(part, backend="shard_map", free=materialization(part.program).from_scalars)


# -- the collectives ---------------------------------------------------------------------
def compiled_collectives(text, mesh) -> collections.Counter:
    """(kind, mesh axes, bytes per device) of each collective in compiled HLO, per buffer,
    a reduce-scatter counted as the all-reduce the `cpu` device costs it as."""
    return partir.collective_buffers(partir.collectives(text, mesh), reduce_scatter=False)


def modeled_collectives(cost) -> collections.Counter:
    """(kind, mesh axes, bytes per device) of each collective the model lists, a loop
    body's once (as the HLO text holds it once)."""
    return collections.Counter((c.kind, c.axes, int(c.bytes)) for c in cost.collectives)


EXAMPLES = ["mlp", "gpt", "convnet", "moe"]
EQUAL_CASES = [(m, s) for m in EXAMPLES for s in STRATEGIES] + [("gpt-scan-remat", "dp+megatron")]
QUICK = {("gpt", "dp+megatron"), ("mlp", "fsdp"), ("moe", "fsdp"), ("convnet", "dp+megatron")}


@pytest.mark.parametrize("model,strategy", [pytest.param(*c, marks=() if c in QUICK else pytest.mark.slow)
                                            for c in EQUAL_CASES], ids=[f"{m}-{s}" for m, s in EQUAL_CASES])
def test_compiled_collectives_are_exactly_the_modeled_ones(model, strategy):
    _, args, prog = _program(model)
    part = partir.Partitioning(prog, MESH)
    STRATEGIES[strategy](part, model.split("-")[0], "data", "model")
    text = _lower(part).lower(*args).compile().as_text()
    compiled = compiled_collectives(text, MESH.jax_mesh())
    assert compiled and compiled == modeled_collectives(search.CostModel(part, "cpu").cost())


@pytest.mark.slow
def test_llama_schedules_compile_to_the_modeled_collectives():
    step, args = llama.make_train_step(dataclasses.replace(llama.LlamaConfig(adam_eps=EPS), scan_layers=True),
                                       abstract=True)
    prog = partir.lift(step, *args)
    mesh = MeshSpec.of(data=2, fsdp=2, model=2)
    part = T.apply_schedule(prog, mesh, llama.SCHEDULES["fsdp+tp"]()).partitioning
    text = _lower(part).lower(*args).compile().as_text()
    assert compiled_collectives(text, mesh.jax_mesh()) == modeled_collectives(search.CostModel(part, "cpu").cost())


# -- numerics ----------------------------------------------------------------------------
NUMERIC_CASES = [(m, s) for m in ["mlp", "gpt", "gpt-scan-remat", "convnet", "moe"] for s in STRATEGIES]
NUMERIC_QUICK = {("moe", "dp+megatron")}  # (the GPT runs in the remat test below)


@pytest.mark.parametrize("model,strategy", [pytest.param(*c, marks=() if c in NUMERIC_QUICK else pytest.mark.slow)
                                            for c in NUMERIC_CASES], ids=[f"{m}-{s}" for m, s in NUMERIC_CASES])
def test_example_computes_what_jit_and_the_jit_lowering_compute(model, strategy):
    step, args = REGISTRY[model.split("-")[0]](_config(model))
    part = partir.Partitioning(_program(model)[2], MESH)
    STRATEGIES[strategy](part, model.split("-")[0], "data", "model")
    _same_steps(step, args, part, [partir.lower(part)])


def test_expert_parallelism_dispatches_per_device_as_jit_does():
    # The MoE's experts over `model`, its batch over `data` (tactics, not a hand plan):
    # the all-to-alls of dispatch and combine, forward and backward, are the modeled ones
    # and two steps train as plain jit and the jit lowering train.
    step, args = REGISTRY["moe"](_config("moe"))
    part = T.apply_schedule(_program("moe")[2], MESH, [T.DataParallel("data"), T.ExpertParallel("model")]).partitioning
    lowered = _same_steps(step, args, part, [partir.lower(part)])
    compiled = compiled_collectives(lowered.lower(*args).compile().as_text(), MESH.jax_mesh())
    assert sum(n for (kind, _, _), n in compiled.items() if kind == partir.Kind.ALL_TO_ALL) >= 4
    assert compiled == modeled_collectives(search.CostModel(part, "cpu").cost())


def _same_steps(step, args, part, others=(), steps: int = 2):
    """Train `steps` steps with the shard_map lowering of `part`, with `jax.jit(step)`
    and with the `others`, each fed its own outputs, and assert they agree (parameters,
    optimizer state, loss); returns the shard_map lowering."""
    lowered = _lower(part)
    runs = [lowered, jax.jit(step), *others]
    states = [tuple(args)] * len(runs)
    for n in range(steps):
        outs = [fn(*state) for fn, state in zip(runs, states)]
        for other in outs[1:]:
            for name, a, b in zip(part.program.output_names, jax.tree_util.tree_leaves(outs[0]),
                                  jax.tree_util.tree_leaves(other)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6,
                                           err_msg=f"{name} at step {n}")
        states = [tuple(out[:2]) + tuple(args[2:]) for out in outs]
    return lowered


@pytest.fixture(scope="module")
def nested():
    import test_lower

    return test_lower


@pytest.mark.parametrize("kind,grad", [("scan", True), ("while", False), ("fori", True), ("cond", True),
                                       ("remat", True), ("custom_jvp", True), ("custom_vjp", True), ("jit", True)])
def test_nested_jaxprs_lower_per_device(nested, kind, grad):
    ws, x = nested._w((3, 16, 16), 1), nested._w((8, 16), 2)
    fn = jax.value_and_grad(nested._loss(kind)) if grad else nested.NESTED[kind]
    part = partir.Partitioning(partir.lift(fn, ws, x), MESH)
    part.tile("x", 0, "data")
    part.tile("ws", 2, "model")
    partir.check_equivalence(fn, (ws, x), part, rtol=2e-5, atol=2e-6, backend="shard_map")


REMAT_CASES = [(True, "full"), (False, "dots"), (True, "collectives"), (False, "collectives")]


@pytest.mark.parametrize("scan,policy", [pytest.param(*c, marks=() if c == (True, "full") else pytest.mark.slow)
                                         for c in REMAT_CASES], ids=[f"{'scan' if s else 'unrolled'}-{p}"
                                                                     for s, p in REMAT_CASES])
def test_rematerialized_residuals_are_recomputed_per_device(scan, policy):
    # The plan's remat decisions hold: the backward pass recomputes the residuals from
    # kept blocks, with their collectives again, as the model charges them.
    config = gpt.GPTConfig(n_layers=2, d_ff=128, vocab=64, adam_eps=EPS, scan_layers=scan)
    step, args = gpt.make_train_step(config)
    prog = partir.lift(step, *args)
    part = T.apply_schedule(prog, MESH, [T.DataParallel("data"), T.Megatron("model"), T.Remat(policy)]).partitioning
    assert part.rematerialized
    text = _same_steps(step, args, part).lower(*args).compile().as_text()
    assert compiled_collectives(text, MESH.jax_mesh()) == modeled_collectives(search.CostModel(part, "cpu").cost())


# -- local rules -------------------------------------------------------------------------
LOOKUPS = {
    "index": lambda t, ids: t[ids],  # in bounds (promised)
    # Out of bounds though promised (numpy indexing's mode): XLA clamps such an index, and
    # so must the devices holding blocks of rows (they looked up nothing: fuzzing found it).
    "index_out_of_bounds": lambda t, ids: t[ids],
    "clip": lambda t, ids: jnp.take(t, ids, axis=0, mode="clip"),
    "fill": lambda t, ids: jnp.take(t, ids, axis=0, mode="fill", fill_value=-1.0),
}


@pytest.mark.parametrize("mode", sorted(LOOKUPS))
def test_vocabulary_parallel_lookup_and_its_gradient(mode):
    table = jax.random.normal(jax.random.key(0), (64, 16))
    ids = jax.random.randint(jax.random.key(1), (8, 4), 0 if mode == "index" else -80, 64 if mode == "index" else 150)

    def f(table, ids):
        return jax.value_and_grad(lambda t: jnp.sum(LOOKUPS[mode](t, ids) ** 2))(table)

    part = partir.Partitioning(partir.lift(f, table, ids), MESH)
    part.tile("table", 0, "model")  # rows split: each device looks up the rows it holds
    part.tile("ids", 0, "data")
    partir.check_equivalence(f, (table, ids), part, rtol=1e-5, atol=1e-5, backend="shard_map")
    text = _lower(part).lower(table, ids).compile().as_text()
    assert compiled_collectives(text, MESH.jax_mesh()) == modeled_collectives(search.CostModel(part, "cpu").cost())


@pytest.mark.parametrize("rows", [None, "model"])
def test_a_scatter_add_of_split_updates_adds_its_operand_once(rows):
    # Updates split along their scattered dim leave partial sums over "data"; the table,
    # which no device splits along that dim, must be added into them once, not per device.
    def f(table, ids):
        return table.at[ids].add(jnp.tanh(table[ids]))

    table = jax.random.normal(jax.random.key(0), (16, 8))
    ids = jax.random.randint(jax.random.key(1), (4, 8), 0, 16)
    part = partir.Partitioning(partir.lift(f, table, ids), MESH)
    part.tile("ids", 0, "data")
    if rows:
        part.tile("table", 0, rows)
    partir.check_equivalence(f, (table, ids), part, rtol=1e-5, atol=1e-5, backend="shard_map")


RESHAPES = {  # (x, y) -> a reshape of x times y, whose shape is the reshape's result
    "merge": ((4, 4, 4), (4, 16), lambda x, y: jax.nn.softmax(x.reshape(4, 16), axis=0) * y),
    "split": ((4, 16), (4, 4, 4), lambda x, y: jnp.tanh(x.reshape(4, 4, 4)) * y),
}


@pytest.mark.parametrize("kind", sorted(RESHAPES))
def test_a_reshape_of_a_split_minor_factor_reads_it_whole(kind):
    # [4, 4] <-> [16] with the minor 4 split over "data": the merged dim's blocks would
    # interleave, not lie contiguous; the op reads that factor whole (found by fuzzing).
    xs, ys, fn = RESHAPES[kind]
    x, y = jax.random.normal(jax.random.key(0), xs), jax.random.normal(jax.random.key(1), ys)
    f = jax.value_and_grad(lambda x, y: jnp.sum(fn(x, y) ** 2), argnums=(0, 1))
    part = partir.Partitioning(partir.lift(f, x, y), MESH)
    part.tile("x" if kind == "merge" else "y", 2, "data")
    partir.check_equivalence(f, (x, y), part, rtol=1e-5, atol=1e-5, backend="shard_map")
    text = _lower(part).lower(x, y).compile().as_text()
    assert compiled_collectives(text, MESH.jax_mesh()) == modeled_collectives(search.CostModel(part, "cpu").cost())


def test_split_iotas_and_random_draws_match_a_whole_draw():
    def f(key, x):
        noise = jax.random.normal(key, x.shape)
        return x * noise + jax.lax.broadcasted_iota(jnp.float32, x.shape, 1) + jnp.arange(x.shape[0])[:, None]

    args = (jax.random.key(3), jnp.ones((8, 16)))
    part = partir.Partitioning(partir.lift(f, *args), MESH)
    part.tile("x", 0, "data")
    part.tile("x", 1, "model")
    partir.check_equivalence(f, args, part, backend="shard_map", free=())


def test_a_primitive_whose_shape_params_a_split_changes_is_never_guessed():
    jaxpr = jax.make_jaxpr(lambda x: jax.lax.pad(x, 0.0, [(1, 1, 0)]))(jnp.ones(8))
    (eqn,) = jaxpr.eqns
    op = LocalOp(eqn, (Tiling((("data",),)), None), (Tiling((("data",),)),), ((8,), ()), ((10,),), MESH)
    with pytest.raises(PartitioningError, match="primitive 'pad' cannot run on split blocks"):
        jax.jit(jax.shard_map(lambda x: bind_local(op, [x, 0.0])[0], mesh=MESH.jax_mesh(),
                              in_specs=jax.sharding.PartitionSpec("data"),
                              out_specs=jax.sharding.PartitionSpec("data"), check_vma=False)).lower(jnp.ones(8))


def test_an_operand_an_op_would_count_once_per_device_is_refused():
    # A result partial over "data" sums the devices' results: an operand whole along
    # "data" that the op sums (a rule that leaves a reduction factor off it) would be
    # counted twice; only the operands the op does not sum may be (a gather's indices).
    jaxpr = jax.make_jaxpr(jnp.dot)(jnp.ones((4, 8)), jnp.ones((8, 2)))
    (eqn,) = jaxpr.eqns
    split, whole = Tiling(((), ("data",))), Tiling(((), ()))
    op = LocalOp(eqn, (split, whole), (whole,), ((4, 8), (8, 2)), ((4, 2),), MESH, partial=("data",))
    with pytest.raises(PartitioningError, match=r"'dot_general' .* partial over \('data',\), along which operand 1"):
        bind_local(op, [jnp.ones((4, 4)), jnp.ones((8, 2))])


def test_a_free_mask_of_the_wrong_size_is_refused():
    part = partir.Partitioning(partir.lift(jnp.sin, jnp.ones(8)), MESH)
    with pytest.raises(PartitioningError, match="free= is a mask of 3 entries"):
        partir.lower(part, backend="shard_map", free=np.array([True, False, True]))


# -- automap -----------------------------------------------------------------------------
def test_automap_runs_a_plan_as_shard_map(tmp_path):
    step, args = gpt.make_train_step(gpt.GPTConfig(n_layers=2, adam_eps=EPS))
    schedule = [T.DataParallel("data"), T.Megatron("model")]
    fn = automap.jit(step, mesh="data=2,model=4", schedule=schedule, device="cpu", cache_dir=tmp_path,
                     lowering="shard_map")
    params, opt_state, loss = fn(*args)
    ref = jax.jit(step)(*args)
    for a, b in zip(jax.tree_util.tree_leaves((params, opt_state, loss)), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    plan = next(iter(fn.plans.values()))
    assert plan.lowering == "shard_map" and plan.to_json()["lowering"] == "shard_map"
    text = fn.lower(*args).compile().as_text()
    assert compiled_collectives(text, plan.jax_mesh) == modeled_collectives(plan.cost)
    # The same plan, lowered the other way on demand; each lowering is made once.
    assert plan.jit("jit") is plan.jit("jit") and plan.jit("jit") is not plan.jit()
    with pytest.raises(PartitioningError, match="lowering='pmap' is not one of 'jit', 'shard_map'"):
        automap.jit(step, mesh="data=8", lowering="pmap")
    with pytest.raises(PartitioningError, match="lowering='pjit'"):
        plan.jit("pjit")
    with pytest.raises(automap.PlanError, match=r"process_local names no argument at \[5\]"):
        plan.shard_args(*args, process_local=(2, 5))


# (src dims, partial axes, dst dims) on `MESH` (data=2, model=4): a dim trading its axes
# for ones that split it into as many blocks or more is moved by a collective-permute.
TRADES = [
    (((), ("data",)), (), ((), ("model",))),
    ((("data",), ()), (), ((("model", "data")), ())),
    (((), ("data",)), ("model",), ((), ("model",))),
]


@pytest.mark.parametrize("src,partial,dst", TRADES, ids=["refine", "behind", "partial"])
def test_a_dim_trading_axes_is_permuted_as_modeled(src, partial, dst):
    # jit (XLA's own reshard, for inputs that are not partial) and the shard_map lowering
    # move the value as the model charges it: one collective-permute of the new block,
    # after all-reducing the new axes the value is partial over.
    jmesh = MESH.jax_mesh()
    src_t, dst_t = Tiling(src, partial), Tiling(dst)
    x = jnp.arange(16 * 32, dtype=jnp.float32).reshape(16, 32)
    links = search.LinkModel(MESH, search.get_device("cpu"), {a: "intra" for a in MESH.names})
    modeled = collections.Counter((k, axes, int(b)) for k, axes, b, _ in links.reshard(src_t, dst_t, x.nbytes, MESH))
    assert {k for k, _, _ in modeled} - {"all-reduce"} == {"collective-permute"}

    def local(block):
        if partial:  # a partial sum whose terms add up to the block on every device
            block = block * (jax.lax.axis_index(partial) == 0)
        return move(block, src_t, dst_t, MESH)

    spmd = jax.jit(jax.shard_map(local, mesh=jmesh, in_specs=Tiling(src).spec(), out_specs=dst_t.spec(),
                                 check_vma=False))
    np.testing.assert_array_equal(spmd(x), x)
    assert compiled_collectives(spmd.lower(x).compile().as_text(), jmesh) == modeled
    if not partial:
        sh = jax.sharding.NamedSharding
        jitted = jax.jit(lambda y: y * 2, in_shardings=sh(jmesh, Tiling(src).spec()),
                         out_shardings=sh(jmesh, dst_t.spec()))
        assert compiled_collectives(jitted.lower(x).compile().as_text(), jmesh) == modeled


@pytest.mark.parametrize("lowering", ["jit", "shard_map"])
def test_a_debug_callback_runs_once_per_call_with_the_whole_value(tmp_path, lowering, capfd):
    seen = []

    def step(w, x):
        y = jnp.tanh(x @ w)
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), y)
        jax.debug.print("total {t}", t=y.sum())
        return y.sum()

    w, x = jnp.full((8, 4), 0.1), jnp.arange(64.0).reshape(8, 8) / 64
    fn = automap.jit(step, mesh="data=2,model=4", schedule=[T.Shard("x", 0, "data"), T.Shard("w", 1, "model")],
                     cache_dir=tmp_path, lowering=lowering)
    fn(w, x)
    jax.effects_barrier()
    assert len(seen) == 1  # as under jax.jit, not once per device
    np.testing.assert_allclose(seen[0], np.tanh(np.asarray(x) @ np.asarray(w)), rtol=1e-6)
    assert capfd.readouterr().out.count("total") == 1
