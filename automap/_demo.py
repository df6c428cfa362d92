"""`automap demo`: search a plan for the built-in GPT train step on a 2x4 mesh of
simulated CPU devices, show it, run training steps with it, and check the loss against
the unpartitioned run."""

from __future__ import annotations

import time

#: The demo's model: big enough that partitioning pays on the CPU cost model.
CONFIG = dict(n_layers=4, d_model=256, n_heads=8, d_ff=1024, vocab=1024, seq_len=64, batch=2)
STEPS = 3
BUDGET_S = 10.0


def _use_simulated_cpus(n: int = 8) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def examples_module(name: str):
    """`examples.<name>` of the automap checkout (the examples are not installed): from
    the working folder when it is the checkout, else from beside the `automap` package."""
    import importlib
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if "examples" not in sys.modules and (root / "examples" / "__init__.py").is_file() and str(root) not in sys.path:
        sys.path.append(str(root))
    try:
        return importlib.import_module(f"examples.{name}")
    except ModuleNotFoundError as e:
        from ._errors import AutomapError

        raise AutomapError(f"the demo's model (examples/{name}.py) is not here ({e}): run it from an automap "
                           "checkout (make demo)") from None


def run(console=None) -> int:
    """Run the demo; returns a process exit status."""
    _use_simulated_cpus()
    import jax
    import numpy as np
    from rich.table import Table

    import search

    gpt = examples_module("gpt")

    from ._api import partition
    from ._console import table_console

    console = table_console(console)
    cfg = gpt.GPTConfig(**CONFIG)
    step, args = gpt.make_train_step(cfg)
    mesh = "data=2,model=4"
    console.print(f"[bold]automap demo[/]: GPT train step ({cfg.n_layers} layers, d_model {cfg.d_model}, batch "
                  f"{cfg.batch}) on mesh {mesh} of simulated CPU devices; searching {BUDGET_S:.0f} s for a plan "
                  "on the CPU cost model", highlight=False)
    t0 = time.perf_counter()
    schedule = [search.AutomaticPartition(budget_s=BUDGET_S, device="cpu")]
    plan = partition(step, mesh=mesh, schedule=schedule, device="cpu")(*args)
    console.print(f"planned in {time.perf_counter() - t0:.1f} s", highlight=False)
    plan.explain(console)

    fn, ref = plan.jit(), jax.jit(step)
    losses = Table(title="training steps: partitioned vs unpartitioned (jax.jit)")
    for col in ("step", "loss, automap plan", "loss, jax.jit", "difference"):
        losses.add_column(col, justify="right")
    state, ref_state = plan.shard_args(*args), tuple(args)
    t0 = time.perf_counter()
    for i in range(STEPS):
        params, opt_state, loss = fn(*state)
        rparams, ropt_state, rloss = ref(*ref_state)
        losses.add_row(str(i + 1), f"{float(loss):.6f}", f"{float(rloss):.6f}", f"{abs(float(loss) - float(rloss)):.1e}")
        np.testing.assert_allclose(float(loss), float(rloss), rtol=1e-4)
        state, ref_state = (params, opt_state, state[2]), (rparams, ropt_state, ref_state[2])
    console.print(losses)
    console.print(f"{STEPS} steps in {time.perf_counter() - t0:.1f} s with compilation; the parameters come back "
                  f"with the plan's shardings, e.g. w1 of layer 0 as {params['layers'][0]['mlp']['w1'].sharding.spec}",
                  highlight=False)
    return 0
