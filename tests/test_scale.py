"""One computation, one cost: a model written with `scan` over its layers and unrolled
gets the same modeled step time and peak memory, under the hand plans people write and
under the plan the search returns (abstract shapes).

What XLA really does differently for a scan the model keeps: a stacked residual is one
buffer, live until the backward loop ends, where an unrolled layer's residuals die after
its own backward. At the peak (the backward's first layer) that is at most part of one
layer's residuals more, a few percent at 8 layers."""

import dataclasses
import re

import jax.numpy as jnp
import pytest

import partir
import search
import tactics as T
from examples import gpt, llama
from partir import MeshSpec

MESH = MeshSpec.of(data=2, model=4)
GPT_SIZES = {
    "gpt-256": dict(n_layers=4, d_model=256, n_heads=8, d_ff=1024, vocab=1024, seq_len=256, batch=16),
    "gpt-1024": dict(n_layers=4, d_model=1024, n_heads=16, d_ff=4096, vocab=8192, seq_len=1024, batch=16),
}
#: A Llama shaped like the big ones (bf16 activations, grouped-query attention), small
#: enough to lift in a second.
LLAMA = llama.LlamaConfig(n_layers=8, d_model=1024, n_heads=16, n_kv_heads=4, d_ff=2816, vocab=8192, seq_len=1024,
                          batch=16, dtype=jnp.bfloat16)
HAND = {
    "dp+tp": lambda: [T.DataParallel("data"), T.Megatron("model")],
    "fsdp": lambda: [T.FSDP("data"), T.FSDP("model", leave_room=False)],
    "dp+tp+sp+zero3": lambda: [T.DataParallel("data"), T.Megatron("model"), T.SequenceParallel("model"),
                               T.ZeRO("data")],
}
#: How far apart the two forms may cost (step time and peak memory).
TOLERANCE = 0.05


def _programs(make, config):
    """The (unrolled, scanned) programs of `config`."""
    out = []
    for scan in (False, True):
        step, args = make(dataclasses.replace(config, scan_layers=scan), abstract=True)
        out.append(partir.lift(step, *args))
    return tuple(out)


def _cost(part):
    c = search.CostModel(part.copy(), "h100").cost()
    return c.step_time, c.memory_peak


def _close(a, b):
    assert a[0] == pytest.approx(b[0], rel=TOLERANCE), ("step time", a[0], b[0])
    assert a[1] == pytest.approx(b[1], rel=TOLERANCE), ("peak memory", a[1], b[1])


def _stacked_name(name: str) -> str:
    """The scan form's name of an unrolled input: the layer index goes."""
    return re.sub(r"(\['layers'\])\[\d+\]", r"\1", name)


def _as_scanned(unrolled: partir.Partitioning, scanned_prog) -> partir.Partitioning:
    """The unrolled plan's decisions (on inputs) replayed on the scan form, each layer's
    onto the stacked input (its dims shifted past the layer dim)."""
    part = partir.Partitioning(scanned_prog, unrolled.mesh)
    for d in unrolled.decisions:
        w = scanned_prog.resolve(_stacked_name(unrolled.program.name(d.value)))
        if d.action != "tile":
            part.redo(d, w)
            continue
        dim = d.dim + scanned_prog.values[w].rank - unrolled.program.values[d.value].rank
        if d.axis not in part.tiling(w).dims[dim]:
            part.tile(w, dim, d.axis)
    return part


@pytest.fixture(scope="module", params=sorted(GPT_SIZES) + ["llama"])
def forms(request):
    if request.param == "llama":
        return _programs(llama.make_train_step, LLAMA)
    return _programs(gpt.make_train_step, gpt.GPTConfig(**GPT_SIZES[request.param]))


@pytest.mark.parametrize("plan", sorted(HAND))
def test_scan_and_unrolled_cost_the_same_under_hand_plans(forms, plan):
    unrolled, scanned = forms
    costs = [_cost(T.apply_schedule(p, MESH, HAND[plan]()).partitioning) for p in forms]
    _close(*costs)


# The small GPT in `make test-slow` (2 s of search): by default the wide GPT and Llama.
@pytest.mark.parametrize("forms", [pytest.param("gpt-256", marks=pytest.mark.slow), "gpt-1024", "llama"],
                         indirect=True)
def test_scan_and_unrolled_cost_the_same_under_the_searched_plan(forms):
    unrolled, scanned = forms
    auto = search.AutomaticPartition(budget_s=600, max_episodes=150, device="h100")
    plan = T.apply_schedule(unrolled, MESH, [auto]).partitioning
    _close(_cost(plan), _cost(_as_scanned(plan, scanned)))


@pytest.mark.slow  # (5 s: two deep programs costed)
def test_the_layer_inputs_of_a_deep_unrolled_model_are_buffers_as_a_scans_carry():
    # Llama-3-70B's shapes, 24 layers, on 1024 devices under MaxText's FSDP + TP with
    # `dots` remat: each unrolled layer's input is a buffer, as the scan's carry is (fused
    # into its readers, it kept both summands of every residual add alive; at all 80
    # layers that was 55 GiB against the scan's 43).
    mesh = MeshSpec.of(data=16, fsdp=8, model=8)
    schedule = llama.fsdp_tp("fsdp", "model", "data") + [T.Remat("dots")]
    config = dataclasses.replace(llama.LLAMA3_70B, n_layers=24, remat=False)
    costs = [_cost(T.apply_schedule(p, mesh, schedule).partitioning)
             for p in _programs(llama.make_train_step, config)]
    _close(*costs)


def test_a_recomputed_residual_keeps_no_stack_between_the_loops():
    # Llama-3-8B's shapes, 4 layers, Megatron's recipe with `dots` remat: the attention
    # probabilities are recomputed in the backward loop, so the forward loop stacks none
    # (2 GiB a device here): what the backward loop fuses into their readers is
    # re-derived from the recomputed copy, as in line, so a scan's peak stays the
    # unrolled one's.
    schedule = llama.dp_tp_sp_zero3("data", "model") + [T.Remat("dots")]
    config = dataclasses.replace(llama.LLAMA3_8B, n_layers=4, remat=False)
    costs = [_cost(T.apply_schedule(p, MeshSpec.of(data=8, model=8), schedule).partitioning)
             for p in _programs(llama.make_train_step, config)]
    _close(*costs)
