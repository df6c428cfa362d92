"""Bad and unusual input, as a new user gives it, through the API and the CLI: every kind
gets the project's error type with a phrase naming the problem, raised before any work,
and nothing is half-applied (no plan cache entry, plan file or partitioning changed).
Unusual input that is fine (Python numbers as arguments, a program with no ops, a broken
cache entry, arrays placed elsewhere) works."""

import json
import os
import re
import stat
import threading
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import automap
import partir
import search
import tactics as T
from automap import AutomapError, MemoryLimitError, PlanError
from automap._cli import main, parse_memory
from partir import PartitioningError
from tactics import TacticError

MESH = "data=2,model=4"
ARGS = (jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((8, 8), jnp.float32))
QUICK = [T.Shard("x", 0, "data")]  # a schedule with no search


def step(w, x):
    return jnp.tanh(x @ w).sum()


def scalars(x, lr):
    return x * lr


FACTORIES = """
import jax, jax.numpy as jnp

def step(w, x):
    return jnp.tanh(x @ w).sum()

def good():
    return step, (jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((8, 8), jnp.float32))

def raises():
    raise RuntimeError("no weights at /data/w.npy")

def wrong():
    return step

def identity():
    return (lambda x: x), (jax.ShapeDtypeStruct((8, 4), jnp.float32),)

def trace_raises():
    def refuses(x):
        raise ValueError("the step refuses")
    return refuses, (jax.ShapeDtypeStruct((8, 4), jnp.float32),)

def bad_shape():
    return step, (jax.ShapeDtypeStruct((4, 4), jnp.float32), jax.ShapeDtypeStruct((8, 8), jnp.float32))
"""

