"""Uneven pipeline stages: L layers over S stages when S does not divide L. Each stage
runs ceil(L/S) layer slots, the last stages one layer fewer (a padding slot that
passes its carry on); the stacked values keep the user's [L, ...] layout. The step
computes what plain `jax.jit` computes (loss, updated parameters, Adam moments)."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

import partir
import tactics as T
from examples import gpt, llama
from partir import MeshSpec

EPS = 1e-3  # Adam eps large enough that near-zero gradients cannot flip updates
#: A GPT of 3 layers: 2 stages of 2 slots, the second holding one layer and a padding slot.
THREE = gpt.GPTConfig(n_layers=3, d_model=16, n_heads=2, d_ff=32, vocab=32, seq_len=8, batch=16, scan_layers=True,
                      adam_eps=EPS)
#: A Llama of 5 layers: 4 stages of 2 slots run 2, 1, 1 and 1 layers.
FIVE = llama.LlamaConfig(n_layers=5, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, vocab=32, seq_len=8, batch=16,
                         scan_layers=True, adam_eps=EPS)


@functools.cache
def _lifted(config):
    step, args = (llama if isinstance(config, llama.LlamaConfig) else gpt).make_train_step(config)
    return step, args, partir.lift(step, *args)


def _plan(config, mesh, others, microbatches=2):
    _, _, prog = _lifted(config)
    return T.apply_schedule(prog, mesh, others + [T.Pipeline("stage", microbatches=microbatches)]).partitioning


def _same_step(part, config, backend):
    step, args, prog = _lifted(config)
    ours = partir.lower(part, backend=backend)(*args)
    theirs = jax.jit(step)(*args)
    for name, a, b in zip(prog.output_names, jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)):
        assert np.shape(a) == np.shape(b), name
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6, err_msg=name)


def test_three_layers_over_two_stages_compute_what_jit_computes():
    part = _plan(THREE, MeshSpec.of(data=4, stage=2), [T.DataParallel("data")])
    _same_step(part, THREE, "shard_map")
