"""The benchmarks' expert baseline (`examples.experts`): the schedules a practitioner
would write, built from the program and the mesh, each costed as the schedule alone
would cost, the skipped ones with why, and the best of them."""

import dataclasses

import pytest

import partir
import search
import tactics as T
from examples import experts, gpt, mlp, moe
from partir import MeshSpec

MESH = MeshSpec.of(data=2, model=4)


def _prog(make, config):
    step, args = make(config, abstract=True)
    return partir.lift(step, *args)


def _alone(prog, mesh, cand):
    """The candidate's schedule applied to a fresh partitioning and costed."""
    try:
        part = T.apply_schedule(prog, mesh, list(cand.schedule)).partitioning
    except partir.PartitioningError as e:
        return experts.Costed(cand.name, error=str(e).splitlines()[0])
    c = search.CostModel(part.copy(), "cpu").cost(top=0)
    return experts.Costed(cand.name, c.step_time, c.memory_peak, bool(c.fits))


# In `make test-slow` (4 s a case: every candidate costed twice); the default run costs
# the experts' candidates, none failing, in
# tests/test_context.py::test_the_experts_write_context_parallel_with_fsdp_and_tensor_parallelism.
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) for c in ("gpt", "moe")])
def test_each_candidate_costs_what_its_schedule_costs_alone(case):
    # Candidates share the partitionings of their common prefixes (and the tactics'
    # context: a SequenceParallel reads the blocks of the Megatron before it).
    prog, mesh = {"gpt": (_prog(gpt.make_train_step, gpt.GPTConfig(scan_layers=True)), MESH),
                  "moe": (_prog(moe.make_train_step, moe.MoEConfig(n_moe_layers=2)), MeshSpec.of(data=2, expert=4))}[case]
    costed = experts.cost_all(prog, mesh, device="cpu")
    assert costed == [_alone(prog, mesh, c) for c in experts.candidates(prog, mesh)]
    assert any(c.name.endswith("+sp(model)") and c.error is None for c in costed) or case == "moe"


def test_candidates_follow_the_model_and_the_mesh():
    names = {c.name for c in experts.candidates(_prog(gpt.make_train_step, gpt.GPTConfig()), MESH)}
    for base in ("dp(data,model)", "zero1(data,model)", "zero2(data,model)", "fsdp(data,model)", "dp(data)+fsdp(model)",
                 "dp(data)+tp(model)", "dp(data)+tp(model)+sp(model)", "zero2(data)+tp(model)+sp(model)",
                 "fsdp(data)+tp(model)", "tp(model)+fsdp(data)"):
        assert {base, base + "+remat(dots)", base + "+remat(full)"} <= names
    assert not any(n.startswith(("ep(", "experts(")) for n in names)  # no experts to split
    moe_names = {c.name for c in experts.candidates(_prog(moe.make_train_step, moe.MoEConfig()),
                                                    MeshSpec.of(data=2, expert=4))}
    assert {"ep(expert)+dp(data)", "ep(expert)+fsdp(data)", "experts(expert)+dp(data)",
            "experts(expert)+fsdp(data)"} <= moe_names
    # An axis of size 1 is no axis: one axis left carries everything.
    one = {c.name for c in experts.candidates(_prog(gpt.make_train_step, gpt.GPTConfig()), MeshSpec.of(data=1, model=8))}
    assert {"dp(model)", "fsdp(model)", "tp(model)", "tp(model)+sp(model)"} <= one


def test_candidates_that_do_not_apply_say_why():
    costed = experts.cost_all(_prog(mlp.make_train_step, mlp.MLPConfig()), MESH, device="cpu")
    by_name = {c.name: c for c in costed}
    remat = [c for c in costed if "+remat(" in c.name]
    assert remat and all(c.error is not None for c in remat)
    # Where the schedule before the remat applies, the remat is why it was skipped.
    applies = [c for c in remat if by_name[c.name.split("+remat(")[0]].error is None]
    assert applies and all("found no layers to rematerialize" in c.error for c in applies)
    assert "skipped (Remat(policy='dots'): found no layers" in "\n".join(experts.listing(costed))


def test_the_best_is_the_fastest_that_fits_else_the_smallest():
    fast_big = experts.Costed("a", 1.0, 90.0, False)
    slow_small = experts.Costed("b", 3.0, 10.0, True)
    mid = experts.Costed("c", 2.0, 20.0, True)
    skipped = experts.Costed("d", error="no block")
    assert experts.best([fast_big, slow_small, mid, skipped]) == mid
    assert experts.best([fast_big, dataclasses.replace(slow_small, fits=False), skipped]).name == "b"
    assert experts.best([skipped]) is None


@pytest.mark.slow
def test_ranked_on_another_form_the_best_is_costed_on_the_program():
    cfg = gpt.GPTConfig(n_layers=8)
    unrolled = _prog(gpt.make_train_step, cfg)
    scanned = _prog(gpt.make_train_step, dataclasses.replace(cfg, scan_layers=True))
    best, costed = experts.expert(unrolled, MESH, device="cpu", ranking=scanned)
    assert costed == experts.cost_all(scanned, MESH, device="cpu")
    by_name = {c.name: c for c in experts.candidates(unrolled, MESH)}
    assert best == _alone(unrolled, MESH, by_name[best.name])
    top = sorted((c for c in costed if c.error is None), key=lambda c: c.step_s)[:experts.EXACT_TRIES]
    assert best.name in {c.name for c in top}
