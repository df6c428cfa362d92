"""The oracle on every example: plain jit and the partitioned plan agree on outputs,
updated parameters and optimizer state (whose first moment is 0.1x the gradient)."""

import pytest

import partir
from examples import REGISTRY, gpt
from partir import MeshSpec

from examples.plans import data_parallel, fsdp, megatron

EPS = 1e-3  # Adam eps large enough that near-zero gradients cannot flip updates


def _example(name, **overrides):
    if name.startswith("gpt"):
        cfg = gpt.GPTConfig(adam_eps=EPS, scan_layers="scan" in name, remat="remat" in name)
        return gpt.make_train_step(cfg)
    make = REGISTRY[name]
    mod = __import__(f"examples.{name}", fromlist=["x"])
    cfg_cls = next(getattr(mod, a) for a in dir(mod) if a.endswith("Config"))
    return make(cfg_cls(adam_eps=EPS))


STRATEGIES = {
    "dp": (MeshSpec.of(data=8), lambda p, m: data_parallel(p, "data")),
    "megatron": (MeshSpec.of(model=8), lambda p, m: megatron(p, m, "model")),
    "fsdp": (MeshSpec.of(data=8), lambda p, m: fsdp(p, "data")),
    "dp+megatron": (MeshSpec.of(data=2, model=4), lambda p, m: (data_parallel(p, "data"), megatron(p, m, "model"))),
}
MODELS = ["mlp", "gpt", "gpt-scan", "gpt-remat", "convnet", "moe", "nnx_mlp"]
CASES = [(m, s) for m in MODELS for s in STRATEGIES if s != "dp+megatron" or m.startswith("gpt")]


# The scan and remat variants under DP and FSDP repeat what their DP + Megatron cases
# show about nested jaxprs, and each GPT form's DP and Megatron cases are the halves of
# its DP + Megatron case; the remat form's DP + Megatron is tests/test_remat.py's subject,
# the scanned one tests/test_megatron_corpus.py's (llama_scan), and FSDP on the GPT
# tests/test_pipeline.py's and tests/test_llama.py's.
# So do, in `make test-all`: the convnet and the MoE under DP alone and under Megatron (the
# convnet's FSDP case runs by default, the MoE's DP + Megatron in tests/test_shardmap.py, and
# the convnet's DP + Megatron against XLA in tests/test_cost.py and tests/test_shardmap.py);
# the MoE under FSDP, which the MLPs' FSDP cases hold; and GPT's DP + Megatron, whose program
# and mesh tests/test_tactics.py::test_dp_and_megatron_reduce_gradients_over_data_only runs
# by default (under the tactics' plan). And the MLP under DP, which
# tests/test_tactics.py::test_data_parallel_infers_the_batch_and_all_reduces_gradients runs on
# the same MLP and mesh (two steps, the tactic's plan); the nnx MLP under every strategy, whose
# MLP the plain MLP's cases hold, and its nnx pytrees tests/test_automap.py::test_pytree_kinds.
SLOW = {("mlp", "dp"), ("nnx_mlp", "dp"), ("nnx_mlp", "fsdp"), ("nnx_mlp", "megatron"),
        ("convnet", "dp"), ("moe", "dp"), ("gpt-scan", "dp"), ("gpt-scan", "fsdp"), ("gpt-remat", "dp"),
        ("gpt-remat", "fsdp"),
        ("gpt", "dp"), ("gpt", "megatron"), ("gpt-scan", "megatron"), ("gpt-remat", "megatron"),
        ("gpt-remat", "dp+megatron"), ("gpt-scan", "dp+megatron"), ("gpt", "fsdp"),
        ("convnet", "megatron"), ("moe", "megatron"), ("moe", "fsdp"), ("gpt", "dp+megatron")}


@pytest.mark.parametrize("model,strategy", [pytest.param(m, s, marks=pytest.mark.slow if (m, s) in SLOW else ())
                                            for m, s in CASES], ids=[f"{m}-{s}" for m, s in CASES])
def test_example_is_equivalent_under_strategy(model, strategy):
    step, args = _example(model)
    prog = partir.lift(step, *args)
    mesh, apply = STRATEGIES[strategy]
    part = partir.Partitioning(prog, mesh)
    apply(part, model.split("-")[0])
    split = [n for v, n in zip(prog.inputs, prog.input_names) if n.startswith("params") and not part.tiling(v).is_replicated]
    if strategy != "dp":
        assert split, "the strategy split no parameter"
    partir.check_equivalence(step, args, part, rtol=2e-5, atol=2e-6, steps=2)
