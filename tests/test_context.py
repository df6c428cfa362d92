"""Context parallelism (issue 25): attention found from the dataflow, the sequence split
over an axis through attention, the numbers of plain `jax.jit` kept (loss, gradients,
updated parameters) on the GPT and Llama examples, causal and not, composed with the
other tactics."""

from __future__ import annotations

import dataclasses

import pytest

import partir
import tactics
from examples import gpt, llama, mlp
from partir import MeshSpec

EPS = 1e-3  # Adam eps large enough that near-zero gradients cannot flip updates
MODELS = {"gpt": (gpt, gpt.GPTConfig(adam_eps=EPS)), "llama": (llama, llama.LlamaConfig(adam_eps=EPS))}
#: Tolerances of a plan against plain jit: float32 sums taken in another order.
RTOL, ATOL = 2e-5, 2e-6


def _step(model: str, **changes):
    module, config = MODELS[model]
    return module.make_train_step(dataclasses.replace(config, **changes))


def _abstract(model: str, **changes):
    module, config = MODELS[model]
    step, args = module.make_train_step(dataclasses.replace(config, **changes), abstract=True)
    return partir.lift(step, *args)


# -- attention from the dataflow -----------------------------------------------------------
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("causal", [True, False])
def test_attention_is_found_from_the_dataflow(model, causal):
    # GPT writes softmax attention by hand; Llama calls jax.nn.dot_product_attention.
    prog = _abstract(model, causal=causal)
    found = partir.attentions(prog)
    assert len(found) == 2  # one per layer, none in the backward pass
    classes = partir.dim_classes(prog)
    tokens = prog.inputs[prog.input_names.index("batch['tokens']")]
    seq = classes.label(tokens, 1)
    for a in found:
        assert a.masked == causal
        assert classes.label(a.query, a.query_dim) == classes.label(a.key, a.key_dim) == seq
        assert classes.label(a.value, a.value_dim) == seq
        assert prog.values[a.scores].shape[a.score_query_dim] == prog.values[a.scores].shape[a.score_key_dim] == 16
        assert prog.ops[a.combine].primitive == "dot_general"


def test_a_program_without_attention_has_none():
    step, args = mlp.make_train_step(abstract=True)
    prog = partir.lift(step, *args)
    assert partir.attentions(prog) == ()
    assert not partir.kernel_region(prog).score.any()


@pytest.mark.parametrize("causal", [True, False])
def test_the_fused_kernel_cost_reads_the_same_mask(causal):
    # The cost model's fused kernel skips the masked tiles of a causal attention only:
    # the max's gradient selects too, which is no mask.
    import search

    prog = _abstract("gpt", causal=causal, seq_len=512)
    part = tactics.apply_schedule(prog, MeshSpec.of(data=8), [tactics.DataParallel("data")]).partitioning
    region = search.CostModel(part, search.get_device("h100")).materialization.attention
    work = region.work[region.dots]
    assert work.size and ((work < 1).all() if causal else (work == 1).all())
