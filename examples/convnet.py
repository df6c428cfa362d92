"""A small NHWC convolutional classifier trained with softmax cross-entropy.

conv 3x3 (C -> c1) + gelu -> 2x2 average pool -> conv 3x3 (c1 -> c2) + gelu ->
2x2 max pool -> flatten -> dense classifier.

Parameters::

    conv1: {w [3, 3, C, c1] (HWIO), b [c1]}
    conv2: {w [3, 3, c1, c2], b [c2]}
    dense: {w [(H/4) * (W/4) * c2, n_classes], b [n_classes]}

Batch: ``{'images': f32[B, H, W, C], 'labels': i32[B]}``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from examples._common import build_train_step, dense_init, normal

_DIMS = ("NHWC", "HWIO", "NHWC")
_POOL = (1, 2, 2, 1)  # 2x2 window and stride over H and W only


@dataclasses.dataclass(frozen=True)
class ConvNetConfig:
    """Image/channel sizes and optimiser settings of the convnet example."""

    batch: int = 8
    height: int = 8
    width: int = 8
    in_channels: int = 4
    channels1: int = 8
    channels2: int = 16
    n_classes: int = 10
    second_pool: str = "max"  # "max" or "avg"
    learning_rate: float = 1e-3
    adam_eps: float = 1e-8

    def __post_init__(self):
        if self.height % 4 or self.width % 4:
            raise ValueError("height and width must be divisible by 4 (two 2x2 pools)")
        if self.second_pool not in ("max", "avg"):
            raise ValueError(f"second_pool={self.second_pool!r}: use 'max' or 'avg'")

    @property
    def flat_features(self) -> int:
        """Width of the flattened feature map fed to the classifier."""
        return (self.height // 4) * (self.width // 4) * self.channels2


def init_params(config: ConvNetConfig, key: jax.Array) -> dict:
    """Conv kernels scaled by 1/sqrt(3*3*C_in), dense by 1/sqrt(fan_in); zero biases."""
    k1, k2, k3 = jax.random.split(key, 3)
    c0, c1, c2 = config.in_channels, config.channels1, config.channels2
    return {
        "conv1": {"w": dense_init(k1, 9 * c0, (3, 3, c0, c1)), "b": jnp.zeros((c1,), jnp.float32)},
        "conv2": {"w": dense_init(k2, 9 * c1, (3, 3, c1, c2)), "b": jnp.zeros((c2,), jnp.float32)},
        "dense": {
            "w": dense_init(k3, config.flat_features, (config.flat_features, config.n_classes)),
            "b": jnp.zeros((config.n_classes,), jnp.float32),
        },
    }


def make_batch(config: ConvNetConfig, key: jax.Array) -> dict:
    """Random images and labels (one batch to overfit)."""
    ki, kl = jax.random.split(key)
    shape = (config.batch, config.height, config.width, config.in_channels)
    return {
        "images": normal(ki, shape),
        "labels": jax.random.randint(kl, (config.batch,), 0, config.n_classes, jnp.int32),
    }


def conv(p: dict, x: jax.Array) -> jax.Array:
    """3x3 stride-1 SAME convolution plus bias, NHWC/HWIO."""
    y = jax.lax.conv_general_dilated(x, p["w"], (1, 1), "SAME", dimension_numbers=_DIMS)
    return y + p["b"]


def avg_pool(x: jax.Array) -> jax.Array:
    """2x2 average pool (a windowed sum, which JAX lowers to reduce_window_sum)."""
    return jax.lax.reduce_window(x, 0.0, jax.lax.add, _POOL, _POOL, "VALID") / 4.0


def max_pool(x: jax.Array) -> jax.Array:
    """2x2 max pool (reduce_window_max)."""
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, _POOL, _POOL, "VALID")


def forward(params: dict, images: jax.Array, config: ConvNetConfig) -> jax.Array:
    """Class logits ``[B, n_classes]``."""
    x = avg_pool(jax.nn.gelu(conv(params["conv1"], images), approximate=True))
    pool = max_pool if config.second_pool == "max" else avg_pool
    x = pool(jax.nn.gelu(conv(params["conv2"], x), approximate=True))
    x = x.reshape(x.shape[0], -1)
    return x @ params["dense"]["w"] + params["dense"]["b"]


def loss_fn(params: dict, batch: dict, config: ConvNetConfig | None = None) -> jax.Array:
    """Mean softmax cross-entropy against integer labels."""
    logp = jax.nn.log_softmax(forward(params, batch["images"], config or ConvNetConfig()), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][:, None], axis=-1))


def init(config: ConvNetConfig, key: jax.Array) -> tuple[dict, dict]:
    """Deterministic ``(params, batch)`` from ``key``."""
    kp, kb = jax.random.split(key)
    return init_params(config, kp), make_batch(config, kb)


def make_train_step(config: ConvNetConfig | None = None, *, abstract: bool = False, seed: int = 0):
    """Return ``(step, (params, opt_state, batch))`` for the convnet (see package docs)."""
    return build_train_step(loss_fn, init, config or ConvNetConfig(), abstract=abstract, seed=seed)


def factory():
    """``make_train_step()`` with the default config."""
    return make_train_step()
