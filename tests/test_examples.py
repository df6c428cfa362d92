"""Tests of the built-in example train steps (examples/)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

from examples import REGISTRY, gpt, moe
from examples._common import stack_layers

NAMES = sorted(REGISTRY)


def primitive_names(jaxpr) -> set[str]:
    """Names of all primitives in ``jaxpr``, including nested (scan, remat, jit) bodies."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # ClosedJaxpr -> Jaxpr
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
                    names |= primitive_names(sub)
    return names


def run_steps(step, args, n):
    """Run ``n`` jitted train steps on the same batch; return the losses."""
    params, opt_state, batch = args
    jstep = jax.jit(step)
    losses = []
    for _ in range(n):
        params, opt_state, loss = jstep(params, opt_state, batch)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("name", NAMES)
def test_train_step_runs_and_loss_decreases(name):
    losses = run_steps(*REGISTRY[name](), n=3)
    assert np.all(np.isfinite(losses)), losses
    assert losses[0] > losses[1] > losses[2], losses


@pytest.mark.parametrize("name", NAMES)
def test_abstract_args_match_concrete(name):
    _, concrete = REGISTRY[name]()
    step, abstract = REGISTRY[name](abstract=True)
    assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
    for a, c in zip(jax.tree.leaves(abstract), jax.tree.leaves(concrete)):
        assert isinstance(a, jax.ShapeDtypeStruct)
        assert (a.shape, a.dtype) == (c.shape, c.dtype)
    # The step traces on abstract arguments alone and returns the same pytrees.
    out = jax.eval_shape(step, *abstract)
    assert jax.tree.structure(out[:2]) == jax.tree.structure(abstract[:2])
    assert out[2].shape == ()


@pytest.mark.parametrize("name", NAMES)
def test_params_have_readable_paths(name):
    _, (params, _, _) = REGISTRY[name](abstract=True)
    # An equinox module is a pytree of attributes (params.layers[0].weight) by design;
    # elsewhere only dict keys and list indices, no attribute keys such as nnx's '.value'.
    allowed = (jax.tree_util.DictKey, jax.tree_util.SequenceKey)
    if name == "equinox_mlp":
        allowed += (jax.tree_util.GetAttrKey,)
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        assert all(isinstance(k, allowed) for k in path)
        assert all(isinstance(k.key, str) for k in path if isinstance(k, jax.tree_util.DictKey))


def test_seed_is_deterministic():
    _, a = gpt.make_train_step(seed=3)
    _, b = gpt.make_train_step(seed=3)
    _, c = gpt.make_train_step(seed=4)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert not np.array_equal(a[0]["head"]["w"], c[0]["head"]["w"])


@functools.cache
def _grad_fn(config):
    # Cached per config so tests comparing against the default reuse one compile.
    return jax.jit(jax.value_and_grad(functools.partial(gpt.loss_fn, config=config)))


def _loss_and_grads(config, params, batch):
    return _grad_fn(config)(params, batch)


def _assert_close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_gpt_param_shapes():
    _, (params, _, batch) = gpt.make_train_step(abstract=True)
    c = gpt.GPTConfig()
    assert params["embed"]["tokens"].shape == (c.vocab, c.d_model)
    assert params["embed"]["positions"].shape == (c.seq_len, c.d_model)
    assert len(params["layers"]) == c.n_layers
    assert params["layers"][1]["attn"]["wq"].shape == (c.d_model, c.d_model)
    assert params["layers"][1]["mlp"]["w1"].shape == (c.d_model, c.d_ff)
    assert params["head"]["w"].shape == (c.d_model, c.vocab)
    assert batch["tokens"].dtype == jnp.int32 and batch["tokens"].shape == (c.batch, c.seq_len)

    _, (scanned, _, _) = gpt.make_train_step(gpt.GPTConfig(scan_layers=True), abstract=True)
    assert scanned["layers"]["mlp"]["w2"].shape == (c.n_layers, c.d_ff, c.d_model)


