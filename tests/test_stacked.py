"""A step over unrolled layers has a stacked form (`partir.stack_layers`): each sequence
of alike layers as `[L, ...]` stacks, as a layer scan takes them. It computes what the
unrolled step computes, and the search of a deep unrolled model runs on it (before
twins), finding the plan the twins and the program itself find."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxpr_as_fun

import partir
import search
import tactics as T
from examples import gpt, llama
from partir import MeshSpec, PartitioningError
from search._stacked import StackedState

MESH = MeshSpec.of(data=2, model=4)
EPS = 1e-3  # Adam eps large enough that near-zero gradients cannot flip updates
#: Unrolled steps small enough to run on the CPU in a moment.
TINY = {"llama": llama.LlamaConfig(n_layers=4, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, vocab=32, seq_len=8,
                                   batch=16, adam_eps=EPS, scan_layers=False, remat=False),
        "gpt": gpt.GPTConfig(n_layers=3, d_model=16, n_heads=2, d_ff=32, vocab=32, seq_len=8, batch=16,
                             adam_eps=EPS, scan_layers=False)}
#: A Llama deep enough to be searched on its stacked form (8 or more layers).
DEEP = llama.LlamaConfig(n_layers=9, d_model=128, n_heads=4, n_kv_heads=2, d_ff=256, vocab=512, seq_len=32, batch=8,
                         adam_eps=EPS, scan_layers=False, remat=False)


def _stack(leaf, flat):
    return jnp.stack([flat[k] for k in leaf.members]) if leaf.stacked else flat[leaf.members[0]]


def _momentum_step(params, state, x):
    """Two tanh layers trained by SGD with momentum and a shared step count: each
    layer's update outside its passes reads its own values and the shared count."""
    def loss(params):
        h = x * params["scale"]  # (so that the first layer passes a gradient back as the others do)
        for p in params["layers"]:
            h = jnp.tanh(h @ p["w"] + p["b"])
        return jnp.mean(h ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    lr = 0.1 / (1.0 + state["count"])
    moms = jax.tree.map(lambda m, g: 0.9 * m + g, state["mom"], grads)
    new = jax.tree.map(lambda p, m: p - lr * m, params, moms)
    return new, {"count": state["count"] + 1, "mom": moms}, value


def test_the_stacked_step_computes_the_unrolled_step():
    layers = [{"w": jax.random.normal(jax.random.PRNGKey(i), (4, 4)), "b": jnp.full((4,), 0.1 * i)} for i in range(3)]
    params = {"layers": layers, "scale": jnp.full((4,), 1.5)}
    state = {"count": jnp.float32(2.0), "mom": jax.tree.map(lambda a: 0.5 * a, params)}
    args = (params, state, jax.random.normal(jax.random.PRNGKey(7), (2, 4)))
    _check_stacked(_momentum_step, args)


def _check_stacked(step, args):
    """The stacked form of `step` computes, on the layers' stacks, what `step` does."""
    stacked = partir.stack_layers(partir.lift(step, *args))
    prog = stacked.program
    layers = len(args[0]["layers"])
    # Each layer input is one stack, named by its layers' path, its layer dim first.
    assert prog.values[prog.resolve("params['layers'][:]['w']" if "w" in args[0]["layers"][0] else
                                    "params['layers'][:]['attn']['wq']")].shape[0] == layers
    assert not any("['layers'][0]" in n for n in prog.input_names + prog.output_names)
    flat = jax.tree.leaves(args)
    got = jax.jit(jaxpr_as_fun(prog.closed_jaxpr))(*[_stack(leaf, flat) for leaf in stacked.inputs])
    want = jax.tree.leaves(jax.jit(step)(*args))
    assert len(got) == len(stacked.outputs)
    for leaf, g in zip(stacked.outputs, got):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(_stack(leaf, want), np.float32),
                                   rtol=1e-5, atol=1e-6, err_msg=leaf.name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_the_stacked_example_steps_compute_the_unrolled_ones(name):
    step, args = (llama if name == "llama" else gpt).make_train_step(TINY[name])
    _check_stacked(step, args)


@pytest.mark.slow
def test_a_sum_over_layers_outside_their_passes_is_refused_naming_it():
    # A global gradient norm sums every layer's gradients: no one layer's update, so
    # the stacked form is refused (and the search falls back to twins).
    def clipped(params, state, x):
        new, state, value = _momentum_step(params, state, x)
        norm = jnp.sqrt(sum(jnp.sum(p["w"] ** 2) for p in new["layers"]))
        return jax.tree.map(lambda p: p / norm, new), state, value

    params = {"layers": [{"w": jnp.ones((4, 4)), "b": jnp.zeros((4,))}] * 3, "scale": jnp.ones((4,))}
    args = (params, {"count": jnp.float32(0.0), "mom": params}, jnp.ones((2, 4)))
    with pytest.raises(PartitioningError, match=r"reads the values of layers \[0, 1\].*global gradient norm"):
        partir.stack_layers(partir.lift(clipped, *args))


def test_layers_whose_passes_differ_are_refused_as_a_stacking():
    # The passes are found with the helpers rolling uses: the refusal still speaks of
    # stacking (not of rolling, nor of a pipeline to leave out).
    def mixed(params, state, x):
        def loss(params):
            h = x * params["scale"]
            for i, p in enumerate(params["layers"]):
                h = (jnp.tanh if i == 1 else jnp.sin)(h @ p["w"] + p["b"])
            return jnp.mean(h ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), state, value

    params = {"layers": [{"w": jnp.ones((4, 4)), "b": jnp.zeros((4,))}] * 3, "scale": jnp.ones((4,))}
    with pytest.raises(PartitioningError, match=r"^cannot stack the unrolled layers: the layers' forward passes "
                                                r"differ.*\(scan_layers=True in the examples\)$"):
        partir.stack_layers(partir.lift(mixed, params, {}, jnp.ones((2, 4))))


def _deep():
    step, args = llama.make_train_step(DEEP, abstract=True)
    return partir.lift(step, *args)


def _search(prog, episodes=300):
    res = T.apply_schedule(prog, MESH, [search.AutomaticPartition(budget_s=600, max_episodes=episodes)])
    (result,) = res.context.search
    return res, result


def _tilings(res):
    part = res.partitioning
    return [part.tiling(v) for v in part.program.inputs]


@pytest.mark.slow
def test_a_deep_unrolled_llama_is_searched_on_its_stacked_form_to_the_twins_and_programs_plan(monkeypatch):
    prog = _deep()
    res, result = _search(prog)
    assert res.history[-1].notes[0].startswith("searched on the stacked form of the 9-layer program")
    assert result.twins is None and result.why == ""
    stacked = _tilings(res)
    one = search.AutomaticPartition._one_state
    monkeypatch.setattr(search.AutomaticPartition, "_one_state",
                        lambda self, *args, **kwargs: one(self, *args, **{**kwargs, "stacked": False}))
    res, result = _search(prog)
    assert result.twins is not None and _tilings(res) == stacked
    monkeypatch.setattr(search._auto, "twin_state", lambda *args, **kwargs: (None, "left out"))
    res, result = _search(prog)
    assert res.history[-1].notes[0] == "searched on the program itself (left out)" and _tilings(res) == stacked


@pytest.mark.slow
def test_same_seed_same_plan_through_the_stacked_form():
    prog = _deep()

    def plan():
        res, result = _search(prog, 100)
        assert res.history[-1].notes[0].startswith("searched on the stacked form")
        return [(d.action, d.value, d.dim, d.axis, d.axes) for d in res.partitioning.decisions]

    assert plan() == plan()


#: An input the test says the stacked form's plan splits otherwise than the program.
WHERE = "params['layers'][3]['mlp']['w_up']"


@pytest.mark.slow
def test_a_plan_the_program_splits_otherwise_than_its_stacks_is_searched_again_on_twins(monkeypatch):
    monkeypatch.setattr(StackedState, "mismatch", lambda self, part, actions: WHERE)
    _, result = _search(_deep(), 10)
    assert result.twins is not None
    assert result.why == f"the stacked form's plan splits {WHERE} otherwise than its stack"


@pytest.mark.slow
def test_the_plan_searched_on_the_stacked_form_computes_what_jax_jit_does():
    step, args = llama.make_train_step(DEEP)
    res, result = _search(partir.lift(step, *args), 100)
    assert res.history[-1].notes[0].startswith("searched on the stacked form")
    assert any(res.partitioning.tiling(v).axes() for v in res.program.inputs)  # (a plan that splits)
    partir.check_equivalence(step, args, res.partitioning, rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_under_gradient_accumulation_both_micro_batch_counts_are_searched_alike():
    # The step on one and on two micro-batches take the same actions: neither is stacked.
    part = partir.Partitioning(_deep(), MESH)
    state, _ = search.AutomaticPartition(grad_accum=4).search_space(part, T.Context())
    assert [type(s).__name__ for s in state.pair] == ["TwinState", "TwinState"]
