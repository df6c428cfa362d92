"""Graph facts defined once in the IR (`partir._graph`): union-find, values one across
call boundaries, backward reachability and "made from scalars", which the cost model
and the lowerings read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partir
import search
from examples import REGISTRY, gpt, llama


def test_union_find_keeps_the_first_member_as_root():
    sets = partir.UnionFind(6)
    sets.union(4, 2), sets.union(2, 5), sets.union(0, 1)
    assert [sets.find(x) for x in range(6)] == [0, 0, 2, 3, 2, 2]
    assert sets.labels() == [0, 0, 1, 2, 1, 1]


def _program(name):
    # Built in the test, not at collection: every xdist worker collects every module.
    if name == "llama-scan-remat":
        step, args = llama.make_train_step(llama.LlamaConfig(scan_layers=True, remat=True))
    else:
        step, args = REGISTRY[name]()
    return partir.lift(step, *args)


@pytest.mark.parametrize("name", ["gpt", "llama", "moe", "convnet", "llama-scan-remat"])
def test_what_the_cost_model_remakes_is_what_the_ir_says_is_made_from_scalars_and_fused(name):
    prog = _program(name)
    mat = search.materialization(prog)
    made = np.array(partir.made_from_scalars(prog))
    fused = mat.virtual & np.array([p >= 0 and mat.live_op[p] for p in prog.producer])
    arrays = np.array([bool(v.shape) for v in prog.values])
    assert np.array_equal(mat.from_scalars & arrays, made & fused & arrays)
    # A causal mask is made from scalars; a parameter is not.
    assert made.any() and not any(made[v] for v in prog.inputs)


def test_depended_on_follows_loops_to_the_inputs():
    step, args = gpt.make_train_step(gpt.GPTConfig(scan_layers=True))
    prog = partir.lift(step, *args)
    loss = prog.outputs[-1]
    values, ops = partir.depended_on(prog, [loss])
    params = [v for n, v in zip(prog.input_names, prog.inputs) if n.startswith("params")]
    assert all(values[v] for v in params) and values[loss] and ops.any()
    assert not any(values[v] for v in prog.outputs[:-1] if v != loss and prog.producer[v] >= 0
                   and prog.ops[prog.producer[v]].primitive == "sub")  # the updates come after the loss


def test_calls_run_in_their_callers_computation_and_loops_in_their_own():
    """XLA inlines `jit`/checkpoint calls into the caller; a scan body is a computation
    of its own, so collectives hide behind compute of the same computation only."""
    def f(x):
        y = jax.checkpoint(jnp.sin)(x)
        return jax.lax.scan(lambda c, _: (jnp.cos(c), None), y, None, length=3)[0]

    prog = partir.lift(f, jnp.ones(4))
    comp = partir.computations(prog)
    kinds = {r.kind: r.id for r in prog.regions}
    call = next(r for r in prog.regions if r.parent is not None and r.parent >= 0 and r.kind != "scan")
    assert comp[call.id] == comp[call.parent] == 0
    assert comp[kinds["scan"]] == kinds["scan"]