def test_gpt_scanned_matches_unrolled():
    _, (params, _, batch) = gpt.make_train_step()
    scan_config = gpt.GPTConfig(scan_layers=True)
    _, (scanned, _, _) = gpt.make_train_step(scan_config)
    stacked = dict(params, layers=stack_layers(params["layers"]))
    # Same seed, same weights: the scanned init is the stacked unrolled init.
    jax.tree.map(np.testing.assert_array_equal, stacked, scanned)
    loss_unrolled, grads = _loss_and_grads(gpt.GPTConfig(), params, batch)
    loss_scanned, grads_scanned = _loss_and_grads(scan_config, stacked, batch)
    np.testing.assert_allclose(loss_scanned, loss_unrolled, rtol=1e-5)
    grads_stacked = dict(grads, layers=stack_layers(grads["layers"]))
    jax.tree.map(_assert_close, grads_scanned, grads_stacked)


def test_gpt_remat_matches_plain():
    _, (params, _, batch) = gpt.make_train_step()
    loss, grads = _loss_and_grads(gpt.GPTConfig(), params, batch)
    loss_r, grads_r = _loss_and_grads(gpt.GPTConfig(remat=True), params, batch)
    np.testing.assert_allclose(loss_r, loss, rtol=1e-5)
    jax.tree.map(_assert_close, grads_r, grads)


def test_gpt_fused_qkv_matches_split():
    _, (params, _, batch) = gpt.make_train_step()
    fused_config = gpt.GPTConfig(fused_qkv=True)
    _, (fused, _, _) = gpt.make_train_step(fused_config)
    assert fused["layers"][0]["attn"]["wqkv"].shape == (64, 192)
    assert "wq" not in fused["layers"][0]["attn"]
    loss, _ = _loss_and_grads(gpt.GPTConfig(), params, batch)
    loss_f, _ = _loss_and_grads(fused_config, fused, batch)
    np.testing.assert_allclose(loss_f, loss, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, {"dot_general", "gather", "scatter-add"}),
        ({"scan_layers": True}, {"dot_general", "gather", "scan"}),
        ({"remat": True}, {"dot_general", "gather"}),
        ({"scan_layers": True, "remat": True}, {"scan"}),
    ],
)
def test_gpt_jaxpr_primitives(kwargs, expected):
    step, args = gpt.make_train_step(gpt.GPTConfig(**kwargs), abstract=True)
    names = primitive_names(jax.make_jaxpr(step)(*args))
    assert expected <= names, expected - names
    assert ("scan" in names) == kwargs.get("scan_layers", False)
    remat_names = {"remat2", "checkpoint", "remat"}
    assert bool(names & remat_names) == kwargs.get("remat", False)


def test_moe_routing_respects_capacity():
    config = moe.MoEConfig()
    _, (params, _, batch) = moe.make_train_step(config)
    h = jnp.tanh(batch["x"] @ params["input"]["w"] + params["input"]["b"])
    probs = jax.nn.softmax(h @ params["moe"][0]["router"], axis=-1)[0]  # one group
    dispatch, combine = moe.route(probs, config)
    t, e, c = config.group_size, config.n_experts, config.capacity
    assert dispatch.shape == combine.shape == (t, e, c)
    assert set(np.unique(dispatch)) <= {0.0, 1.0}
    assert np.all(dispatch.sum(axis=0) <= 1)  # each expert slot holds <= 1 token
    assert np.all(dispatch.sum(axis=(1, 2)) <= config.top_k)  # <= k slots per token
    assert np.all(combine.sum(axis=(1, 2)) <= 1 + 1e-6)  # renormalised gates
    assert dispatch.sum() > 0.75 * t * config.top_k  # most assignments fit
    step, args = moe.make_train_step(config, abstract=True)
    assert {"top_k", "cumsum", "dot_general"} <= primitive_names(jax.make_jaxpr(step)(*args))
