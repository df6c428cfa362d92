"""Shared plumbing for the example train steps.

Every example module supplies a loss function and a function that builds
``(params, batch)`` from its config and a PRNG key; :func:`build_train_step` turns
those into the ``(step, args)`` pair of the examples contract (see
``examples/__init__.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

Config = Any  # a frozen (hashable) dataclass with learning_rate and adam_eps
Params = Any
Batch = Any
LossFn = Callable[[Params, Batch, Config], jax.Array]
InitFn = Callable[[Config, jax.Array], tuple[Params, Batch]]


@dataclasses.dataclass(frozen=True)
class RegressorConfig:
    """Sizes and optimiser settings of the small MLP regressor that the flax linen, flax
    nnx and equinox examples each write in their library's own style."""

    batch: int = 8
    d_in: int = 16
    d_hidden: int = 32
    d_out: int = 8
    learning_rate: float = 1e-3
    adam_eps: float = 1e-8


def optimizer(config: Config) -> optax.GradientTransformation:
    """The examples' optimiser: ``optax.adam(config.learning_rate, eps=config.adam_eps)``."""
    return optax.adam(config.learning_rate, eps=config.adam_eps)


def _make_args(init_fn: InitFn, config: Config, key: jax.Array):
    # Run op by op, not jitted: XLA:CPU takes seconds to compile a whole model's random
    # generators as one program, once per config, where each op's small program is
    # compiled once per shape and then serves every config (measured: six example
    # configs 7.5 s jitted, 3.7 s op by op, the later ones in a fraction of a second).
    params, batch = init_fn(config, key)
    return params, optimizer(config).init(params), batch


def build_train_step(
    loss_fn: LossFn, init_fn: InitFn, config: Config, *, abstract: bool, seed: int
):
    """Return ``(step, (params, opt_state, batch))`` for an adam-trained loss.

    ``loss_fn(params, batch, config)`` and ``init_fn(config, key) -> (params, batch)``
    should be module-level functions (the init is cached by identity).

    ``step(params, opt_state, batch) -> (new_params, new_opt_state, loss)`` is a
    plain function: forward and backward via ``jax.value_and_grad`` followed by an
    ``optax.adam`` update, so its jaxpr holds the whole training iteration.

    With ``abstract=True`` the arguments are ``jax.ShapeDtypeStruct`` pytrees
    obtained with ``jax.eval_shape`` of the very same init; nothing is allocated.
    """
    opt = optimizer(config)
    loss = functools.partial(loss_fn, config=config)

    def step(params, opt_state, batch):
        loss_value, grads = jax.value_and_grad(loss)(params, batch)
        updates, new_opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt_state, loss_value

    def make_args():
        return _make_args(init_fn, config, jax.random.key(seed))

    return step, (jax.eval_shape(make_args) if abstract else make_args())


def build_master_weights_train_step(
    loss_fn: LossFn, init_fn: InitFn, config: Config, compute_dtype, *, abstract: bool, seed: int
):
    """Return ``(step, (params, opt_state, batch))`` for mixed-precision training the way
    Megatron-LM and NeMo run it: the parameters are ``compute_dtype`` copies, and the
    optimizer state ``{'master': float32 parameters, 'adam': optax.adam's state}``.

    ``step`` takes the gradients of the ``compute_dtype`` parameters, casts them to
    float32, updates the master copy with adam in float32 and casts it back for the new
    parameters. The cast back is written as a step from the old parameters by the
    difference to the rounded master, in float32: so the new parameters are computed
    from the old ones elementwise, as every optimizer update is, which is how a
    partitioner pairs a parameter with its updated value (`tactics`' roles, ZeRO-1
    keeping both whole). It gives the rounded master exactly: the difference of two
    bfloat16 values (8 significant bits) is exact in float32 unless their exponents are
    over 16 apart, and then the sum back is within half a float32 unit of the rounded
    master, which rounds to it. ``init_fn`` gives the float32 parameters.
    """
    opt = optimizer(config)
    loss = functools.partial(loss_fn, config=config)

    def step(params, opt_state, batch):
        loss_value, grads = jax.value_and_grad(loss)(params, batch)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, adam_state = opt.update(grads, opt_state["adam"], opt_state["master"])
        master = optax.apply_updates(opt_state["master"], updates)
        new_params = jax.tree.map(_step_to, params, master)
        return new_params, {"master": master, "adam": adam_state}, loss_value

    def make_args():
        master, batch = init_fn(config, jax.random.key(seed))
        params = jax.tree.map(lambda w: w.astype(compute_dtype), master)
        return params, {"master": master, "adam": optimizer(config).init(master)}, batch

    return step, (jax.eval_shape(make_args) if abstract else make_args())


