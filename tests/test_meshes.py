"""The meshes JAX users make today: `jax.make_mesh` gives Explicit axes, and a plan that
splits something runs on them in both lowerings, computing what `jax.jit` computes and
giving back arrays whose shardings are valid on the user's mesh (they feed the next step
and the user's own explicit-mode code). A mesh with Manual axes is a clear error before
any work."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import automap
import tactics as T
from examples import gpt

CONFIG = gpt.GPTConfig(n_layers=2, adam_eps=1e-3)
SCHEDULE = [T.DataParallel("data"), T.Megatron("model")]


@pytest.mark.parametrize("lowering", ["jit", pytest.param("shard_map", marks=pytest.mark.slow)])
def test_a_plan_runs_on_a_mesh_of_explicit_axes(tmp_path, lowering):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    assert set(mesh.axis_types) == {AxisType.Explicit}
    step, args = gpt.make_train_step(CONFIG)
    fn = automap.jit(step, mesh=mesh, schedule=SCHEDULE, device="cpu", cache_dir=tmp_path, lowering=lowering)
    params, opt_state, loss = fn(*args)
    params, opt_state, loss = fn(params, opt_state, args[2])  # the outputs feed the next step
    ref = jax.jit(step)
    rp, rs, _ = ref(*args)
    rp, rs, rloss = ref(rp, rs, args[2])
    np.testing.assert_allclose(float(loss), float(rloss), rtol=2e-5)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(rp)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    w1 = params["layers"][0]["mlp"]["w1"]
    assert w1.sharding.mesh.axis_types == mesh.axis_types and "model" in str(w1.sharding.spec)
    # Valid in the user's own explicit-mode code on the same mesh.
    with jax.set_mesh(mesh):
        doubled = jax.jit(lambda x: x * 2)(w1)
    assert doubled.sharding.spec == w1.sharding.spec


def test_a_mesh_of_manual_axes_is_refused_before_any_work(tmp_path):
    devices = np.array(jax.devices()).reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("data", "model"), axis_types=(AxisType.Manual,) * 2)

    def step(x):
        raise AssertionError("traced: the error came after work started")

    with pytest.raises(automap.AutomapError, match=r"Manual .*pass the mesh the program runs on outside shard_map"):
        automap.jit(step, mesh=mesh, cache_dir=tmp_path)
    with pytest.raises(automap.AutomapError, match="Manual"):
        automap.partition(step, mesh=mesh)


def test_an_explicit_mesh_plan_takes_arrays_placed_on_it(tmp_path):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    step, args = gpt.make_train_step(CONFIG)
    fn = automap.jit(step, mesh=mesh, schedule=SCHEDULE, device="cpu", cache_dir=tmp_path)
    plan = fn.plan_for(*args)
    placed = plan.shard_args(*args)
    w1 = placed[0]["layers"][0]["mlp"]["w1"]
    assert w1.sharding.mesh.axis_types == mesh.axis_types
    assert isinstance(w1.sharding, NamedSharding) and w1.sharding.spec != PartitionSpec()
    np.testing.assert_allclose(float(fn(*placed)[2]), float(jax.jit(step)(*args)[2]), rtol=2e-5)
