"""The MLP regressor as a ``flax.linen`` module: its ``params`` collection is the pytree
the train step (and automap) sees, e.g. ``params['params']['Dense_0']['kernel']``.

Batch: ``{'x': f32[batch, d_in], 'y': f32[batch, d_out]}``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from examples._common import RegressorConfig, build_train_step, normal


class MLP(nn.Module):
    """Dense, gelu, dense."""

    d_hidden: int
    d_out: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.d_out)(nn.gelu(nn.Dense(self.d_hidden)(x), approximate=True))


def _model(config: RegressorConfig) -> MLP:
    return MLP(config.d_hidden, config.d_out)


def loss_fn(params, batch, config: RegressorConfig) -> jax.Array:
    """Mean squared error of the module's predictions."""
    return jnp.mean((_model(config).apply(params, batch["x"]) - batch["y"]) ** 2)


def init(config: RegressorConfig, key: jax.Array):
    """``(params, batch)``: the module's variables and a random regression batch."""
    kp, kx, ky = jax.random.split(key, 3)
    x = normal(kx, (config.batch, config.d_in))
    params = _model(config).init(kp, x)
    return params, {"x": x, "y": normal(ky, (config.batch, config.d_out))}


def make_train_step(config: RegressorConfig | None = None, *, abstract: bool = False, seed: int = 0):
    """Return ``(step, (params, opt_state, batch))`` (see the examples package docs)."""
    return build_train_step(loss_fn, init, config or RegressorConfig(), abstract=abstract, seed=seed)


def factory():
    """``make_train_step()`` with the default config."""
    return make_train_step()
