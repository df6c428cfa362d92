"""Plans are reproducible: the same program, mesh, schedule, device and seed give the
same plan file, byte for byte, in another process; what depends on the machine (the
search's timings) is kept beside the plan, not in it; and the plan cache key changes
with everything that can change a plan."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import automap
import search
import tactics as T
from automap._args import options
from automap._cache import key_of, key_parts
from automap._plan import timing_path


def _search(tmp_path, hash_seed: int):
    out = tmp_path / f"plan{hash_seed}.json"
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}  # another order of sets and dicts of strings
    run = subprocess.run([sys.executable, "-m", "automap", "search", "examples/gpt.py:factory", "--mesh",
                          "data=2,model=4", "--device", "cpu", "--episodes", "40", "--budget", "600", "--quiet",
                          "--out", str(out), "--cache-dir", str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    return out


# (5 s: two processes importing JAX and searching; in `make test-slow`. The default run
# holds a seeded search to one plan within a process in tests/test_search.py::test_same_seed_same_plan
# and tests/test_twins.py::test_same_seed_same_plan_through_twins.)
@pytest.mark.slow
def test_a_search_with_an_episode_budget_writes_the_same_file_in_another_process(tmp_path):
    first, second = _search(tmp_path, 1), _search(tmp_path, 2)
    assert first.read_bytes() == second.read_bytes()
    data = json.loads(first.read_text())
    assert data["search"]["stopped"] == "episode limit" and data["search"]["reproducible"]
    assert data["decisions"]  # a plan that splits something, not an empty one twice


def step(w, x):
    return jnp.tanh(x @ w).sum()


ARGS = (jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((8, 8), jnp.float32))


@pytest.fixture(scope="module")
def searched():
    auto = search.AutomaticPartition(max_episodes=5, budget_s=600, device="cpu")
    return automap.partition(step, mesh="data=2,model=4", schedule=[auto])(*ARGS)


def test_timings_are_beside_the_plan_not_in_it(searched, tmp_path):
    path = tmp_path / "p.json"
    searched.save(path)
    assert not timing_path(path).exists()
    data = json.loads(path.read_text())
    assert set(data["search"]) == {"stopped", "reproducible", "root_step_time_s", "actions"}
    searched.save(path, timings=True)
    assert json.loads(path.read_text()) == data
    timing = json.loads(timing_path(path).read_text())
    assert timing["key"] == data["key"] and timing["episodes"] == searched.search.stats.episodes
    assert {"elapsed_s", "trace", "states", "cache_hits"} <= set(timing)


def test_a_search_stopped_by_its_time_budget_says_it_may_differ(searched):
    stats = dataclasses.replace(searched.search.stats, stopped="time budget")
    timed = automap.Plan(searched.partitioning, search=dataclasses.replace(searched.search, stats=stats))
    section = timed.to_json()["search"]
    assert section["reproducible"] is False and "max_episodes" in section["note"]


def _key(prog, **settings):
    base = dict(mesh="data=2,model=4", schedule=None, device="cpu", memory_limit=None, static_argnums=(),
                donate_argnums=(), budget_s=30.0, seed=0, best_effort=False)
    return key_of(key_parts(prog, options(**{**base, **settings})))


def test_the_cache_key_changes_with_everything_that_can_change_a_plan(monkeypatch):
    import partir

    prog = partir.lift(step, *ARGS)
    base = _key(prog)
    parts = key_parts(prog, options(mesh="data=2,model=4", schedule=None, device="cpu", memory_limit=None,
                                    static_argnums=(), donate_argnums=(), budget_s=30.0, seed=0, best_effort=False))
    assert set(parts) == {"program", "static", "mesh", "schedule", "device", "memory_limit", "best_effort",
                          "donate_argnums", "lowering", "jax", "automap"}
    assert parts["device"]["name"] == "cpu" and parts["lowering"] == "jit"
    faster = dataclasses.replace(search.get_device("cpu"), hbm_bandwidth=1e12)
    changed = [_key(prog, mesh="data=4,model=2"), _key(prog, device="h100"), _key(prog, device=faster),
               _key(prog, memory_limit=1e9), _key(prog, donate_argnums=(0,)), _key(prog, budget_s=31),
               _key(prog, seed=1), _key(prog, best_effort=True), _key(prog, schedule=[T.Shard("x", 0, "data")]),
               _key(prog, schedule=[search.AutomaticPartition(device="cpu", max_episodes=9)]),
               _key(partir.lift(lambda w, x: jnp.tanh(x @ w).mean(), *ARGS))]
    assert len(set(changed + [base])) == len(changed) + 1
    # Equal settings written differently are one key: a budget of 30 is 30.0.
    assert _key(prog, budget_s=30) == base
    # The versions are part of it.
    monkeypatch.setattr(jax, "__version__", "0.0.1")
    assert _key(prog) != base
    monkeypatch.undo()
    monkeypatch.setattr(automap._cache, "__version__", "9.9")
    assert _key(prog) != base
    assert key_of({**parts, "lowering": "shard_map"}) != key_of(parts)
