"""One process of the two-process test (`test_multiprocess.py`): joins a 2-process JAX
cluster on 127.0.0.1 with 4 simulated CPU devices of its own, forms the `data=2,
model=4` mesh over all 8 devices, plans the GPT train step with `automap.jit` (planning
alone, with its own plan cache: the processes do not talk about the plan), feeds it
its own half of the batch, and trains a few steps with each lowering. Writes the plan
files, the losses and (process 0) the updated parameters to the output folder.

    python tests/multiprocess_worker.py PROCESS_ID PORT OUT_DIR STEPS
"""

import json
import os
import sys

# The suite's compile level (tests/conftest.py): what the test compares is decided
# before LLVM runs.
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

CONFIG = dict(n_layers=2, adam_eps=1e-3)


def main(process_id: int, port: int, out: str, steps: int) -> None:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               local_device_ids=list(range(4)))
    from jax.experimental import multihost_utils

    import automap
    import tactics
    from examples import gpt
    from partir import MeshSpec

    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = MeshSpec.of(data=2, model=4).jax_mesh()  # process i holds the data=i row of the mesh
    step, (params, opt_state, batch) = gpt.make_train_step(gpt.GPTConfig(**CONFIG))
    half = jax.tree.map(lambda x: np.asarray(x)[process_id * x.shape[0] // 2:(process_id + 1) * x.shape[0] // 2],
                        batch)
    result = {}
    for lowering in ("jit", "shard_map"):
        fn = automap.jit(step, mesh=mesh, schedule=[tactics.DataParallel("data"), tactics.Megatron("model")],
                         device="cpu", cache_dir=os.path.join(out, f"cache{process_id}-{lowering}"),
                         lowering=lowering)
        plan = fn.plan_for(params, opt_state, batch)
        plan.save(os.path.join(out, f"plan-{process_id}-{lowering}.json"))
        p, s, b = plan.shard_args(params, opt_state, half, process_local=(2,))
        losses = []
        for _ in range(steps):
            p, s, loss = fn(p, s, b)
            losses.append(float(loss))
        result[lowering] = losses
        whole = multihost_utils.process_allgather(p, tiled=True)
        if process_id == 0:
            leaves = {str(i): np.asarray(x) for i, x in enumerate(jax.tree_util.tree_leaves(whole))}
            np.savez(os.path.join(out, f"params-{lowering}.npz"), **leaves)
    with open(os.path.join(out, f"losses-{process_id}.json"), "w") as f:
        json.dump(result, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
