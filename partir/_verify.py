"""The equivalence oracle: a partitioned program must compute what the original does."""

from __future__ import annotations

import jax
import numpy as np

from .lowering import lower
from ._partitioning import Partitioning


def check_equivalence(fn, args, part: Partitioning, mesh=None, *, rtol: float = 1e-5, atol: float = 1e-6,
                      steps: int = 1, **lower_options) -> dict[str, float]:
    """Run `fn` under plain `jax.jit` and the lowered plan on the same `args`, and compare
    every output leaf with `np.testing.assert_allclose` (the error names the leaf).

    With `steps > 1`, `fn` must be a train step whose outputs start with its first
    arguments' new values (`(params, opt_state, ...) -> (params, opt_state, loss)`): both
    runs are fed their own outputs, so differences that compound over steps show.
    The plan runs twice on the first arguments (the second run is compared): from its
    second call JAX dispatches to the executable it cached, as in a training loop.
    Returns the largest absolute difference per output name.
    """
    prog = part.program
    ref_fn = jax.jit(fn)
    plan_fn = lower(part, mesh, **lower_options)
    ref_args, plan_args = tuple(args), tuple(args)
    worst: dict[str, float] = {}
    for step in range(steps):
        ref = ref_fn(*ref_args)
        out = plan_fn(*plan_args)
        if step == 0 and not lower_options.get("donate_argnums"):
            # Again on the same arguments: JAX's cached dispatch, which a training loop
            # takes from its second call, runs what the first trace lifted (a tracer
            # leaked between traces crashes there, not on the first call).
            out = plan_fn(*plan_args)
        ref_leaves = jax.tree_util.tree_leaves(ref)
        out_leaves = jax.tree_util.tree_leaves(out)
        assert len(ref_leaves) == len(out_leaves), "the plan returns a different number of outputs"
        for name, r, o in zip(prog.output_names, ref_leaves, out_leaves):
            r, o = np.asarray(r), np.asarray(o)
            np.testing.assert_allclose(o, r, rtol=rtol, atol=atol, err_msg=f"output {name} at step {step}")
            diff = float(np.max(np.abs(o.astype(np.float64) - r.astype(np.float64)))) if r.size else 0.0
            worst[name] = max(worst.get(name, 0.0), diff)
        if steps > 1:
            n = len(ref) - 1
            ref_args = tuple(ref[:n]) + ref_args[n:]
            plan_args = tuple(out[:n]) + plan_args[n:]
    return worst
