"""The MLP regressor written as a ``flax.nnx`` module, trained through a pure step.

The module is split once into a static ``GraphDef`` and its state; the state is
converted with ``nnx.to_pure_dict`` into plain nested dicts of arrays, so pytree
paths read ``params['linear1']['kernel']`` (an ``nnx.State`` would add a
``.value`` attribute key to every path). The loss rebuilds the module with
``nnx.merge(graphdef, params)``, which accepts the pure dict in flax 0.12.

Parameters: ``linear1: {kernel [d_in, d_hidden], bias [d_hidden]}``,
``linear2: {kernel [d_hidden, d_out], bias [d_out]}``.
Batch: ``{'x': f32[batch, d_in], 'y': f32[batch, d_out]}``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from examples._common import RegressorConfig, build_train_step, dense_init, normal


class MLP(nnx.Module):
    """Two ``nnx.Linear`` layers with a tanh-approximated gelu between them."""

    def __init__(self, config: RegressorConfig, *, rngs: nnx.Rngs):
        """Create the layers; ``nnx.Linear`` uses lecun-normal kernels, zero biases."""
        self.linear1 = nnx.Linear(config.d_in, config.d_hidden, rngs=rngs)
        self.linear2 = nnx.Linear(config.d_hidden, config.d_out, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Predictions ``[batch, d_out]``."""
        return self.linear2(jax.nn.gelu(self.linear1(x), approximate=True))


def make_batch(config: RegressorConfig, key: jax.Array) -> dict:
    """Random inputs and targets from a fixed smooth teacher."""
    kx, kt = jax.random.split(key)
    x = normal(kx, (config.batch, config.d_in))
    teacher = dense_init(kt, config.d_in, (config.d_in, config.d_out))
    return {"x": x, "y": jnp.tanh(x @ teacher)}


@functools.cache
def graphdef(config: RegressorConfig) -> nnx.GraphDef:
    """The module's static structure, taken from an abstract module (nothing allocated)."""
    return nnx.graphdef(nnx.eval_shape(lambda: MLP(config, rngs=nnx.Rngs(0))))


def loss_fn(params: dict, batch: dict, config: RegressorConfig) -> jax.Array:
    """MSE of the module rebuilt from the pure-dict ``params``."""
    model = nnx.merge(graphdef(config), params)
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def init(config: RegressorConfig, key: jax.Array) -> tuple[dict, dict]:
    """Deterministic ``(params, batch)``; ``params`` is the module's pure-dict state."""
    kp, kb = jax.random.split(key)
    model = MLP(config, rngs=nnx.Rngs(params=kp))
    return nnx.to_pure_dict(nnx.state(model)), make_batch(config, kb)


def make_train_step(config: RegressorConfig | None = None, *, abstract: bool = False, seed: int = 0):
    """Return ``(step, (params, opt_state, batch))``; ``params`` is the module's pure-dict state."""
    return build_train_step(loss_fn, init, config or RegressorConfig(), abstract=abstract, seed=seed)


def factory():
    """``make_train_step()`` with the default config."""
    return make_train_step()