#: A figure no float holds: JSON and TOML read a number written with 401 digits as an int.
HUGE = 10**400


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A plan file of `step` (one tile decision) to edit."""
    path = tmp_path_factory.mktemp("saved") / "plan.json"
    automap.partition(step, mesh=MESH, schedule=QUICK)(*ARGS).save(path)
    return json.loads(path.read_text())


@pytest.fixture
def ctx(tmp_path, saved, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "factories.py").write_text(FACTORIES)
    (tmp_path / "cache").mkdir()
    (tmp_path / "plan.json").write_text(json.dumps(saved))
    huge = {**search.PRESETS["cpu"].to_dict(), "hbm_bytes": HUGE}
    (tmp_path / "huge.json").write_text(json.dumps(huge))
    (tmp_path / "huge.toml").write_text(_toml(huge))
    return SimpleNamespace(tmp=tmp_path, cache=tmp_path / "cache", plan=tmp_path / "plan.json", saved=saved)


def _toml(description: dict) -> str:
    """A device description as TOML (its values are numbers, booleans and plain names)."""
    def value(v):
        return str(v).lower() if isinstance(v, bool) else json.dumps(v)
    flat = [f"{k} = {value(v)}" for k, v in description.items() if not isinstance(v, dict)]
    flops = [f"{k} = {value(v)}" for k, v in description["peak_flops"].items()]
    return "\n".join([*flat, "[peak_flops]", *flops]) + "\n"


def jit(c, **kw):
    return automap.jit(step, mesh=kw.pop("mesh", MESH), schedule=kw.pop("schedule", QUICK), cache_dir=c.cache, **kw)


def plan_with(edit):
    """A row that edits the saved plan file with `edit(data)` and binds it."""
    def run(c):
        data = json.loads(c.plan.read_text())
        edit(data)
        c.plan.write_text(json.dumps(data))
        return automap.load_plan(c.plan).bind(step, *ARGS)
    return run


def plan_text(text: bytes):
    def run(c):
        c.plan.write_bytes(text)
        return automap.load_plan(c.plan)
    return run


def _set(path, value):
    def edit(data):
        *head, last = path
        for k in head:
            data = data[k]
        data[last] = value
    return edit


# (kind, what runs it, the error type, a phrase of the message)
API = [
    ("mesh a list", lambda c: jit(c, mesh=[2, 4]), AutomapError, "pass a jax.sharding.Mesh"),
    ("mesh size 2.5", lambda c: jit(c, mesh={"data": 2.5}), AutomapError, "has size 2.5"),
    ("mesh text", lambda c: jit(c, mesh="data=two"), AutomapError, "mesh 'data=two': 'data=two' is not NAME=SIZE"),
    ("MeshSpec.of 2.5", lambda c: partir.MeshSpec.of(data=2.5), PartitioningError, "has size 2.5"),
    ("MeshSpec.of True", lambda c: partir.MeshSpec.of(data=True), PartitioningError, "has size True"),
    ("fn not callable", lambda c: automap.jit(3, mesh=MESH), AutomapError, "not callable"),
    ("decorator settings", lambda c: automap.jit(mesh=MESH, budget_s=-1), AutomapError, "budget_s=-1 is out of range"),
    ("schedule a tactic", lambda c: jit(c, schedule=T.DataParallel("data")), AutomapError, "is one tactic: pass a list"),
    ("schedule a string", lambda c: jit(c, schedule="dp:data"), AutomapError, "pass a list of tactics"),
    ("schedule of a class", lambda c: jit(c, schedule=[T.DataParallel]), AutomapError, "is the class DataParallel"),
    ("schedule of a string", lambda c: jit(c, schedule=["dp"]), AutomapError, "is not a tactic"),
    ("tactic on no axis", lambda c: jit(c, schedule=[T.DataParallel("modle")]), AutomapError, "'modle', which is not an axis"),
    ("budget NaN", lambda c: jit(c, budget_s=float("nan")), AutomapError, "budget_s=nan is not finite"),
    ("budget inf", lambda c: jit(c, budget_s=float("inf")), AutomapError, "budget_s=inf is not finite"),
    ("budget 0", lambda c: jit(c, budget_s=0), AutomapError, "budget_s=0 is out of range"),
    ("grad_accum 0", lambda c: jit(c, grad_accum=0), AutomapError, "grad_accum=0 is out of range"),
    ("budget a string", lambda c: jit(c, budget_s="30"), AutomapError, "is a str, not a number"),
    ("memory 0", lambda c: jit(c, memory_limit=0), AutomapError, "memory_limit=0 is out of range"),
    ("memory negative", lambda c: jit(c, memory_limit=-1), AutomapError, "memory_limit=-1 is out of range"),
    ("memory NaN", lambda c: jit(c, memory_limit=float("nan")), AutomapError, "memory_limit=nan is not finite"),
    ("memory '80GB'", lambda c: jit(c, memory_limit="80GB"), AutomapError, "e.g. memory_limit=80e9"),
    ("memory True", lambda c: jit(c, memory_limit=True), AutomapError, "is a bool, not a number"),
    ("seed 'abc'", lambda c: jit(c, seed="abc"), AutomapError, "seed='abc' is a str, not an integer"),
    ("seed 1.5", lambda c: jit(c, seed=1.5), AutomapError, "seed=1.5 is a float, not an integer"),
    ("seed None", lambda c: jit(c, seed=None), AutomapError, "seed=None is a NoneType"),
    ("device unknown", lambda c: jit(c, device="h900"), search.DeviceError, "unknown device 'h900'"),
    ("device file missing", lambda c: jit(c, device="nope.json"), search.DeviceError, "cannot read device file"),
    ("static_argnums a string", lambda c: jit(c, static_argnums="1"), AutomapError, "give an argument position"),
    ("static_argnums negative", lambda c: jit(c, static_argnums=-1), AutomapError, "non-negative integers"),
    ("donate_argnums a string", lambda c: jit(c, donate_argnums="0"), AutomapError, "give an argument position"),
    ("donate_argnums repeated", lambda c: jit(c, donate_argnums=(0, 0)), AutomapError, "repeats a position"),
    ("static and donated", lambda c: jit(c, static_argnums=0, donate_argnums=0), AutomapError, "in both"),
    ("best_effort 'yes'", lambda c: jit(c, best_effort="yes"), AutomapError, "best_effort='yes' is not a bool"),
    ("replan 1", lambda c: jit(c, replan=1), AutomapError, "replan=1 is not a bool"),
    ("cache_dir a file", lambda c: automap.jit(step, mesh=MESH, cache_dir=c.plan), AutomapError, "is a file, not a folder: give a folder"),
    ("memory 10**400", lambda c: jit(c, memory_limit=HUGE), AutomapError, "memory_limit=1000000"),
    ("budget 10**400", lambda c: jit(c, budget_s=HUGE), AutomapError, "(401 characters) is too large for a float"),
    ("device JSON figure 10**400", lambda c: jit(c, device=str(c.tmp / "huge.json")), search.DeviceError,
     "hbm_bytes=1000000"),
    ("device TOML figure 10**400", lambda c: jit(c, device=str(c.tmp / "huge.toml")), search.DeviceError,
     "is too large for a float"),
]

TACTICS = [
    ("Shard dim '1'", lambda c: T.Shard("x", "1", "data"), TacticError, "Shard dim='1' is a str, not an integer"),
    ("Shard dim 1.5", lambda c: T.Shard("x", 1.5, "data"), TacticError, "not an integer"),
    ("Shard axis 0", lambda c: T.Shard("x", 0, 0), TacticError, "Shard axis=0 is an int, not a string"),
    ("Shard re:[", lambda c: T.Shard("re:[", 0, "data"), TacticError, "not a valid regular expression"),
    ("Shard pattern 3", lambda c: T.Shard(3, 0, "data"), TacticError, "Shard pattern=3 is an int"),
    ("Replicate re:(", lambda c: T.Replicate("re:("), TacticError, "not a valid regular expression"),
    ("search axes 'data'", lambda c: search.AutomaticPartition(axes="data"), TacticError, "give a tuple of axis names"),
    ("search axes of ints", lambda c: search.AutomaticPartition(axes=(0,)), TacticError, "which is not an axis name"),
    ("search budget NaN", lambda c: search.AutomaticPartition(budget_s=float("nan")), TacticError, "not finite"),
    ("search memory '80GB'", lambda c: search.AutomaticPartition(memory_limit="80GB"), TacticError, "not a number"),
    ("search seed None", lambda c: search.AutomaticPartition(seed=None), TacticError, "seed=None"),
    ("search episodes 0", lambda c: search.AutomaticPartition(max_episodes=0), TacticError, "max_episodes=0 is out of range"),
    ("search device", lambda c: search.AutomaticPartition(device="h900"), search.DeviceError, "unknown device"),
    ("search progress 5", lambda c: search.AutomaticPartition(progress=5), TacticError, "is not callable"),
    ("search lowering pmap", lambda c: search.AutomaticPartition(lowering="pmap"), TacticError,
     "lowering='pmap': choose one of"),
    ("search axes repeated", lambda c: search.AutomaticPartition(axes=("data", "data")), TacticError,
     "names 'data' twice"),
    ("search donate -1", lambda c: search.AutomaticPartition(donate_argnums=(-1,)), TacticError,
     "donate_argnums=-1 is out of range"),
    ("search donate 'params'", lambda c: search.AutomaticPartition(donate_argnums="params"), TacticError,
     "is not a tuple: give argument positions"),
    ("search budget 10**400", lambda c: search.AutomaticPartition(budget_s=HUGE), TacticError, "too large for a float"),
    ("search memory 10**400", lambda c: search.AutomaticPartition(memory_limit=HUGE), TacticError,
     "too large for a float"),
    ("ZeRO stage 4", lambda c: T.ZeRO("data", stage=4), TacticError, "ZeRO stage=4 is not one of 1, 2, 3"),
    ("ZeRO stage True", lambda c: T.ZeRO("data", stage=True), TacticError, "ZeRO stage=True is a bool, not one of"),
    ("Remat policy", lambda c: T.Remat("bogus"), TacticError,
     "Remat policy='bogus' is not one of none, collectives, dots_with_context, dots, dots_except_mlp_in, dots_except_mlp, every_other_dot, qkv, full"),
    ("DataParallel axis 0", lambda c: T.DataParallel(0), TacticError, "DataParallel axis=0 is an int, not a string"),
    ("device figure 10**400", lambda c: search.DeviceSpec.from_dict({**search.PRESETS["cpu"].to_dict(),
                                                                      "hbm_bandwidth": HUGE}),
     search.DeviceError, "hbm_bandwidth=1000000"),
]

CALLS = [
    ("keyword arguments", lambda c: jit(c)(ARGS[0], x=ARGS[1]), AutomapError, "keyword argument(s) x"),
    ("static_argnums out of range", lambda c: jit(c, static_argnums=5).plan_for(*ARGS), AutomapError,
     "names argument 5, but step got 2"),
    ("donate_argnums out of range", lambda c: jit(c, donate_argnums=(2,)).plan_for(*ARGS), AutomapError,
     "names argument 2"),
    ("search donating argument 2", lambda c: automap.partition(step, mesh=MESH, schedule=[
        search.AutomaticPartition(donate_argnums=(2,), max_episodes=1)])(*ARGS), TacticError,
     "the program takes 2 arguments"),
    ("unhashable static argument", lambda c: automap.jit(scalars, mesh=MESH, static_argnums=1, cache_dir=c.cache)
     .plan_for(jnp.ones((8, 4)), [1.0]), AutomapError, "is a list, which is not hashable"),
    ("a string leaf", lambda c: automap.partition(scalars, mesh=MESH)(ARGS[0], {"lr": "fast"}), AutomapError,
     "argument 1['lr'] of scalars is a str"),
    ("mesh beyond the devices", lambda c: jit(c, mesh="data=4,model=4").plan_for(*ARGS), AutomapError,
     "needs 16 devices, 8 are available"),
    ("tactic matching nothing", lambda c: automap.partition(step, mesh=MESH, schedule=[T.Shard("y", 0, "data")])(*ARGS),
     TacticError, "pattern 'y' matches no input"),
    ("no plan fits (partition)", lambda c: automap.partition(step, mesh=MESH, schedule=QUICK, memory_limit=1)(*ARGS),
     MemoryLimitError, "no plan fits the memory limit"),
    ("no plan fits (jit)", lambda c: jit(c, memory_limit=1).plan_for(*ARGS), MemoryLimitError, "live at the peak: w"),
    ("plan.jit other shapes", lambda c: automap.partition(step, mesh=MESH, schedule=QUICK)(*ARGS).jit()(
        jnp.ones((8, 4)), jnp.ones((16, 8))), PartitioningError, "is float32[16, 8], but the plan was made for"),
    ("save to a missing folder", lambda c: automap.partition(step, mesh=MESH, schedule=QUICK)(*ARGS).save(
        c.tmp / "no" / "p.json"), AutomapError, "does not exist; create it first"),
    ("save to a folder", lambda c: automap.partition(step, mesh=MESH, schedule=QUICK)(*ARGS).save(c.cache),
     AutomapError, "is a folder: give a file name"),
    ("plot to a missing folder", lambda c: automap.partition(step, mesh=MESH, schedule=QUICK)(*ARGS).plot(
        c.tmp / "no" / "p.png"), AutomapError, "does not exist"),
    ("plot to an unknown format", lambda c: automap.partition(step, mesh=MESH, schedule=QUICK)(*ARGS).plot(
        c.tmp / "p.xyz"), AutomapError, "matplotlib does not write '.xyz' pictures; end the name in one of"),
]

PLAN_FILES = [
    ("no file", lambda c: automap.load_plan(c.tmp / "none.json"), PlanError, "no plan file at"),
    ("a folder", lambda c: automap.load_plan(c.cache), PlanError, "is a folder, not a plan file"),
    ("not UTF-8", plan_text(b"\xff\xfe{"), PlanError, "not UTF-8 text"),
    ("not JSON", plan_text(b"{format"), PlanError, "invalid JSON"),
    ("a JSON list", plan_text(b"[]"), PlanError, "holds a JSON list, not an object"),
    ("another format", plan_text(b'{"format": "x"}'), PlanError, "this is not an automap plan"),
    ("a string version", plan_with(_set(["version"], "2")), PlanError, "version '2' is not one this automap reads"),
    ("a missing key", plan_with(lambda d: d.pop("inputs")), PlanError, "'inputs' is missing"),
    ("mesh size 2.5", plan_with(_set(["mesh", "data"], 2.5)), PlanError, "has size 2.5"),
    ("spec longer than the rank", plan_with(_set(["inputs", 0, "spec"], [None, None, None])), PlanError,
     "has 3 entries for a value of rank 2"),
    ("spec with an int", plan_with(_set(["inputs", 0, "spec"], [0, None])), PlanError, "is not a list of per-dim"),
    ("spec on no axis", plan_with(_set(["inputs", 0, "spec"], ["modle", None])), PlanError, "'modle', which is not an axis"),
    ("dtype edited", plan_with(_set(["inputs", 0, "dtype"], "bfloat16")), PlanError,
     "input w has dtype float32, the plan expects bfloat16"),
    ("shape edited", plan_with(_set(["inputs", 0, "shape"], [4, 4])), PlanError, "has shape (8, 4), the plan expects"),
    ("input spec edited", plan_with(_set(["inputs", 0, "spec"], [None, "model"])), PlanError,
     "input w has spec [None, 'model'] in the file, but its decisions give"),
    ("decision edited", plan_with(_set(["decisions", 0, "dim"], 7)), PlanError, "decision 0 (tile of x): "),
    ("decision action", plan_with(_set(["decisions", 0, "action"], "shard")), PlanError, "unknown decision action"),
    ("decision not an object", plan_with(_set(["decisions"], [3])), PlanError, "decisions[0] is not an object"),
    ("memory limit a string", plan_with(_set(["memory_limit"], "80GB")), PlanError, "memory_limit='80GB' is a str"),
    ("cost section edited", plan_with(_set(["cost"], {"fits": "yes"})), PlanError, "cost needs"),
    ("memory limit 10**400", plan_with(_set(["memory_limit"], HUGE)), PlanError, "is too large for a float"),
    ("cost 10**400", plan_with(_set(["cost", "step_time_s"], HUGE)), PlanError,
     "cost step_time_s=1000000"),
]


def _state(c):
    """What an error must leave as it was: the cache, the plan file, the folder."""
    files = sorted(str(p.relative_to(c.tmp)) for p in c.tmp.rglob("*") if "__pycache__" not in p.parts)
    return files, c.plan.read_bytes()


@pytest.mark.parametrize("kind,run,error,phrase", API + TACTICS + CALLS + PLAN_FILES,
                         ids=[row[0] for row in API + TACTICS + CALLS + PLAN_FILES])
def test_api_refuses_with_the_problem_and_leaves_nothing(ctx, kind, run, error, phrase):
    before = None if kind in dict((r[0], 1) for r in PLAN_FILES) else _state(ctx)
    with pytest.raises(error) as e:
        run(ctx)
    assert phrase in str(e.value), str(e.value)
    if before is not None:
        assert _state(ctx) == before  # no cache entry, plan file or other file written
    assert not list(ctx.cache.iterdir())


OUT = ["--out", "out.json", "--cache-dir", "cache"]
SEARCH = ["search", "factories.py:good", "--mesh", MESH, "--schedule", "auto", "--episodes", "3"]
CLI = [
    ("png in a missing folder", [*SEARCH, *OUT, "--png", "no/dir/x.png"], "--png no/dir/x.png: folder no/dir does not exist"),
    ("out a folder", [*SEARCH, "--out", "cache"], "--out cache is a folder"),
    ("out in a missing folder", [*SEARCH, "--out", "no/p.json"], "folder no does not exist"),
    ("timings file a folder", [*SEARCH, *OUT, "--timings"], "--timings file out.timing.json is a folder"),
    ("memory NaN", [*SEARCH, *OUT, "--memory", "nan"], "--memory 'nan'"),
    ("memory 0", [*SEARCH, *OUT, "--memory", "0GB"], "at least 1 byte"),
    ("budget inf", [*SEARCH, *OUT, "--budget", "inf"], "--budget 'inf'"),
    ("episodes 0", [*SEARCH, *OUT, "--episodes", "0"], "--episodes '0'"),
    ("seed 1.5", [*SEARCH, *OUT, "--seed", "1.5"], "--seed '1.5': give an integer"),
    ("cache-dir a file", [*SEARCH, "--out", "out.json", "--cache-dir", "plan.json"], "--cache-dir 'plan.json' is a file, not a folder"),
    ("factory raises", ["search", "factories.py:raises", "--mesh", MESH, *OUT],
     "raises() raised RuntimeError: no weights at /data/w.npy"),
    ("factory returns no pair", ["search", "factories.py:wrong", "--mesh", MESH, *OUT], "must return (fn, example_args)"),
    ("a tactic that cannot apply", ["search", "factories.py:good", "--mesh", MESH, "--schedule", "ep:model", *OUT],
     "ExpertParallel('model')"),
    ("no plan fits --memory", [*SEARCH, *OUT, "--memory", "1"], "no plan fits --memory: the best plan found peaks at"),
    ("show a JSON list", ["show", "list.json"], "holds a JSON list"),
    ("show a folder", ["show", "cache"], "is a folder, not a plan file"),
    ("show not UTF-8", ["show", "bytes.json"], "not UTF-8 text"),
    ("show png in a missing folder", ["show", "plan.json", "--png", "no/x.png"], "folder no does not exist"),
    ("step raises while traced", ["search", "factories.py:trace_raises", "--mesh", MESH, *OUT],
     "TARGET 'factories.py:trace_raises': tracing refuses(*example_args) raised ValueError: the step refuses"),
    ("shape error in the step", ["search", "factories.py:bad_shape", "--mesh", MESH, *OUT],
     "tracing step(*example_args) raised TypeError: dot_general requires contracting dimensions"),
    ("png the plan file", [*SEARCH, "--out", "out.png", "--cache-dir", "cache", "--png", "./out.png"],
     "--png out.png is the same file as --out out.png"),
    ("png of an unknown format", [*SEARCH, *OUT, "--png", "p.xyz"], "--png p.xyz: matplotlib does not write '.xyz'"),
    ("show png of an unknown format", ["show", "plan.json", "--png", "p.xyz"], "matplotlib does not write '.xyz'"),
    ("episodes of 5000 digits", [*SEARCH, *OUT, "--episodes", "9" * 5000], "--episodes '99999"),
    ("memory 1e400", [*SEARCH, *OUT, "--memory", "1e400"], "--memory '1e400' is not finite"),
]


@pytest.mark.parametrize("kind,argv,phrase", CLI, ids=[row[0] for row in CLI])
def test_cli_gives_one_line_and_status_2_before_any_work(ctx, capsys, kind, argv, phrase):
    (ctx.tmp / "list.json").write_text("[]")
    (ctx.tmp / "bytes.json").write_bytes(b"\xff\xfe")
    (ctx.tmp / "out.timing.json").mkdir()
    before = _state(ctx)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("automap: error: "), err
    assert phrase in err, err
    assert _state(ctx) == before  # no plan, timings, picture or cache entry written


def test_best_effort_writes_the_plan_that_does_not_fit(ctx, capsys):
    assert main([*SEARCH, *OUT, "--memory", "1", "--best-effort", "--quiet"]) == 0
    data = json.loads((ctx.tmp / "out.json").read_text())
    assert data["cost"]["fits"] is False and data["memory_limit"] == 1


def test_integer_settings_of_any_size_are_integers():
    # An int is exact at any size: only where a float is wanted is 10**400 too large.
    t = search.AutomaticPartition(seed=HUGE, max_episodes=HUGE)
    assert (t.seed, t.max_episodes) == (HUGE, HUGE)


def test_a_glob_that_cannot_tell_two_inputs_apart_warns():
    # {'a/b': ...} and {'a': {'b': ...}} both join to p/a/b: the glob takes both and says
    # so; a regular expression on the name takes one, silently.
    def f(p, x):
        return (x @ p["a/b"]).sum() + (x @ p["a"]["b"]).sum()

    square = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    prog = partir.lift(f, {"a/b": square, "a": {"b": square}}, jax.ShapeDtypeStruct((8, 4), jnp.float32))
    mesh = partir.MeshSpec.of(data=2, model=4)
    with pytest.warns(T.AmbiguousPatternWarning, match=r"matches p\['a'\]\['b'\] and p\['a/b'\], whose keys join "
                      r"to the same path 'p/a/b'") as said:
        both = T.apply_schedule(prog, mesh, [T.Shard("p/a/b", 1, "model")])
    assert str(said[0].message).endswith('e.g. r"re:^' + re.escape("p['a']['b']") + '$"')
    one = T.apply_schedule(prog, mesh, [T.Shard(r"re:^p\['a/b'\]$", 1, "model")])
    assert [[prog.name(d.value) for d in r.history[0].decisions] for r in (both, one)] == [
        ["p['a']['b']", "p['a/b']"], ["p['a/b']"]]


def test_save_writes_through_a_link_and_into_a_fifo(ctx):
    # A rename would put a regular file in place of the link or the FIFO (and, as root,
    # of /dev/null): the link's target is replaced, the FIFO written in place.
    plan = automap.partition(step, mesh=MESH, schedule=QUICK)(*ARGS)
    target, link, dangling = ctx.tmp / "target.json", ctx.tmp / "link.json", ctx.tmp / "dangling.json"
    target.write_text("old")
    link.symlink_to(target)
    dangling.symlink_to(ctx.tmp / "new.json")
    plan.save(link)
    plan.save(dangling)
    assert link.is_symlink() and dangling.is_symlink()
    assert json.loads(target.read_text()) == json.loads((ctx.tmp / "new.json").read_text()) == plan.to_json()
    fifo = ctx.tmp / "pipe.json"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so that the writer's open does not wait
    try:
        plan.save(fifo)  # a small plan: it fits the pipe's buffer
        chunks = iter(lambda: os.read(reader, 1 << 16), b"")
        got = b"".join(chunks)
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and json.loads(got) == plan.to_json()
    assert sorted(p.name for p in ctx.tmp.iterdir() if ".tmp" in p.name) == []


#: Threads saving one plan path at once, and the saves each makes: enough that two
#: threads' writes overlap many times.
THREADS, SAVES = 8, 25


def test_threads_saving_one_path_each_write_a_whole_file(ctx):
    plan = automap.partition(step, mesh=MESH, schedule=QUICK)(*ARGS)
    path, errors = ctx.tmp / "shared.json", []
    start = threading.Barrier(THREADS)

    def save():
        start.wait()
        try:
            for _ in range(SAVES):
                plan.save(path)
        except Exception as e:  # reported below, with the others
            errors.append(e)

    threads = [threading.Thread(target=save) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(path.read_text()) == plan.to_json()
    assert sorted(p.name for p in ctx.tmp.iterdir() if p.name.startswith(".shared")) == []


def test_memory_sizes_read_as_written():
    assert parse_memory("1e+9") == parse_memory("1E9") == parse_memory("1e9B") == 1e9
    assert parse_memory("16GiB") == 16 * 2**30 and parse_memory(".5 GB") == 5e8


def test_best_effort_takes_the_plan_and_skips_what_cannot_apply(ctx):
    plan = automap.partition(step, mesh=MESH, schedule=[T.Shard("y", 0, "data"), *QUICK], memory_limit=1,
                             best_effort=True)(*ARGS)
    assert not plan.cost.fits and plan.cost.memory_peak > 1
    assert plan.history[0].skipped and "matches no input" in plan.history[0].skipped
    assert plan.specs[1] == jax.sharding.PartitionSpec("data", None)


def test_a_failed_tactic_leaves_the_partitioning_as_it_was():
    # Shard "*" splits w (8 rows) and then fails on x, whose 6 rows 4 devices do not
    # divide: the step is skipped whole, w's split rolled back too.
    def f(w, x):
        return (x @ w.T).sum()

    prog = partir.lift(f, jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((6, 4), jnp.float32))
    mesh = partir.MeshSpec.of(data=4, model=2)
    res = T.apply_schedule(prog, mesh, [T.Shard("*", 0, "data"), T.Shard("w", 1, "model")], best_effort=True)
    fresh = partir.Partitioning(prog, mesh)
    assert res.history[0].skipped and res.history[0].partitioning.key() == fresh.key()
    assert [d.dim for d in res.partitioning.decisions] == [1]
    with pytest.raises(TacticError, match="cannot tile x"):
        T.apply_schedule(prog, mesh, [T.Shard("*", 0, "data")])


def test_python_numbers_are_traced_as_jax_jit_traces_them(ctx):
    fn = automap.jit(scalars, mesh=MESH, schedule=[T.Shard("x", 0, "data")], cache_dir=ctx.cache)
    x = jnp.arange(32.0).reshape(8, 4)
    for lr in (0.1, 0.2, 3):
        np.testing.assert_allclose(np.asarray(fn(x, lr)), np.asarray(jax.jit(scalars)(x, lr)))
    assert fn.stats["planned"] == 2 and fn.stats["memory_hits"] == 1  # a float, then an int: two signatures


def test_a_program_with_no_ops_plans_and_runs(ctx):
    fn = automap.jit(lambda x: x, mesh=MESH, schedule=[search.AutomaticPartition(max_episodes=5)], cache_dir=ctx.cache)
    x = jnp.arange(32.0).reshape(8, 4)
    np.testing.assert_array_equal(np.asarray(fn(x)), np.asarray(x))


def test_a_program_with_no_ops_through_the_cli(ctx, capsys):
    argv = ["search", "factories.py:identity", "--mesh", MESH, "--episodes", "3", *OUT, "--png", "p.png"]
    assert main(argv) == 0
    assert main(["show", "out.json", "--png", "shown.png"]) == 0
    assert "modeled step time" in capsys.readouterr().out
    assert (ctx.tmp / "p.png").stat().st_size > 0 and (ctx.tmp / "shown.png").stat().st_size > 0


@pytest.mark.parametrize("content", ["[]", '{"format": "automap-plan", "version": 1}', "{trunc"])
def test_a_broken_cache_entry_is_set_aside_and_the_plan_made_again(ctx, content):
    jit(ctx).plan_for(*ARGS)
    [entry] = ctx.cache.glob("*.json")
    good = entry.read_bytes()
    entry.write_text(content)
    again = jit(ctx)
    with pytest.warns(automap.PlanCacheWarning, match="cannot be used"):
        again.plan_for(*ARGS)
    assert again.stats == {"planned": 1, "memory_hits": 0, "disk_hits": 0}
    assert entry.read_bytes() == good
    assert (ctx.cache / (entry.name + ".broken")).read_text() == content
    third = jit(ctx)
    third.plan_for(*ARGS)
    assert third.stats["disk_hits"] == 1


def test_arguments_placed_elsewhere_are_moved_to_the_plan(ctx):
    fn = jit(ctx)
    w, x = jnp.ones((8, 4)), jnp.arange(64.0).reshape(8, 8)
    mesh = partir.MeshSpec.of(data=2, model=4).jax_mesh(jax.devices()[::-1])
    x_elsewhere = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model")))
    np.testing.assert_allclose(float(fn(w, x_elsewhere)), float(step(w, x)), rtol=1e-6)
