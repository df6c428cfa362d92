"""The user API: `automap.jit` (equivalence, caching in memory and on disk, re-planning),
`automap.partition` and `Plan`, saving and loading plans."""

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import automap
import partir
import search
import tactics as T
from examples import REGISTRY, gpt

EPS = 1e-3
SMALL = gpt.GPTConfig(n_layers=2, adam_eps=EPS)


def _steps(fn, args, n):
    out = []
    state = tuple(args)
    for _ in range(n):
        params, opt_state, loss = fn(*state)
        out.append((params, opt_state, loss))
        state = (params, opt_state, state[2])
    return out


def test_jit_matches_jax_jit_over_steps_and_plans_once(tmp_path):
    step, args = gpt.make_train_step(SMALL)
    fn = automap.jit(step, mesh="data=2,model=4", device="cpu", budget_s=3, cache_dir=tmp_path)
    got, ref = _steps(fn, args, 3), _steps(jax.jit(step), args, 3)
    for (p, s, loss), (rp, rs, rloss) in zip(got, ref):
        np.testing.assert_allclose(float(loss), float(rloss), rtol=2e-5)
        for a, b in zip(jax.tree_util.tree_leaves((p, s)), jax.tree_util.tree_leaves((rp, rs))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    assert fn.stats == {"planned": 1, "memory_hits": 2, "disk_hits": 0}
    plan = next(iter(fn.plans.values()))
    # Outputs come back with the plan's shardings, ready for the next step.
    w1 = got[-1][0]["layers"][0]["mlp"]["w1"]
    assert w1.sharding == plan.out_shardings[0]["layers"][0]["mlp"]["w1"]
    assert len(list(tmp_path.glob("*.json"))) == 1


RESTART = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import automap
    from examples import gpt
    step, args = gpt.make_train_step(gpt.GPTConfig(n_layers=2, adam_eps=1e-3))
    fn = automap.jit(step, mesh=sys.argv[2], device="cpu", budget_s=3, cache_dir=sys.argv[1])
    loss = fn(*args)[2]
    print(json.dumps({"stats": fn.stats, "loss": float(loss)}))
""")


def _run_restart(tmp_path, mesh):
    script = tmp_path / "restart.py"
    script.write_text(RESTART)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "cache"), mesh], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


# Three fresh processes (about 16 s); `test_replan_forces_a_new_search` shows the disk
# hit in-process. In `make test-all`.
@pytest.mark.slow
def test_restarted_job_finds_its_plan_on_disk_and_a_new_mesh_replans(tmp_path):
    first = _run_restart(tmp_path, "data=2,model=4")
    assert first["stats"]["planned"] == 1
    second = _run_restart(tmp_path, "data=2,model=4")  # a new process: a restarted job
    assert second["stats"] == {"planned": 0, "memory_hits": 0, "disk_hits": 1}
    assert second["loss"] == pytest.approx(first["loss"], rel=1e-6)
    other = _run_restart(tmp_path, "data=4,model=2")
    assert other["stats"]["planned"] == 1 and other["stats"]["disk_hits"] == 0
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2


def test_replan_forces_a_new_search(tmp_path):
    step, args = gpt.make_train_step(SMALL, abstract=True)
    schedule = [T.DataParallel("data"), T.Megatron("model")]
    automap.jit(step, mesh="data=2,model=4", schedule=schedule, cache_dir=tmp_path).plan_for(*args)
    again = automap.jit(step, mesh="data=2,model=4", schedule=schedule, cache_dir=tmp_path)
    again.plan_for(*args)
    forced = automap.jit(step, mesh="data=2,model=4", schedule=schedule, cache_dir=tmp_path, replan=True)
    forced.plan_for(*args)
    assert again.stats["disk_hits"] == 1 and forced.stats["planned"] == 1


def test_the_cache_key_holds_every_setting_of_the_schedule(tmp_path):
    step, args = gpt.make_train_step(SMALL, abstract=True)

    def stats(**settings):
        auto = search.AutomaticPartition(budget_s=600, max_episodes=5, device="cpu", **settings)
        fn = automap.jit(step, mesh="data=2,model=4", schedule=[auto], cache_dir=tmp_path)
        fn.plan_for(*args)
        return fn.stats

    assert stats()["planned"] == 1
    assert stats(progress=lambda *a: None)["disk_hits"] == 1  # a callback is no setting
    # Settings that str(tactic) does not show make another plan.
    assert str(search.AutomaticPartition(memory_limit=1e9)) == str(search.AutomaticPartition())
    assert stats(memory_limit=1e9)["planned"] == 1
    assert stats(group=False)["planned"] == 1
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_grad_accum_is_priced_by_the_search_a_schedule_leaves_it_to():
    step, args = gpt.make_train_step(SMALL, abstract=True)
    auto = search.AutomaticPartition(budget_s=600, max_episodes=5, device="cpu")
    plan = automap.partition(step, mesh="data=2,model=4", schedule=[auto], grad_accum=4)(*args)
    notes = [n for s in plan.history for n in s.notes]
    assert any("priced over 4 micro-batches a step" in n for n in notes), notes


def test_a_search_in_the_schedule_prices_the_plans_device_and_limit():
    # Given to automap alone, the device and the limit reach a search that left them
    # open; one the search names itself stays its own.
    step, args = gpt.make_train_step(SMALL, abstract=True)
    kw = dict(budget_s=600, max_episodes=5)
    plan = automap.partition(step, mesh="data=2,model=4", device="cpu", memory_limit=1e9,
                             schedule=[search.AutomaticPartition(**kw)])(*args)
    assert (plan.history[0].tactic.device, plan.history[0].tactic.memory_limit) == ("cpu", 1e9)
    own = automap.partition(step, mesh="data=2,model=4", device="cpu", memory_limit=1e9,
                            schedule=[search.AutomaticPartition(device="h100", memory_limit=2e9, **kw)])(*args)
    assert (own.history[0].tactic.device, own.history[0].tactic.memory_limit) == ("h100", 2e9)


def test_the_search_holds_the_limit_against_the_peak_with_the_plans_donation():
    step, args = gpt.make_train_step(SMALL, abstract=True)

    def plan(**settings):
        # Over no axes and without macros (Remat) the search can only keep the program as
        # it is: the limit alone decides whether it is accepted.
        auto = search.AutomaticPartition(axes=(), macros=False, max_episodes=5, device="cpu", **settings)
        return automap.partition(step, mesh="data=2,model=4", device="cpu", schedule=[auto],
                                 donate_argnums=(0, 1))(*args)

    free = plan()
    assert "donate_argnums=(0, 1)" in str(free.history[0].tactic)  # filled in from automap's own
    kept = search.CostModel(free.partitioning, "cpu").cost().memory_peak
    donated = search.CostModel(free.partitioning, "cpu", donate_argnums=(0, 1)).cost().memory_peak
    assert donated < kept
    # A limit the plan meets only with its parameters and state donated: the search must
    # credit the donation the plan runs with, not refuse a plan the run fits.
    limited = plan(memory_limit=(donated + kept) / 2)
    assert limited.cost.fits and limited.cost.memory_peak == donated
    with pytest.raises(T.TacticError, match="no plan found fits"):
        automap.partition(step, mesh="data=2,model=4", device="cpu", schedule=[
            search.AutomaticPartition(axes=(), macros=False, max_episodes=5, device="cpu", memory_limit=(donated + kept) / 2)])(*args)


def test_partition_returns_a_plan():
    step, args = gpt.make_train_step(SMALL)
    plan = automap.partition(step, mesh="data=2,model=4", schedule=[T.DataParallel("data"), T.Megatron("model")],
                             device="cpu")(*args)
    assert plan.specs[0]["layers"][0]["mlp"]["w1"] == PartitionSpec(None, "model")
    assert plan.specs[2]["tokens"] == PartitionSpec("data", None)
    sh = plan.in_shardings[0]["layers"][0]["mlp"]["w2"]
    assert isinstance(sh, NamedSharding) and sh.spec == PartitionSpec("model", None)
    assert plan.out_specs[2] == PartitionSpec()  # the loss
    assert [str(s.tactic) for s in plan.history] == ["DataParallel('data')", "Megatron('model')"]
    assert plan.cost.step_time > 0 and plan.cost.fits
    placed = plan.shard_args(*args)
    assert placed[0]["layers"][0]["mlp"]["w1"].sharding.spec == PartitionSpec(None, "model")
    out = plan.jit()(*placed)
    np.testing.assert_allclose(float(out[2]), float(jax.jit(step)(*args)[2]), rtol=2e-5)


def test_explain_and_plot(tmp_path, capsys):
    step, args = gpt.make_train_step(SMALL, abstract=True)
    plan = automap.partition(step, mesh="data=2,model=4", device="cpu", budget_s=2)(*args)
    plan.explain()
    text = capsys.readouterr().out
    for part in ("parameters (groups of layers alike)", "params['layers'][*]['mlp']['w1']",
                 "collectives per step, by mesh axis", "memory: peak", "live at the peak",
                 "modeled step time", "replicated", "best rejected by the search"):
        assert part in text, part
    plan.plot(tmp_path / "plan.png")
    assert (tmp_path / "plan.png").stat().st_size > 10_000


# (2 s of search: in `make test-slow`. The default run holds a saved plan's decisions and
# key through a round trip in test_every_kind_of_decision_round_trips_through_a_saved_plan
# and tests/test_pipeline.py's saved plans, a searched plan's file in tests/test_determinism.py.)
@pytest.mark.slow
def test_save_load_round_trip(tmp_path):
    step, args = gpt.make_train_step(SMALL, abstract=True)
    plan = automap.partition(step, mesh="data=2,model=4", device="cpu", budget_s=2)(*args)
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "automap-plan" and data["version"] == 2 and data["mesh"] == {"data": 2, "model": 4}
    assert {"inputs", "outputs", "decisions", "cost", "search"} <= set(data)
    loaded = automap.load_plan(path).bind(step, *args)
    prog = plan.program
    assert [loaded.partitioning.tiling(v) for v in prog.inputs] == [plan.partitioning.tiling(v) for v in prog.inputs]
    assert loaded.partitioning.key() == plan.partitioning.key()
    assert loaded.cost.step_time == pytest.approx(plan.cost.step_time)


def test_every_kind_of_decision_round_trips_through_a_saved_plan(tmp_path):
    def f(w1, w2, b, x):
        return jnp.tanh(x @ w1 + b) @ w2

    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((16, 32), (32, 8), (32,), (8, 16))]
    prog = partir.lift(f, *args)
    part = partir.Partitioning(prog, partir.MeshSpec.of(data=2, model=4))
    part.replicate("b")
    part.pin("w2", axes=("data",))
    part.tile("x", 0, "data")
    part.tile("w1", 1, "model")
    part.constrain(prog.outputs[0], PartitionSpec("data", None))
    path = tmp_path / "plan.json"
    automap.Plan(part, device="cpu").save(path)
    saved = json.loads(path.read_text())["decisions"]
    assert [d["action"] for d in saved] == ["replicate", "pin", "tile", "tile", "constrain"]
    assert saved[1]["axes"] == ["data"] and saved[2]["name"] == "x" and saved[4]["tiling"] == ["data", None]
    loaded = automap.load_plan(path).bind(f, *args)
    assert loaded.partitioning.decisions == part.decisions
    assert loaded.partitioning.key() == part.key()
    saved[2]["action"] = "shard"
    path.write_text(json.dumps({**json.loads(path.read_text()), "decisions": saved}))
    with pytest.raises(automap.PlanError, match=r"plan .*plan.json, decision 2 \(shard of x\): unknown decision action .shard."):
        automap.load_plan(path).bind(f, *args)


def test_loading_onto_a_program_it_does_not_fit(tmp_path):
    step, args = gpt.make_train_step(SMALL, abstract=True)
    plan = automap.partition(step, mesh="data=2,model=4",
                             schedule=[T.DataParallel("data"), T.Megatron("model")])(*args)
    path = tmp_path / "plan.json"
    plan.save(path)
    other_step, other_args = gpt.make_train_step(gpt.GPTConfig(n_layers=2, d_model=48, n_heads=6), abstract=True)
    with pytest.raises(automap.PlanError) as e:
        automap.load_plan(path).bind(other_step, *other_args)
    msg = str(e.value)
    assert "input params['layers'][0]['mlp']['w1'] has shape (48, 256), the plan expects (64, 256)" in msg
    deeper, deeper_args = gpt.make_train_step(gpt.GPTConfig(n_layers=3), abstract=True)
    with pytest.raises(automap.PlanError, match=r"does not know input\(s\) params\['layers'\]\[2\]"):
        automap.load_plan(path).bind(deeper, *deeper_args)
    wrong_mesh = automap.partition(step, mesh="data=4,model=2", schedule=[T.DataParallel("data")])(*args).jax_mesh
    with pytest.raises(automap.PlanError, match="the plan is for mesh data=2,model=4"):
        automap.load_plan(path).bind(step, *args, jax_mesh=wrong_mesh)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(automap.PlanError, match="is not an automap plan"):
        automap.load_plan(bad)


# By default the module pytrees (nnx's and equinox's); the plain dicts of the MLP and of
# linen's parameters (as the GPT's that test_jit_matches_jax_jit_over_steps_and_plans_once
# runs) in `make test-slow`.
@pytest.mark.parametrize("name", [pytest.param("mlp", marks=pytest.mark.slow), "nnx_mlp",
                                  pytest.param("linen_mlp", marks=pytest.mark.slow), "equinox_mlp"])
def test_pytree_kinds(name):
    step, args = REGISTRY[name]()
    fn = automap.jit(step, mesh="data=8", schedule=[T.DataParallel("data"), search.AutomaticPartition(budget_s=1)],
                     cache_dir=None, replan=True)
    out, ref = fn(*args), jax.jit(step)(*args)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(ref)  # optax states, modules and all
