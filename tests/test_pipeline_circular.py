"""The circular pipeline schedule (`Pipeline(axis, microbatches=M, repeats=R)`): each
stage runs R non-contiguous chunks of the layers and a microbatch goes round the stages
R times. The step computes what plain `jax.jit` computes (loss, updated parameters,
Adam moments) in both lowerings; settings the schedule cannot run are refused before
any work."""

import dataclasses

import jax
import numpy as np
import pytest

import partir
import tactics as T
from examples import llama
from partir import MeshSpec
from test_pipeline import TINY, TINY_LLAMA, _gpt, _mesh

#: Deep enough for 4 stages of 2 repeats (8 chunks of one layer).
DEEP = dataclasses.replace(TINY, n_layers=8)
DEEP_LLAMA = dataclasses.replace(TINY_LLAMA, n_layers=8)


def _plan(stages: int, microbatches: int, repeats: int, config=TINY, others=None, mesh=None):
    """`others` (default: DataParallel over 'data'), then a circular Pipeline over 'stage'."""
    _, _, prog = _gpt(config)
    others = [T.DataParallel("data")] if others is None else others
    schedule = others + [T.Pipeline("stage", microbatches=microbatches, repeats=repeats)]
    return T.apply_schedule(prog, mesh or _mesh(stages), schedule).partitioning


def _same_step(part, config, backend):
    step, args, prog = _gpt(config)
    ours, theirs = partir.lower(part, backend=backend)(*args), jax.jit(step)(*args)
    for name, a, b in zip(prog.output_names, jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("backend", ["shard_map", "jit"])
def test_circular_gpt_computes_what_jit_computes(backend):
    _same_step(_plan(2, 2, 2), TINY, backend)


@pytest.mark.slow
@pytest.mark.parametrize("stages,microbatches,config,backend", [
    (2, 4, TINY, "shard_map"),  # more microbatches than stages: they wait at the first stage for their turn
    (4, 4, DEEP, "shard_map"),
    (4, 8, DEEP, "jit"),
])
def test_circular_gpt_computes_what_jit_computes_more(stages, microbatches, config, backend):
    _same_step(_plan(stages, microbatches, 2, config), config, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["shard_map", "jit"])
def test_circular_llama_composes_with_data_parallel_and_megatron(backend):
    mesh = MeshSpec.of(data=2, model=2, stage=2)
    part = _plan(2, 2, 2, TINY_LLAMA, [T.DataParallel("data"), T.Megatron("model")], mesh)
    _same_step(part, TINY_LLAMA, backend)


@pytest.mark.slow
def test_circular_llama_over_four_stages():
    _same_step(_plan(4, 4, 2, DEEP_LLAMA), DEEP_LLAMA, "shard_map")
