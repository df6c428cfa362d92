"""The `automap` command, through a subprocess as a user runs it."""

import json
import subprocess
import sys

import pytest

AUTOMAP = [sys.executable, "-m", "automap"]


def _run(*args, timeout=300):
    return subprocess.run([*AUTOMAP, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # (7 s; test_search_with_a_schedule_json_and_module_target runs the CLI's search by default)
def test_search_then_show(tmp_path):
    plan = tmp_path / "p.json"
    out = _run("search", "examples/gpt.py:factory", "--mesh", "model=8", "--budget", "3", "--device", "cpu",
               "--out", str(plan), "--png", str(tmp_path / "p.png"), "--timings")
    assert out.returncode == 0, out.stderr
    assert f"plan written to {plan}" in out.stdout and "modeled step time" in out.stdout
    data = json.loads(plan.read_text())
    assert data["mesh"] == {"model": 8} and data["search"]["actions"]
    # Timings are beside the plan, not in it; a search the clock stopped says so.
    assert "elapsed_s" not in data["search"] and "episodes" not in data["search"]
    assert data["search"]["reproducible"] == (data["search"]["stopped"] != "time budget")
    timing = json.loads((tmp_path / "p.timing.json").read_text())
    assert timing["episodes"] > 0 and "elapsed_s" in timing and timing["key"] == data["key"]
    assert (tmp_path / "p.png").stat().st_size > 10_000
    shown = _run("show", str(plan))
    assert shown.returncode == 0, shown.stderr
    assert "params['layers'][0]['mlp']['w1']" in shown.stdout and "modeled step time" in shown.stdout


def test_a_searched_plan_is_a_cache_hit_for_automap_jit(tmp_path):
    import automap
    import tactics as T
    from examples import mlp

    cache = tmp_path / "cache"
    out = _run("search", "examples.mlp:factory", "--mesh", "data=2,model=4", "--schedule", "dp:data,megatron:model",
               "--quiet", "--out", str(tmp_path / "p.json"), "--cache-dir", str(cache))
    assert out.returncode == 0, out.stderr
    [cached] = cache.glob("*.json")
    assert cached.read_bytes() == (tmp_path / "p.json").read_bytes()
    step, args = mlp.make_train_step()
    fn = automap.jit(step, mesh="data=2,model=4", schedule=[T.DataParallel("data"), T.Megatron("model")],
                     cache_dir=cache)
    fn.plan_for(*args)
    assert fn.stats == {"planned": 0, "memory_hits": 0, "disk_hits": 1}


def test_search_with_a_schedule_json_and_module_target(tmp_path):
    plan = tmp_path / "p.json"
    out = _run("search", "examples.mlp:factory", "--mesh", "data=2,model=4", "--schedule", "dp:data,megatron:model",
               "--lowering", "shard_map", "--donate", "1,0", "--json", "--out", str(plan))
    assert out.returncode == 0, out.stderr
    assert json.loads(plan.read_text())["donate_argnums"] == [0, 1]
    summary = json.loads(out.stdout)
    assert summary["schedule"] == ["DataParallel('data')", "Megatron('model')"] and summary["fits"]
    assert summary["lowering"] == json.loads(plan.read_text())["lowering"] == "shard_map"
    quiet = _run("search", "examples.mlp:factory", "--mesh", "data=8", "--schedule", "dp:data", "--quiet",
                 "--out", str(plan))
    assert quiet.returncode == 0 and quiet.stdout == ""


BAD = [
    (["search", "examples.mlp:factory", "--mesh", "data=two", "--out", "p.json"], "--mesh"),
    (["search", "examples.mlp:factory", "--mesh", "data=2,data=4", "--out", "p.json"], "unique"),
    (["search", "examples/nope.py:factory", "--mesh", "data=8", "--out", "p.json"], "no file examples/nope.py"),
    (["search", "examples.mlp", "--mesh", "data=8", "--out", "p.json"], "path/to/file.py:factory"),
    (["search", "examples.mlp:nope", "--mesh", "data=8", "--out", "p.json"], "has no function 'nope'"),
    (["search", "no_such_pkg.mod:f", "--mesh", "data=8", "--out", "p.json"], "cannot import no_such_pkg.mod"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--device", "h900", "--out", "p.json"], "--device"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--budget", "-3", "--out", "p.json"], "--budget"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--budget", "soon", "--out", "p.json"], "--budget"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--memory", "lots", "--out", "p.json"], "--memory"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--schedule", "pipeline:data", "--out", "p.json"],
     "unknown tactic"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--schedule", "dp:model", "--out", "p.json"],
     "name a mesh axis"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--out", "/no/such/dir/p.json"], "does not exist"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--lowering", "pmap", "--out", "p.json"],
     "invalid choice: 'pmap'"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--schedule", "pp:data", "--out", "p.json"],
     "give the microbatch count after the axis"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--schedule", "pp:data:4:2:1", "--out", "p.json"],
     "optionally the chunks a stage (repeats)"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--schedule", "pp:data:4:zigzag", "--out", "p.json"],
     "then optionally the schedule (one of gpipe, 1f1b)"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--schedule", "pp:stage:4", "--out", "p.json"],
     "name a mesh axis after 'pp:'"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--grad-accum", "0", "--out", "p.json"],
     "--grad-accum '0': give the micro-batches a step"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--donate", "params", "--out", "p.json"],
     "--donate 'params': give argument positions"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--donate", "0,7", "--out", "p.json"],
     "names argument 7"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--pipelines", "four", "--out", "p.json"],
     "--pipelines 'four'"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--pipelines", "9" * 5000, "--out", "p.json"],
     "give microbatch counts"),
    (["search", "examples.mlp:factory", "--mesh", "data=8", "--schedule", "pp:data:" + "9" * 5000, "--out",
      "p.json"], "give the microbatch count after the axis"),
    (["show", "/no/such/plan.json"], "no plan file"),
    (["search", "examples.mlp:factory"], "required"),
]


