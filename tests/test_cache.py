"""The plan cache reuses a plan only where it was made for the same call: static
arguments by type and value (as `jax.jit` keys them), every setting (best_effort
included), and an entry whose content was made for another key is set aside. A cache
that cannot be written only costs a search, with one warning."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import automap
import tactics as T
from automap import AutomapError, PlanCacheWarning
from tactics import TacticError

MESH = "data=2,model=4"
QUICK = [T.Shard("x", 0, "data")]
X = jnp.arange(32, dtype=jnp.int32).reshape(8, 4)


def _first(s):
    return s[0] if isinstance(s, tuple) else s


def scaled(x, s):
    return x * _first(s)


def by_type(x, s):
    return x * 2 if isinstance(_first(s), float) else x * 3


def step(w, x):
    return jnp.tanh(x @ w).sum()


ARGS = (jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((8, 8), jnp.float32))


@pytest.mark.parametrize("fn", [scaled, by_type])
def test_static_arguments_equal_but_of_another_type_are_another_signature(tmp_path, fn):
    jitted = automap.jit(fn, mesh=MESH, schedule=QUICK, static_argnums=1, cache_dir=tmp_path)
    for s in (1, 1.0, True, (1,), (1.0,)):
        got, want = jitted(X, s), jax.jit(fn, static_argnums=1)(X, s)
        assert got.dtype == want.dtype, s
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert jitted.stats["planned"] + jitted.stats["disk_hits"] == 5
    # A new process (a fresh function on the same folder) finds each in its own entry.
    again = automap.jit(fn, mesh=MESH, schedule=QUICK, static_argnums=1, cache_dir=tmp_path)
    assert again(X, 1.0).dtype == jax.jit(fn, static_argnums=1)(X, 1.0).dtype
    assert again.stats["disk_hits"] == 1


def _skips(tmp_path, best_effort):
    # Megatron finds no block in `step` (no weight is read by two matmuls): it is skipped
    # only with best_effort.
    return automap.jit(step, mesh=MESH, schedule=[T.Shard("x", 0, "data"), T.Megatron("model")],
                       cache_dir=tmp_path, best_effort=best_effort)


def test_a_plan_made_with_best_effort_is_not_reused_by_a_strict_call(tmp_path):
    loose = _skips(tmp_path, True).plan_for(*ARGS)
    assert any(s.skipped for s in loose.history)
    with pytest.raises(TacticError):
        _skips(tmp_path, False).plan_for(*ARGS)


def test_a_plan_the_cli_made_with_best_effort_is_not_reused_by_a_strict_call(tmp_path, monkeypatch):
    from automap._cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "factories.py").write_text(
        "import jax, jax.numpy as jnp\n"
        "def step(w, x):\n    return jnp.tanh(x @ w).sum()\n"
        "def good():\n    return step, (jax.ShapeDtypeStruct((8, 4), jnp.float32), "
        "jax.ShapeDtypeStruct((8, 8), jnp.float32))\n")
    argv = ["search", "factories.py:good", "--mesh", MESH, "--schedule", "megatron:model", "--out", "p.json",
            "--cache-dir", "cache", "--best-effort", "--quiet"]
    assert main(argv) == 0
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    strict = automap.jit(step, mesh=MESH, schedule=[T.Megatron("model")], cache_dir=tmp_path / "cache")
    with pytest.raises(TacticError):
        strict.plan_for(*ARGS)
    loose = automap.jit(step, mesh=MESH, schedule=[T.Megatron("model")], cache_dir=tmp_path / "cache",
                        best_effort=True)
    loose.plan_for(*ARGS)
    assert loose.stats["disk_hits"] == 1  # the same settings do find the CLI's plan


def test_an_entry_made_for_another_key_is_set_aside(tmp_path):
    a = automap.jit(step, mesh=MESH, schedule=QUICK, cache_dir=tmp_path)
    a.plan_for(*ARGS)
    [entry] = tmp_path.glob("*.json")
    b = automap.jit(step, mesh=MESH, schedule=[T.Shard("x", 0, "model")], cache_dir=tmp_path)
    b.plan_for(*ARGS)
    other = next(p for p in tmp_path.glob("*.json") if p != entry)
    shutil.copy(entry, other)  # the data-split plan under the model-split plan's key
    c = automap.jit(step, mesh=MESH, schedule=[T.Shard("x", 0, "model")], cache_dir=tmp_path)
    with pytest.warns(PlanCacheWarning, match="made for other settings"):
        plan = c.plan_for(*ARGS)
    assert c.stats["planned"] == 1 and "model" in str(plan.specs[1])
    assert (tmp_path / (other.name + ".broken")).exists()


def test_a_folder_where_an_entry_should_be_is_set_aside(tmp_path):
    automap.jit(step, mesh=MESH, schedule=QUICK, cache_dir=tmp_path).plan_for(*ARGS)
    [entry] = tmp_path.glob("*.json")
    entry.unlink()
    entry.mkdir()
    again = automap.jit(step, mesh=MESH, schedule=QUICK, cache_dir=tmp_path)
    with pytest.warns(PlanCacheWarning, match="cannot be used"):
        again.plan_for(*ARGS)
    assert entry.is_file() and (tmp_path / (entry.name + ".broken")).is_dir()


def _uncached(folder):
    fn = automap.jit(scaled, mesh=MESH, schedule=QUICK, cache_dir=folder)
    with pytest.warns(PlanCacheWarning, match="cannot be written") as caught:
        first = fn(X, 2)
        second = fn(X.astype(jnp.float32), 2)  # another signature: planned again, no second warning
    assert len([w for w in caught if issubclass(w.category, PlanCacheWarning)]) == 1
    np.testing.assert_array_equal(np.asarray(first), np.asarray(X * 2))
    assert second.dtype == jnp.float32 and fn.stats["planned"] == 2


def test_a_cache_folder_that_cannot_be_made_warns_once_and_runs_uncached(tmp_path):
    (tmp_path / "a-file").write_text("")
    _uncached(tmp_path / "a-file" / "plans")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_cache_folder_warns_once_and_runs_uncached(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        _uncached(folder)
    finally:
        folder.chmod(0o755)


def test_cache_dir_expands_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    automap.jit(step, mesh=MESH, schedule=QUICK, cache_dir="~/plans").plan_for(*ARGS)
    assert len(list((tmp_path / "plans").glob("*.json"))) == 1
    assert not any(p.name == "~" for p in tmp_path.iterdir()) and not os.path.exists("~")


def test_automap_cache_dir_naming_a_file_warns_and_runs_uncached(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("AUTOMAP_CACHE_DIR", str(tmp_path / "a-file"))
    with pytest.warns(PlanCacheWarning, match="AUTOMAP_CACHE_DIR=.* is a file"):
        fn = automap.jit(scaled, mesh=MESH, schedule=QUICK)
    np.testing.assert_array_equal(np.asarray(fn(X, 2)), np.asarray(X * 2))
    with pytest.raises(AutomapError, match="is a file, not a folder"):
        automap.jit(scaled, mesh=MESH, schedule=QUICK, cache_dir=tmp_path / "a-file")


def test_the_key_records_what_it_was_made_from(tmp_path):
    automap.jit(scaled, mesh=MESH, schedule=QUICK, static_argnums=1, cache_dir=tmp_path, best_effort=True)(X, 2)
    [entry] = tmp_path.glob("*.json")
    made_for = json.loads(entry.read_text())["made_for"]
    assert made_for["best_effort"] is True
    assert made_for["static"] == [["builtins.int", "2"]]
