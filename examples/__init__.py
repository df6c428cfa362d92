"""Built-in example train steps used by the tests, the benchmarks and the demo.

Examples:

- ``mlp``: dense MLP regressor (``n_layers`` weight matrices), MSE loss.
- ``gpt``: GPT-style decoder-only transformer in plain ``jax.numpy``; options
  ``scan_layers`` (stacked layers under ``lax.scan``), ``remat`` (``jax.checkpoint``
  per layer) and ``fused_qkv``.
- ``llama``: Llama-style decoder (RMSNorm, rotary embeddings, grouped-query attention
  through ``jax.nn.dot_product_attention``, SwiGLU, 3-D attention kernels, float32
  master weights with ``dtype`` activations); options ``scan_layers``, ``remat`` with
  ``remat_policy``; Llama-3 8B/70B shaped configs ``LLAMA3_8B``/``LLAMA3_70B``.
- ``convnet``: NHWC convolutions, average and max pooling, dense classifier.
- ``moe``: mixture-of-experts feed-forward layers with top-k, capacity-based
  GShard/Switch dispatch; a Mixtral-8x7B shaped config ``MIXTRAL_8X7B``.
- ``nnx_mlp``: an ``flax.nnx`` MLP trained through ``nnx.split``/``nnx.merge``.
- ``linen_mlp``: a ``flax.linen`` MLP (its ``params`` collection is the pytree).
- ``equinox_mlp``: an ``equinox`` module MLP (the module is the pytree).

Contract shared by every example module:

- a frozen dataclass config with tiny defaults in which batch, hidden, head,
  vocabulary and expert dimensions divide by 8 (tests use 8 simulated devices),
  including ``learning_rate`` (1e-3) and ``adam_eps`` (1e-8);
- ``make_train_step(config=None, *, abstract=False, seed=0) -> (step, args)``:
  ``step(params, opt_state, batch) -> (new_params, new_opt_state, loss)`` is a plain,
  un-jitted function (forward + ``jax.value_and_grad`` + ``optax.adam`` update), and
  ``args = (params, opt_state, batch)`` are concrete arrays built deterministically
  from ``seed`` or, with ``abstract=True``, the same pytrees of
  ``jax.ShapeDtypeStruct`` (via ``jax.eval_shape``, nothing allocated);
- ``factory()``: ``make_train_step()`` with the defaults (e.g. ``examples/gpt.py:factory``);
- parameters are nested dicts with readable keys, e.g. ``params['layers'][1]['mlp']['w1']``.

``llama`` and ``moe`` also hold ``SCHEDULES``: expert schedules written with the
project's tactics (name -> function of the mesh axis names returning the tactics).
"""

from examples import convnet, gpt, llama, mlp, moe


def _nnx_mlp_make_train_step(*args, **kwargs):
    """``examples.nnx_mlp.make_train_step``, imported on first use.

    flax is an optional (test) dependency and slow to import, so the other examples
    do not pull it in.
    """
    from examples import nnx_mlp

    return nnx_mlp.make_train_step(*args, **kwargs)


def _linen_mlp_make_train_step(*args, **kwargs):
    """``examples.linen_mlp.make_train_step``, imported on first use (flax)."""
    from examples import linen_mlp

    return linen_mlp.make_train_step(*args, **kwargs)


def _equinox_mlp_make_train_step(*args, **kwargs):
    """``examples.equinox_mlp.make_train_step``, imported on first use (equinox)."""
    from examples import equinox_mlp

    return equinox_mlp.make_train_step(*args, **kwargs)


#: Example name -> its ``make_train_step``.
REGISTRY = {
    "mlp": mlp.make_train_step,
    "gpt": gpt.make_train_step,
    "llama": llama.make_train_step,
    "convnet": convnet.make_train_step,
    "moe": moe.make_train_step,
    "nnx_mlp": _nnx_mlp_make_train_step,
    "linen_mlp": _linen_mlp_make_train_step,
    "equinox_mlp": _equinox_mlp_make_train_step,
}

__all__ = ["REGISTRY", "convnet", "gpt", "llama", "mlp", "moe"]
