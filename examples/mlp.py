"""A small multi-layer perceptron regressor trained with MSE and adam.

``params = {'w1': [d_in, d_hidden], 'b1': [d_hidden], ..., 'wN': [d_hidden, d_out],
'bN': [d_out]}`` with ``N = config.n_layers`` weight matrices (default 2).
Batch: ``{'x': f32[batch, d_in], 'y': f32[batch, d_out]}``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from examples._common import build_train_step, dense_init, normal


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Sizes and optimiser settings of the MLP example (tiny, 8-divisible)."""

    batch: int = 8
    d_in: int = 16
    d_hidden: int = 32
    d_out: int = 8
    n_layers: int = 2  # number of weight matrices, >= 2
    learning_rate: float = 1e-3
    adam_eps: float = 1e-8

    def __post_init__(self):
        if self.n_layers < 2:
            raise ValueError(f"n_layers must be >= 2, got {self.n_layers}")

    @property
    def widths(self) -> list[int]:
        """Feature widths from input to output, ``n_layers + 1`` entries."""
        return [self.d_in] + [self.d_hidden] * (self.n_layers - 1) + [self.d_out]


def init_params(config: MLPConfig, key: jax.Array) -> dict:
    """Weights ``w{i}`` scaled by 1/sqrt(fan_in); biases ``b{i}`` zero."""
    widths = config.widths
    keys = jax.random.split(key, config.n_layers)
    params = {}
    for i, (k, fan_in, fan_out) in enumerate(zip(keys, widths[:-1], widths[1:]), 1):
        params[f"w{i}"] = dense_init(k, fan_in, (fan_in, fan_out))
        params[f"b{i}"] = jnp.zeros((fan_out,), jnp.float32)
    return params


def make_batch(config: MLPConfig, key: jax.Array) -> dict:
    """Random inputs and targets from a fixed smooth 'teacher' so there is signal."""
    kx, kt = jax.random.split(key)
    x = normal(kx, (config.batch, config.d_in))
    teacher = dense_init(kt, config.d_in, (config.d_in, config.d_out))
    return {"x": x, "y": jnp.tanh(x @ teacher)}


def forward(params: dict, x: jax.Array, config: MLPConfig) -> jax.Array:
    """Dense layers with gelu between them (none after the last)."""
    h = x
    for i in range(1, config.n_layers + 1):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < config.n_layers:
            h = jax.nn.gelu(h, approximate=True)
    return h


def loss_fn(params: dict, batch: dict, config: MLPConfig) -> jax.Array:
    """Mean squared error of the prediction against ``batch['y']``."""
    return jnp.mean((forward(params, batch["x"], config) - batch["y"]) ** 2)


def init(config: MLPConfig, key: jax.Array) -> tuple[dict, dict]:
    """Deterministic ``(params, batch)`` from ``key``."""
    kp, kb = jax.random.split(key)
    return init_params(config, kp), make_batch(config, kb)


def make_train_step(config: MLPConfig | None = None, *, abstract: bool = False, seed: int = 0):
    """Return ``(step, (params, opt_state, batch))`` for the MLP (see package docs)."""
    return build_train_step(loss_fn, init, config or MLPConfig(), abstract=abstract, seed=seed)


def factory():
    """``make_train_step()`` with the default config."""
    return make_train_step()
