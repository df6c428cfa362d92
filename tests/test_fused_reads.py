"""A fusion reads the buffers its fused producers are re-derived from: the time the cost
model gives a memory-bound reader of a chain of cheap ops (`CostModel._moved`)."""

import jax
import jax.numpy as jnp
import pytest

import partir
import search
from partir import MeshSpec

N = 1 << 24  # 64 MiB of float32: the reads, not the op overheads, set the time


def _reader_seconds(fn, split: bool) -> float:
    """Modeled seconds of `fn` on an H100, its argument whole or `split` over 8 devices."""
    x = jax.ShapeDtypeStruct((N,), jnp.float32)
    part = partir.Partitioning(partir.lift(fn, x), MeshSpec.of(data=8))
    if split:
        part.tile(part.program.inputs[0], 0, "data")
    return search.CostModel(part, "h100").cost().compute_time


@pytest.mark.parametrize("split", [False, True])
def test_a_reduction_of_a_fused_chain_reads_the_chains_input(split):
    # abs and the multiply fuse into the reduction (no buffer of their own): the fusion
    # reads x once, as the reduction of x itself does, and writes a scalar.
    chain = _reader_seconds(lambda x: jnp.max(jnp.abs(x) * 2.0), split)
    plain = _reader_seconds(lambda x: jnp.max(x), split)
    per_device = N * 4 / (8 if split else 1)
    assert chain == pytest.approx(plain, rel=0.01)
    assert chain >= per_device / search.get_device("h100").hbm_bandwidth
