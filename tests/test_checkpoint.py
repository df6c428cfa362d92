"""A checkpoint written under one plan is restored under another: orbax writes the
train state as the first plan lays it out and reads it back laid out as the second plan
wants, and training goes on under the second plan as if nothing had changed."""

import jax
import numpy as np
import orbax.checkpoint as ocp

import automap
import tactics as T
from examples import mlp


def test_state_saved_under_one_plan_restores_under_another(tmp_path):
    step, args = mlp.make_train_step(mlp.MLPConfig(adam_eps=1e-3))
    tensor_parallel = automap.partition(step, mesh="data=2,model=4", device="cpu",
                                        schedule=[T.DataParallel("data"), T.Megatron("model")])(*args)
    sharded = automap.partition(step, mesh="data=8", device="cpu", schedule=[T.FSDP("data")])(*args)
    params, opt_state, _ = tensor_parallel.jit()(*tensor_parallel.shard_args(*args))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "step1", (params, opt_state))
    checkpointer.wait_until_finished()

    # The restore target: the state's shapes and dtypes, laid out as the new plan wants.
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), (params, opt_state),
                          tuple(sharded.in_shardings[:2]))
    restored = checkpointer.restore(tmp_path / "step1", target)
    for got, want, sharding in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves((params, opt_state)),
                                   jax.tree_util.tree_leaves(sharded.in_shardings[:2])):
        assert got.sharding == sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert any(s != t for s, t in zip(jax.tree_util.tree_leaves(sharded.in_shardings[0]),
                                      jax.tree_util.tree_leaves(tensor_parallel.in_shardings[0])))

    # Training goes on under the new plan as it would have under the old one.
    batch = sharded.shard_args(*args)[2]
    new = sharded.jit()(*restored, batch)
    old = tensor_parallel.jit()(params, opt_state, tensor_parallel.shard_args(*args)[2])
    for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(old)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