@pytest.mark.parametrize("args,expected", BAD, ids=[" ".join(a[:3]) + f"-{i}" for i, (a, _) in enumerate(BAD)])
def test_bad_arguments_get_one_line_and_status_2(args, expected, capsys):
    # In this process (the command's `main`), as the console script runs it: a new
    # interpreter per row would spend its time importing JAX. The console script's
    # own status and output are checked below, once.
    from automap._cli import main

    assert main(list(args)) == 2
    _one_line(capsys.readouterr().err, expected)


def test_the_console_script_answers_a_bad_argument_in_one_line_with_status_2():
    args, expected = BAD[0]
    out = _run(*args, timeout=120)
    assert out.returncode == 2
    _one_line(out.stderr, expected)


def _one_line(stderr: str, expected: str) -> None:
    assert "Traceback" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert expected in lines[-1], stderr
    assert lines[-1].startswith(("automap: error:", "usage:")) or "error:" in lines[-1]


INTERRUPTS = """
import jax, jax.numpy as jnp

def step(x):
    # Ctrl-C while the step is traced, as Python's SIGINT handler raises it. (Sending the
    # signal itself is asynchronous: under load it could land in a finalizer, which
    # swallows it, and the command then ran to the end.)
    raise KeyboardInterrupt

def factory():
    return step, (jax.ShapeDtypeStruct((8, 4), jnp.float32),)
"""


def test_ctrl_c_says_nothing_was_written_and_exits_130(tmp_path):
    (tmp_path / "interrupts.py").write_text(INTERRUPTS)
    out = _run("search", str(tmp_path / "interrupts.py:factory"), "--mesh", "data=8", "--schedule", "dp:data",
               "--out", str(tmp_path / "p.json"), "--cache-dir", str(tmp_path / "cache"), timeout=120)
    assert (out.returncode, out.stderr) == (130, "automap: interrupted, nothing written\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["interrupts.py"]


def test_ctrl_c_while_the_outputs_are_written_leaves_none(tmp_path, monkeypatch, capsys):
    # Ctrl-C while the picture is drawn: the plan file is made by then, and must not
    # be put in place, nor the plan cache's entry.
    import automap._plot
    from automap._cli import main

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(automap._plot, "plot", interrupted)
    try:
        status = main(["search", "examples.mlp:factory", "--mesh", "data=8", "--schedule", "dp:data", "--quiet",
                       "--out", str(tmp_path / "p.json"), "--png", str(tmp_path / "p.png"),
                       "--cache-dir", str(tmp_path / "cache")])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C came out of the automap command as a traceback")
    assert (status, capsys.readouterr().err) == (130, "automap: interrupted, nothing written\n")
    assert list(tmp_path.iterdir()) == []


_SCANNED_LLAMA = """
from examples import llama

def factory():
    return llama.make_train_step(llama.LlamaConfig(n_layers=4, scan_layers=True))
"""


def test_a_schedule_word_pipelines_a_layer_scan_and_show_prints_its_stages(tmp_path, capsys):
    from automap._cli import main

    target = tmp_path / "scanned.py"
    target.write_text(_SCANNED_LLAMA)
    plan = tmp_path / "plan.json"
    assert main(["search", f"{target}:factory", "--mesh", "data=4,stage=2", "--schedule", "dp:data,pp:stage:2",
                 "--json", "--out", str(plan)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["schedule"] == ["DataParallel('data')", "Pipeline('stage', microbatches=2)"]
    assert main(["show", str(plan)]) == 0
    shown = capsys.readouterr().out
    assert "in stages over 'stage', 2 microbatches, schedule gpipe" in shown
    # From the file alone: which layers each stage's devices run, and the modeled bubble.
    assert "pipeline stages over 'stage'" in shown and "modeled bubble 33%" in shown
    assert any(line.split("│")[1:4] == ["     1 ", " 2..3   ", " 1, 3, 5, 7 "] for line in shown.splitlines())


def test_a_pipeline_word_takes_the_circular_schedules_repeats_and_a_schedule():
    from automap._cli import parse_schedule
    from partir import MeshSpec
    from tactics import Pipeline

    mesh = MeshSpec.of(data=4, stage=2)
    words = parse_schedule("dp:data,pp:stage:4:2", mesh, budget=1, seed=0, device="cpu", memory=None)
    assert words[1] == Pipeline("stage", microbatches=4, repeats=2)
    assert parse_schedule("pp:stage:4", mesh, budget=1, seed=0, device="cpu", memory=None) == [Pipeline("stage", 4)]
    assert parse_schedule("pp:stage:8:1f1b", mesh, budget=1, seed=0, device="cpu", memory=None) == [
        Pipeline("stage", 8, schedule="1f1b")]
    assert parse_schedule("pp:stage:8:2:1f1b", mesh, budget=1, seed=0, device="cpu", memory=None) == [
        Pipeline("stage", 8, schedule="1f1b", repeats=2)]
