"""`automap demo`: partition the built-in GPT train step on 8 simulated CPU devices.

The plan comes from a schedule: data parallel on `data`, then Megatron on `model`
(tensor-parallel blocks found from the dataflow). The demo lowers it, runs a training
step, checks the loss against the unpartitioned run, and prints the per-parameter
sharding and the collectives XLA inserted.
"""

from __future__ import annotations

import time


def _use_simulated_cpus(n: int = 8) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def run(console=None) -> int:
    """Run the demo; returns a process exit status."""
    _use_simulated_cpus()
    import jax
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    import partir
    import tactics
    from examples import gpt

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped or captured: do not squeeze tables to 80 columns
            console = Console(width=150)
    cfg = gpt.GPTConfig(n_layers=4, d_model=128, n_heads=8, d_ff=512, vocab=512, seq_len=32, batch=16)
    step, args = gpt.make_train_step(cfg)
    mesh = partir.MeshSpec.of(data=2, model=4)
    console.print(f"[bold]automap demo[/]: GPT train step ({cfg.n_layers} layers, d_model {cfg.d_model}) "
                  f"on mesh {mesh} of simulated CPU devices")
    t0 = time.perf_counter()
    prog = partir.lift(step, *args)
    planned = tactics.apply_schedule(prog, mesh, [tactics.DataParallel("data"), tactics.Megatron("model")])
    part = planned.partitioning
    console.print(f"lifted {prog} and planned in {time.perf_counter() - t0:.2f} s")
    console.print(planned.describe(decisions=False), markup=False, highlight=False)

    sizes = mesh.sizes()
    table = Table(title="parameters: sharding and bytes per device")
    table.add_column("parameter", no_wrap=True)
    table.add_column("shape", justify="right")
    table.add_column("spec", no_wrap=True)
    table.add_column("bytes/device", justify="right")
    decided = {d.value: d.source for d in part.decisions}
    table.add_column("decided by")
    for v, name in zip(prog.inputs, prog.input_names):
        if not name.startswith("params"):
            continue
        val, t = prog.values[v], part.tiling(v)
        per_dev = val.nbytes // t.num_shards(sizes)
        table.add_row(name, str(val.shape), str(t), f"{per_dev:,}", decided.get(v, "propagation"))
    console.print(table)

    jax_mesh = mesh.jax_mesh()
    fn = partir.lower(part, jax_mesh)
    t0 = time.perf_counter()
    _, _, loss = fn(*args)
    ref = jax.jit(step)(*args)[2]
    console.print(f"one training step: loss {float(loss):.6f} partitioned vs {float(ref):.6f} unpartitioned "
                  f"({time.perf_counter() - t0:.1f} s with compilation)")
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)

    cols = partir.collectives_of(fn, *args, mesh=jax_mesh)
    ctab = Table(title="collectives XLA inserted (compiled HLO)")
    for col in ("kind", "mesh axes", "count", "bytes/device"):
        ctab.add_column(col, justify="right" if col in ("count", "bytes/device") else "left")
    for (kind, axes), (count, nbytes) in sorted(partir.summarize(cols).items()):
        ctab.add_row(kind, ", ".join(axes) or "-", str(count), f"{nbytes:,}")
    console.print(ctab)
    return 0
