"""The circular schedule's layout inside a pipelined layer scan's stage program: the
stage's block of a stacked value, laid out at rest as contiguous layers, exchanged for
the chunks the circular schedule runs on it, and back.

With S stages and R repeats the L layers are S*R chunks of L/(S*R); at rest device s
holds chunks s*R .. s*R+R-1 (a contiguous block of the layer dim over the stage axis,
as every other plan keeps it), the circular schedule runs chunk c on stage c mod S, so
device s needs chunks s, s+S, ..., s+(R-1)*S (its "slots" k = 0..R-1). `to_slots` makes
that exchange with one all-to-all over the stage axis, `from_slots` undoes it: a piece
per destination device, each of P = ceil(R/S) chunks (padded where fewer go to it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pieces(stages: int, repeats: int) -> int:
    """Chunks per destination in one exchange: ceil(R/S)."""
    return -(-repeats // stages)


def _exchange(a, axis: str, stages: int, repeats: int, send, recv):
    """`a` ([R*Lg, ...], R chunks) exchanged over `axis`: piece (d, j) sent to device d
    holds local chunk `send(me, d, j)`; received chunk i is piece `recv(me, i)` =
    (sender, j) of what arrived."""
    per = pieces(stages, repeats)
    me = jax.lax.axis_index(axis)
    chunks = a.reshape((repeats, a.shape[0] // repeats) + a.shape[1:])
    d, j = jnp.meshgrid(jnp.arange(stages), jnp.arange(per), indexing="ij")
    packed = jnp.take(chunks, jnp.clip(send(me, d, j), 0, repeats - 1), axis=0)  # [S, P, Lg, ...]
    got = jax.lax.all_to_all(packed, axis, 0, 0, tiled=True)
    sender, slot = recv(me, jnp.arange(repeats))
    flat = got.reshape((stages * per,) + got.shape[2:])
    return jnp.take(flat, sender * per + slot, axis=0).reshape(a.shape)


def to_slots(a, axis: str, stages: int, repeats: int):
    """Device s's contiguous block of a stacked value (chunks s*R + r) as its slots
    (chunks k*S + s, k = 0..R-1), the circular schedule's order."""
    def send(s, d, j):  # local chunk r goes to device (s*R + r) mod S, piece j = r // S
        return (d - s * repeats) % stages + j * stages

    def recv(q, k):  # slot k is chunk c = k*S + q, local chunk c mod R of device c // R
        c = k * stages + q
        return c // repeats, (c % repeats) // stages

    return _exchange(a, axis, stages, repeats, send, recv)


def from_slots(a, axis: str, stages: int, repeats: int):
    """The inverse of `to_slots`: device q's slots (chunks k*S + q) as its contiguous
    block of the layer dim (chunks q*R + r)."""
    def send(q, o, j):  # to device o: its local chunk r = ((q - o*R) mod S) + j*S, i.e. chunk o*R + r
        return (o * repeats + (q - o * repeats) % stages + j * stages) // stages

    def recv(s, r):  # local chunk r is chunk s*R + r, slot of device (s*R + r) mod S
        return (s * repeats + r) % stages, r // stages

    return _exchange(a, axis, stages, repeats, send, recv)