def _step_to(param: jax.Array, master: jax.Array) -> jax.Array:
    """``master`` rounded to ``param``'s dtype, as ``param`` plus the difference in float32
    (see `build_master_weights_train_step`: exact, and elementwise in ``param``)."""
    old = param.astype(jnp.float32)
    return (old + (master.astype(param.dtype).astype(jnp.float32) - old)).astype(param.dtype)


def stack_layers(layers: list[Params]) -> Params:
    """Stack a list of per-layer pytrees into one pytree with a leading [L] axis (the
    parameters of a ``jax.lax.scan`` over layers)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def init_layers(init_layer: Callable[[jax.Array], Params], key: jax.Array, n: int, stacked: bool):
    """``n`` layers' parameters, ``init_layer`` of each of ``n`` keys split from ``key``:
    one pytree with a leading [n] axis (the parameters of a ``jax.lax.scan`` over layers)
    when ``stacked``, else a list of ``n``. Initialised as one vmapped layer (the values
    are those of ``n`` calls), so tracing it, as ``abstract=True`` does, costs one layer
    whatever the depth: an 80-layer model's was 0.3 s of its 0.7 s step build."""
    layers = jax.vmap(init_layer)(jax.random.split(key, n))
    return layers if stacked else [jax.tree.map(lambda x, i=i: x[i], layers) for i in range(n)]


def token_batch(key: jax.Array, batch: int, seq_len: int, vocab: int) -> dict:
    """Random token sequences ``{'tokens': i32[batch, seq_len], 'targets': ...}`` for a
    language model; the targets are the tokens shifted left by one."""
    seq = jax.random.randint(key, (batch, seq_len + 1), 0, vocab, jnp.int32)
    return {"tokens": seq[:, :-1], "targets": seq[:, 1:]}


def next_token_loss(logits: jax.Array, targets: jax.Array, *, one_hot: bool = False) -> jax.Array:
    """Mean cross-entropy of ``targets [B, S]`` under ``logits [B, S, V]``: each target's
    log-probability picked with ``take_along_axis`` (optax's and PyTorch's form: its
    backward scatters into zeros the size of the logits), or with ``one_hot`` summed
    against the one-hot targets (MaxText's ``cross_entropy_with_logits``: its backward
    is one elementwise pass over the logits, no scattered buffer)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    if one_hot:
        return -jnp.mean(jnp.sum(jax.nn.one_hot(targets, logits.shape[-1], dtype=logp.dtype) * logp, axis=-1))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Standard-normal float32 array of ``shape``.

    Drawn flat and reshaped: XLA:CPU compiles the threefry generator for a flat
    shape several times faster than for a 3-D/4-D one (about 0.2 s against 1.3 s
    each), which dominates the test suite's init time otherwise.
    """
    return jax.random.normal(key, (math.prod(shape),), jnp.float32).reshape(shape)


def dense_init(key: jax.Array, fan_in: int, shape: tuple[int, ...]) -> jax.Array:
    """Normal weights scaled by ``1/sqrt(fan_in)`` so activations stay O(1)."""
    return normal(key, shape) / math.sqrt(fan_in)
