"""Uneven stages inside a pipelined layer scan's stage program (`partir.StageSplit`):
each stage runs ceil(L/S) layer slots, the first stages all of them with layers, the
others one padding slot last.

The stacked values stay whole along the stage axis in their own [L, ...] layout (an
array cannot be split unevenly over devices), so the stage program pads on the way in
and cuts on the way out: `stage_rows` takes the stage's layers with zeros for its
padding slot (no data moves: every stage holds them all), `slot_mask` says which slots
hold a layer (a padding slot passes its carry on and makes zeros), and `whole_rows`
puts every stage's rows back into the [L, ...] layout, one all-reduce over the stage
axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _first(split, s):
    """The first layer stage `s` (a traced index) runs (`StageSplit.first`)."""
    return s * (split.slots - 1) + jnp.minimum(s, split.fuller)


def slot_mask(axis: str, split):
    """[slots] booleans: which of this stage's slots hold a layer."""
    s = jax.lax.axis_index(axis)
    return jnp.arange(split.slots) < split.slots - (s >= split.fuller)


def _masked(rows, mask):
    return jnp.where(mask.reshape((-1,) + (1,) * (rows.ndim - 1)), rows, jnp.zeros_like(rows))


def stage_rows(a, axis: str, split):
    """This stage's `split.slots` layers of `a` ([L, ...], whole along `axis`), zeros in
    its padding slot."""
    padded = jnp.concatenate([a, jnp.zeros((split.slots,) + a.shape[1:], a.dtype)])
    rows = jax.lax.dynamic_slice_in_dim(padded, _first(split, jax.lax.axis_index(axis)), split.slots, 0)
    return _masked(rows, slot_mask(axis, split))


def whole_rows(y, axis: str, split):
    """Every stage's rows `y` ([slots, ...], this stage's layers) as the [L, ...] value,
    the same on every stage: each writes its layers into zeros, summed over `axis`."""
    padded = jnp.zeros((split.length + split.slots,) + y.shape[1:], y.dtype)
    mine = jax.lax.dynamic_update_slice_in_dim(padded, _masked(y, slot_mask(axis, split)),
                                               _first(split, jax.lax.axis_index(axis)), 0)
    return jax.lax.psum(mine[:split.length], axis)
