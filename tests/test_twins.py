"""The search on deep models works on shallow twins: their extrapolated cost is the deep
program's, the plan they find applies to it, and where twins would not be faithful the
search says why and searches the program itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import partir
import search
import tactics as T
from examples import gpt
from examples.plans import STRATEGIES
from partir import MeshSpec
from search import _twins

CFG = dict(d_model=128, n_heads=4, d_ff=512, vocab=512, seq_len=32, batch=8, adam_eps=1e-3)
MESH = MeshSpec.of(data=2, model=4)


@pytest.fixture(autouse=True)
def _twins_not_stacked(monkeypatch):
    """The search tries a deep program's stacked form before its twins
    (`tests/test_stacked.py`); these tests are of the twins, so it is left out."""
    one = search.AutomaticPartition._one_state
    monkeypatch.setattr(search.AutomaticPartition, "_one_state",
                        lambda self, *args, **kwargs: one(self, *args, **{**kwargs, "stacked": False}))


def _gpt(layers):
    step, args = gpt.make_train_step(gpt.GPTConfig(n_layers=layers, **CFG), abstract=True)
    return step, args, partir.lift(step, *args)


def _searched(prog, schedule):
    """The schedule's result and its one search's result."""
    res = T.apply_schedule(prog, MESH, schedule)
    (result,) = res.context.search
    return res, result


def test_layer_sequences_are_found_and_cut_in_params_and_optimizer_state():
    _, (params, opt_state, batch), _ = _gpt(9)
    assert _twins.layer_counts([params, opt_state, batch]) == {9}
    cut = _twins.truncate((params, opt_state), 3)
    assert len(cut[0]["layers"]) == 3
    mu = cut[1][0].mu  # optax adam state: a named tuple whose mu/nu mirror the params
    assert len(mu["layers"]) == 3 and type(cut[1][0]) is type(opt_state[0])
    assert jax.tree.structure(cut[0]["layers"][2]) == jax.tree.structure(params["layers"][6])
    # Too few layers, or layers that differ, are not a sequence of alike layers.
    assert _twins.layer_counts(params["layers"][:7]) == set()
    odd = list(params["layers"])
    odd[3] = {"w": jax.ShapeDtypeStruct((2, 2), jnp.float32)}
    assert _twins.layer_counts(odd) == set()


# DP + Megatron in `make test-slow`: FSDP and a tile beside it take the twins through a
# macro and a single action by default.
@pytest.mark.parametrize("plan", ["none", pytest.param("dp+megatron", marks=pytest.mark.slow), "fsdp+tile"])
def test_extrapolated_cost_is_the_deep_programs_cost(plan):
    _, _, prog = _gpt(9)
    part = partir.Partitioning(prog, MESH)
    r = T.roles(prog)
    groups = search.input_groups(prog, r.params + r.batch)
    twins, why = _twins.twin_state(part, groups, MESH.names, model=lambda p: search.CostModel(p, "h100"),
                                   source="test", ctx=T.Context())
    assert why is None
    full = search.SearchState(part, search.CostModel(part, "h100"), groups, MESH.names, "test", T.Context())
    macro = {"dp": T.DataParallel("data"), "megatron": T.Megatron("model"), "fsdp": T.FSDP("data", leave_room=False)}
    actions = [search.Action.macro(macro[m]) for m in plan.split("+") if m in macro]
    if plan.endswith("tile"):
        actions.append(next(a for a in twins.actions() if a.axis == "model"))
    for a in actions:
        assert full.apply(a)
    assert twins.mismatch(part, actions) is None  # the twins split every input as the program does
    for a in actions:
        assert twins.apply(a)
    (t, peak), (tf, peakf) = twins.evaluate(), full.evaluate()
    np.testing.assert_allclose([t, peak, twins.compute_time()], [tf, peakf, full.compute_time()], rtol=1e-9)


def test_near_the_limit_twins_extrapolate_the_exact_peak():
    # Each twin alone is far under the limit; the extrapolated peak is what is near it,
    # so the exact peaks (XLA's buffer assignment emulated) must be the ones extrapolated:
    # the fast estimate's gap grows with the depth and would pass plans that do not fit.
    _, _, prog = _gpt(9)
    part = partir.Partitioning(prog, MESH)
    exact = search.CostModel(part.copy(), "h100").exact_peak()
    r = T.roles(prog)
    groups = search.input_groups(prog, r.params + r.batch)
    twins, _ = _twins.twin_state(part, groups, MESH.names,
                                 model=lambda p: search.CostModel(p, "h100", memory_limit=exact),
                                 source="test", ctx=T.Context())
    assert twins.evaluate()[1] == pytest.approx(exact, rel=1e-9)
    far, _ = _twins.twin_state(part, groups, MESH.names,
                               model=lambda p: search.CostModel(p, "h100", memory_limit=10 * exact),
                               source="test", ctx=T.Context())
    assert far.evaluate()[1] < exact  # far from the limit the fast (optimistic) peak is enough


def test_the_exact_baseline_walks_the_twins_to_the_programs_optimum():
    _, _, prog = _gpt(8)
    part = partir.Partitioning(prog, MESH)
    twins, macros = search.AutomaticPartition().search_space(part, T.Context())
    assert twins.depths is not None and macros
    r = T.roles(prog)
    groups = search.input_groups(prog, r.params + r.batch)
    full = search.SearchState(part, search.CostModel(part, "h100"), groups, MESH.names, "test", T.Context())
    on_twins = search.exhaustive(twins, max_depth=1, macros=macros)
    on_program = search.exhaustive(full, max_depth=1, macros=macros)
    assert on_twins.actions == on_program.actions and on_twins.states == on_program.states
    assert on_twins.step_time == pytest.approx(on_program.step_time, rel=1e-9)
    assert not part.decisions


# The plan's numbers against jax.jit (an 8-layer program to compile twice) in
# `make test-all`; the tilings it asserts are those of DP + Megatron, whose run is
# checked by default in tests/test_tactics.py::test_dp_and_megatron_reduce_gradients_over_data_only.
@pytest.mark.parametrize("run", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plan", "run"])
def test_search_through_twins_recovers_dp_plus_megatron_and_is_equivalent(run):
    # The config of the recovery tests in test_search.py, 8 layers deep.
    cfg = gpt.GPTConfig(n_layers=8, d_model=256, n_heads=8, d_ff=1024, vocab=1024, seq_len=64, batch=4, adam_eps=1e-3)
    step, args = gpt.make_train_step(cfg, abstract=not run)
    res, result = _searched(partir.lift(step, *args),
                            [search.AutomaticPartition(budget_s=600, max_episodes=300, device="cpu")])
    assert result.twins is not None and max(result.twins) < 8 and result.why == ""
    part = res.partitioning
    # Megatron over one axis in every layer (on the CPU cost model the two axes are
    # near ties), the batch split over the other, and no worse than the hand-written plan.
    (tp,) = {a for a in MESH.names if a in part.tiling("params['layers'][0]['mlp']['w1']").dims[1]}
    dp = next(a for a in MESH.names if a != tp)
    for i in range(8):
        p = f"params['layers'][{i}]"
        assert tp in part.tiling(f"{p}['mlp']['w1']").dims[1] and tp in part.tiling(f"{p}['mlp']['w2']").dims[0]
        assert tp in part.tiling(f"{p}['attn']['wq']").dims[1] and tp in part.tiling(f"{p}['attn']['wo']").dims[0]
    assert dp in part.tiling("batch['tokens']").dims[0]
    hand = partir.Partitioning(res.program, MESH)
    STRATEGIES["dp+megatron"](hand, "gpt", "data", "model")
    found = search.CostModel(part.copy(), "cpu").cost().step_time
    assert found <= search.CostModel(hand, "cpu").cost().step_time * (1 + 1e-9)
    if run:
        partir.check_equivalence(step, args, part, rtol=2e-5, atol=2e-6)


# (2 s: in `make test-slow`; the default run holds the twins' extrapolated cost, step time and
# peak, to the deep program's in test_extrapolated_cost_is_the_deep_programs_cost and
# test_near_the_limit_twins_extrapolate_the_exact_peak, a search through twins no worse than
# the hand plan on the deep program in test_search_through_twins_recovers_dp_plus_megatron_and_is_equivalent.)
@pytest.mark.slow
def test_the_search_on_twins_costs_what_the_search_on_the_program_costs():
    _, _, prog = _gpt(8)

    res, result = _searched(prog, [search.AutomaticPartition(budget_s=600, max_episodes=40)])
    assert result.twins is not None
    # The extrapolated step time of the plan is its cost on the deep program.
    # (The search scores memory with the model's fast estimate, `evaluate`.)
    step_time, peak = search.CostModel(res.partitioning.copy(), "h100").evaluate()
    assert step_time == pytest.approx(result.step_time, rel=1e-9)
    assert peak == pytest.approx(result.memory_peak, rel=1e-9)


def test_earlier_tactics_are_replayed_on_the_twins():
    _, _, prog = _gpt(8)
    res, result = _searched(prog, [T.DataParallel("data"),
                                   search.AutomaticPartition(axes=("model",), budget_s=600, max_episodes=30)])
    assert result.twins is not None
    assert res.partitioning.tiling("batch['tokens']").dims[0][0] == "data"  # DataParallel stays first


def test_twins_step_aside_when_layers_are_decided_apart():
    _, _, prog = _gpt(8)
    res, result = _searched(prog, [T.Shard("params/layers/3/mlp/w1", dim=1, axis="model"),
                                   search.AutomaticPartition(axes=("data",), budget_s=600, max_episodes=20)])
    assert result.twins is None and result.why.startswith("earlier decisions differ between layers")
    assert res.partitioning.tiling("params['layers'][3]['mlp']['w1']").dims[1] == ("model",)


def test_twins_step_aside_when_the_layer_count_is_not_the_list_length():
    n = 12

    def step(params, x):
        # Indexes a fixed number of layers: a twin with fewer layers cannot be traced.
        for i in range(n):
            x = jnp.tanh(x @ params["layers"][i])
        return jnp.sum(x)

    params = {"layers": [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * n}
    prog = partir.lift(jax.grad(step), params, jax.ShapeDtypeStruct((16, 64), jnp.float32))
    _, result = _searched(prog, [search.AutomaticPartition(budget_s=600, max_episodes=10)])
    assert result.twins is None and "IndexError" in result.why


def test_a_plan_the_program_does_not_follow_is_searched_again_on_the_program(monkeypatch):
    # Should the twins ever foresee a different plan than the program makes of their
    # actions, the search is redone on the program itself: never a plan no one costed.
    monkeypatch.setattr(_twins.TwinState, "mismatch", lambda self, part, actions: "params['embed']['tokens']")
    _, _, prog = _gpt(8)
    _, result = _searched(prog, [search.AutomaticPartition(budget_s=600, max_episodes=10)])
    assert result.twins is None
    assert result.why == "the twins' plan splits params['embed']['tokens'] differently in the program"


def test_twins_that_cannot_follow_each_other_send_the_search_to_the_program(monkeypatch):
    # One twin takes the other's actions only when a state is priced: should it refuse
    # one the other took, the twins do not stand for the program, and the search is
    # redone on the program itself, saying why.
    def twins_apart(*args, **kwargs):
        state, why = twin_state(*args, **kwargs)
        follower = state.twins[1 - _twins.LEAD]
        follow = follower.apply
        follower.apply = lambda a: a.kind != "macro" and follow(a)  # it refuses every macro
        return state, why

    twin_state = _twins.twin_state
    monkeypatch.setattr(search._auto, "twin_state", twins_apart)
    _, _, prog = _gpt(8)
    res, result = _searched(prog, [search.AutomaticPartition(budget_s=600, max_episodes=3)])
    assert result.twins is None and "twin cannot take DataParallel('data'), which the" in result.why
    assert res.history[-1].notes[0] == f"searched on the program itself ({result.why})"


def test_equinox_layers_in_a_module_field_get_twins():
    import equinox as eqx
    import optax

    class Deep(eqx.Module):
        layers: list

        def __call__(self, x):
            for layer in self.layers:
                x = jnp.tanh(layer(x))
            return x

    model = Deep([eqx.nn.Linear(64, 64, key=k) for k in jax.random.split(jax.random.PRNGKey(0), 12)])
    opt = optax.adam(1e-2, eps=1e-3)

    def step(model, opt_state, x):
        loss, grads = jax.value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        updates, opt_state = opt.update(grads, opt_state, model)
        return optax.apply_updates(model, updates), opt_state, loss

    args = (model, opt.init(model), jax.random.normal(jax.random.PRNGKey(1), (32, 64)))
    cut = _twins.truncate(args[:2], 3)
    assert len(cut[0].layers) == 3 and len(cut[1][0].mu.layers) == 3
    prog = partir.lift(step, *args)
    part = partir.Partitioning(prog, MESH)
    r = T.roles(prog)
    groups = search.input_groups(prog, r.params + r.batch)
    twins, why = _twins.twin_state(part, groups, MESH.names, model=lambda p: search.CostModel(p, "cpu"),
                                   source="test", ctx=T.Context())
    assert why is None and twins.layers == 12
    full = search.SearchState(part, search.CostModel(part, "cpu"), groups, MESH.names, "test", T.Context())
    dp = search.Action.macro(T.DataParallel("data"))
    assert twins.apply(dp) and full.apply(dp)
    np.testing.assert_allclose(twins.evaluate(), full.evaluate(), rtol=1e-9)


def test_same_seed_same_plan_through_twins():
    _, _, prog = _gpt(8)

    def plan():
        res, result = _searched(prog, [search.AutomaticPartition(budget_s=600, max_episodes=60, seed=3)])
        assert result.twins is not None
        return [(d.action, d.value, d.dim, d.axis, d.axes) for d in res.partitioning.decisions]

    assert plan() == plan()


def test_twins_extrapolate_time_terms_before_overlap():
    """A gather exposed behind the shallow twins' little compute is hidden behind the
    deep program's: the step is taken after extrapolating each term, not before."""
    from search.cost._achieved import TimeParts

    device = search.get_device("h100")
    # Per layer 1 ms of compute and 0.5 ms of overlappable comm, plus 3 ms of comm outside:
    # exposed at 2 and 3 layers, hidden at 32.
    def parts(layers):
        return TimeParts(compute=1e-3 * layers, exposed=0.0, windows=(1e-3 * layers,),
                         hidden=(0.5e-3 * layers + 3e-3,), parents=(None,))

    deep = parts(2).extrapolate(parts(3), (32 - 2) / (3 - 2))
    want = parts(32)
    np.testing.assert_allclose([deep.compute, *deep.windows, *deep.hidden],
                               [want.compute, *want.windows, *want.hidden])
    assert deep.step(device)[0] == pytest.approx(parts(32).step(device)[0])
    # The step is not affine in depth, so extrapolating it would be wrong here.
    line = parts(2).step(device)[0] + 30 * (parts(3).step(device)[0] - parts(2).step(device)[0])
    assert abs(line - parts(32).step(device)[0]) > 1e-4
