"""Uneven stages inside a pipelined layer scan's stage program (`partir.StageSplit`):
each stage runs ceil(L/S) layer slots, the first stages all of them with layers, the
others one padding slot last (under the circular schedule, R chunks of ceil(L/(S*R))
slots, in the order the stage runs them: `StageSplit.positions`).

The stacked values keep their own [L, ...] layout (an array cannot be split unevenly
over devices), so the stage program pads on the way in and cuts on the way out, and
`slot_mask` says which slots hold a layer (a padding slot passes its carry on and makes
zeros). A value split over the stage axis along another dim at rest (the layers'
parameters, gradients and optimizer state: `partir.state_dim`) is exchanged, one
all-to-all over the stage axis each way: `to_stage_rows` sends each stage the rows of
its layers (zeros for its padding slot) and gathers its own whole along that dim,
`from_stage_rows` does the reverse and drops the padding rows. A value whole along the
stage axis: `stage_rows` takes the stage's layers (no data moves: every stage holds
them all), `whole_rows` puts every stage's rows back, one all-reduce over the axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _table(split):
    """[S, slots] layer of each stage's slot (`StageSplit.positions`; L: padding)."""
    return jnp.asarray(split.positions())


def slot_mask(axis: str, split):
    """[slots] booleans: which of this stage's slots hold a layer."""
    return _table(split)[jax.lax.axis_index(axis)] < split.length


def _masked(rows, mask):
    return jnp.where(mask.reshape((-1,) + (1,) * (rows.ndim - 1)), rows, jnp.zeros_like(rows))


def stage_rows(a, axis: str, split):
    """This stage's `split.slots` layers of `a` ([L, ...], whole along `axis`), in slot
    order, zeros in its padding slots."""
    padded = jnp.concatenate([a, jnp.zeros((1,) + a.shape[1:], a.dtype)])
    return jnp.take(padded, _table(split)[jax.lax.axis_index(axis)], axis=0)


def whole_rows(y, axis: str, split):
    """Every stage's rows `y` ([slots, ...], this stage's layers in slot order) as the
    [L, ...] value, the same on every stage: each writes its layers into zeros (its
    padding slots into a row dropped after), summed over `axis`."""
    padded = jnp.zeros((split.length + 1,) + y.shape[1:], y.dtype)
    mine = padded.at[_table(split)[jax.lax.axis_index(axis)]].set(y)
    return jax.lax.psum(mine[:split.length], axis)


def _positions(split) -> np.ndarray:
    """[S * slots]: the layer each stage's slot holds, stage-major; L for a padding slot."""
    return split.positions().reshape(-1)


def to_stage_rows(a, axis: str, split, dim: int):
    """This stage's `split.slots` layers of `a` ([L, ...] split over `axis` along `dim`,
    `axis` its minor axis there), whole along `axis` on `dim`, zeros in its padding slot."""
    padded = jnp.concatenate([a, jnp.zeros((1,) + a.shape[1:], a.dtype)])
    rows = jnp.take(padded, jnp.asarray(_positions(split)), axis=0)  # [S * slots, ...]: each stage's rows
    return jax.lax.all_to_all(rows, axis, 0, dim, tiled=True)


def from_stage_rows(y, axis: str, split, dim: int):
    """The inverse of `to_stage_rows`: every stage's rows `y` ([slots, ...], whole along
    `axis` on `dim`) as the [L, ...] value split over `axis` along `dim`."""
    got = jax.lax.all_to_all(y, axis, dim, 0, tiled=True)  # [S * slots, ...]: stage-major
    where = np.argsort(_positions(split), kind="stable")[:split.length]  # each layer's slot
    return jnp.take(got, jnp.asarray(where), axis=0)
