"""The MLP regressor as an ``equinox`` module. The module itself is the parameter
pytree (its arrays are the leaves; the activation is static), so paths read
``params.layers[0].weight``.

Batch: ``{'x': f32[batch, d_in], 'y': f32[batch, d_out]}``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from examples._common import RegressorConfig, build_train_step, normal


class MLP(eqx.Module):
    """Linear, gelu, linear."""

    layers: tuple

    def __init__(self, config: RegressorConfig, key):
        k1, k2 = jax.random.split(key)
        self.layers = (eqx.nn.Linear(config.d_in, config.d_hidden, key=k1),
                       eqx.nn.Linear(config.d_hidden, config.d_out, key=k2))

    def __call__(self, x):
        return self.layers[1](jax.nn.gelu(self.layers[0](x), approximate=True))


def loss_fn(params: MLP, batch, config: RegressorConfig) -> jax.Array:
    """Mean squared error, the module mapped over the batch."""
    return jnp.mean((jax.vmap(params)(batch["x"]) - batch["y"]) ** 2)


def init(config: RegressorConfig, key: jax.Array):
    """``(module, batch)``."""
    kp, kx, ky = jax.random.split(key, 3)
    return MLP(config, kp), {"x": normal(kx, (config.batch, config.d_in)),
                             "y": normal(ky, (config.batch, config.d_out))}


def make_train_step(config: RegressorConfig | None = None, *, abstract: bool = False, seed: int = 0):
    """Return ``(step, (module, opt_state, batch))`` (see the examples package docs)."""
    return build_train_step(loss_fn, init, config or RegressorConfig(), abstract=abstract, seed=seed)


def factory():
    """``make_train_step()`` with the default config."""
    return make_train_step()
