"""The `automap` command: `search`, `show`, `demo`.

    automap search TARGET --mesh data=2,model=4 [--schedule dp:data,megatron:model,auto]
                   [--device h100] [--memory 80GB] [--budget 30] [--episodes N] [--seed 0] --out plan.json
                   [--lowering jit|shard_map] [--quiet] [--json] [--png plan.png] [--timings]
                   [--best-effort] [--cache-dir DIR]
    automap show plan.json [--png plan.png]
    automap demo

TARGET is `path/to/file.py:factory` or `package.module:factory`; the factory returns
`(fn, example_args)` (abstract `jax.ShapeDtypeStruct`s allowed). Every user error (a bad
argument, an output path that cannot be written, a factory that fails, a tactic that
cannot apply, no plan within --memory) gets a one-line error naming the fix and exit
status 2; output paths are checked before the search starts (each its own file; a
picture's extension one matplotlib writes), and the target's function is traced before
it too. `search` also keeps the plan in the plan cache (`--cache-dir`, default as
`automap.jit`'s), where `automap.jit` finds it for the same program, mesh, schedule and
device. The outputs are written all or none: Ctrl-C stops with "interrupted, nothing
written" and exit status 130. `--out` through a symbolic link writes its target; onto
a FIFO or device (`/dev/null`, `/dev/stdout`) writes it in place.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import search
from tactics import WORDS, check

from ._args import LOWERINGS, Options

#: --schedule words (AXIS is a mesh axis name): the tactics' (`tactics.WORDS`), pipeline
#: stages over AXIS with M microbatches (R repeats: the circular schedule), and the
#: search on all axes or some.
SCHEDULE_WORDS = tuple(f"{w}:AXIS" for w in WORDS) + ("pp:AXIS:M[:R][:SCHEDULE]", "auto", "auto:AXIS+AXIS")
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


#: Exit status after Ctrl-C: 128 + SIGINT, as shells report a command SIGINT stopped.
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A bad command line: printed as one line, exit status 2."""


def parse_memory(text: str) -> float:
    """'80GB', '16GiB', '512MB', '1e9', '1E+9' -> bytes."""
    m = re.fullmatch(r"\s*((?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*([kmgt]i?b|b)?\s*", text, re.IGNORECASE)
    value = float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()] if m else 0.0
    check.number("--memory", value, sign="any", given=_cut(text), example="--memory 80GB", error=CliError)
    if value < 1:
        raise CliError(f"--memory {_cut(text)!r}: write a size of at least 1 byte like 80GB, 16GiB, 512MB or 8e10")
    return value


def parse_budget(text: str) -> float:
    """Seconds, positive and finite."""
    try:
        value = float(text)
    except ValueError:
        raise CliError(f"--budget {_cut(text)!r}: give the search time in seconds, a positive number like 30") from None
    return check.number("--budget", value, given=_cut(text), example="--budget 30 (seconds)", error=CliError)


def parse_count(text: str, flag: str, what: str) -> int:
    """The positive integer `text` of option `flag`, else a `CliError` saying `what` to
    give."""
    value = _positive(text)
    if value is None:
        raise CliError(f"{flag} {_cut(text)!r}: give {what}")
    return value


def parse_positions(text: str, flag: str) -> tuple[int, ...]:
    """'0,1' -> (0, 1): argument positions, non-negative integers, else a `CliError`."""
    words = [w.strip() for w in text.split(",")]
    if not all(w.isdigit() and len(w) <= check.SHOWN_CHARS for w in words):
        raise CliError(f"{flag} {_cut(text)!r}: give argument positions separated by commas, e.g. {flag} 0,1 "
                       "(the parameters and the optimizer state)")
    return tuple(sorted({int(w) for w in words}))


def _positive(text: str) -> int | None:
    """The positive integer `text` writes, or None."""
    try:
        value = int(text) if text.strip().isdigit() else 0
    except ValueError:  # more digits than Python reads (sys.get_int_max_str_digits)
        value = 0
    return value if value >= 1 else None


def _cut(text: str) -> str:
    """A user's text as quoted in a one-line error: cut when it is long (a number of 5000 digits)."""
    return text if len(text) <= check.SHOWN_CHARS else f"{text[:check.SHOWN_CHARS - 3]}..."


def parse_mesh(text: str):
    """'data=2,model=4' -> MeshSpec."""
    from partir import MeshSpec, PartitioningError

    try:
        return MeshSpec.parse(text)
    except PartitioningError as e:
        raise CliError(f"--mesh: {e}") from None


def parse_schedule(text: str, mesh, *, budget, seed, device, memory, episodes=None, pipelines=(), grad_accum=1):
    """'dp:data,megatron:model,pp:stage:4,auto' -> tactics; `pipelines` are the
    microbatch counts an `auto` may pipeline with, `grad_accum` the micro-batches a step
    it prices."""
    out = []
    for word in (w.strip() for w in text.split(",") if w.strip()):
        name, _, arg = word.partition(":")
        if name == "auto":
            axes = tuple(a for a in arg.split("+") if a) or None
            for a in axes or ():
                if a not in mesh.names:
                    raise CliError(f"--schedule {word!r}: {a!r} is not a mesh axis; the axes are {list(mesh.names)}")
            out.append(search.AutomaticPartition(axes=axes, budget_s=budget, seed=seed, device=device,
                                                 memory_limit=memory, max_episodes=episodes, best_effort=True,
                                                 pipelines=pipelines, grad_accum=grad_accum))
        elif name == "pp":
            out.append(_pipeline(word, arg, mesh))
        elif name in WORDS:
            if arg not in mesh.names:
                raise CliError(f"--schedule {word!r}: name a mesh axis after ':' (one of {list(mesh.names)})")
            out.append(WORDS[name](arg))
        else:
            raise CliError(f"--schedule: unknown tactic {word!r}; use comma-separated {', '.join(SCHEDULE_WORDS)}")
    if not out:
        raise CliError("--schedule is empty; e.g. --schedule dp:data,megatron:model or --schedule auto")
    return out


def _pipeline(word: str, arg: str, mesh):
    """The `Pipeline` of schedule word `word` ('pp:AXIS:M', 'pp:AXIS:M:R', R the
    chunks a stage, either followed by ':SCHEDULE', one of `partir.PIPELINE_SCHEDULES`:
    with R, the circular schedule or interleaved 1F1B), whose text after 'pp:' is `arg`."""
    from partir import PIPELINE_SCHEDULES
    from tactics import Pipeline, TacticError

    axis, _, counts = arg.partition(":")
    if axis not in mesh.names:
        raise CliError(f"--schedule {word!r}: name a mesh axis after 'pp:' (one of {list(mesh.names)}), "
                       "e.g. pp:stage:8")
    words = counts.split(":")
    schedule = words.pop() if len(words) > 1 and words[-1] in PIPELINE_SCHEDULES else "gpipe"
    parts = [_positive(p) for p in words]
    if not 1 <= len(parts) <= 2 or None in parts:
        raise CliError(f"--schedule {_cut(word)!r}: give the microbatch count after the axis, and optionally the "
                       f"chunks a stage (repeats), whole numbers >= 1, then optionally the schedule (one of "
                       f"{', '.join(PIPELINE_SCHEDULES)}), e.g. pp:{axis}:8, pp:{axis}:8:2, pp:{axis}:8:1f1b or "
                       f"pp:{axis}:8:2:1f1b (interleaved)")
    try:
        return Pipeline(axis, microbatches=parts[0], repeats=parts[1] if len(parts) == 2 else 1, schedule=schedule)
    except TacticError as e:
        raise CliError(f"--schedule {word!r}: {e}") from None


def parse_pipelines(text: str) -> tuple[int, ...]:
    """'4,8' -> (4, 8): the microbatch counts `--pipelines` lets the search pipeline with."""
    counts = [_positive(w) for w in text.split(",") if w.strip()]
    if not counts or None in counts:
        raise CliError(f"--pipelines {_cut(text)!r}: give microbatch counts, whole numbers >= 1 separated by "
                       "commas, e.g. --pipelines 4,8")
    return tuple(counts)


def load_target(target: str):
    """Import `file.py:factory` or `package.module:factory` and call the factory."""
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise CliError(f"TARGET {target!r}: write path/to/file.py:factory or package.module:factory")
    sys.path.insert(0, str(Path.cwd()))
    if module_part.endswith(".py"):
        path = Path(module_part).resolve()
        if not path.is_file():
            raise CliError(f"TARGET {target!r}: no file {module_part}")
        try:
            module = _import_file(path)
        except Exception as e:
            raise CliError(f"TARGET {target!r}: importing {module_part} failed ({type(e).__name__}: {e})") from None
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as e:
            raise CliError(f"TARGET {target!r}: cannot import {module_part} ({e})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CliError(f"TARGET {target!r}: {module_part} has no function {attr!r}")
    try:
        made = factory()
    except Exception as e:  # the user's code: one line, and how to see the rest
        raise CliError(f"TARGET {target!r}: {attr}() raised {_first_line(e)} (call it in Python to see the "
                       "traceback)") from None
    if not (isinstance(made, tuple) and len(made) == 2 and callable(made[0])):
        raise CliError(f"TARGET {target!r}: {attr}() must return (fn, example_args)")
    fn, args = made
    return fn, tuple(args) if isinstance(args, (tuple, list)) else (args,)


def trace_target(target: str, fn, args) -> None:
    """Trace the target's function on its example arguments, so that an error in the
    user's code (a shape mismatch, an exception it raises) is one line naming the
    target, before any work. JAX caches the trace, so planning's own trace of it costs little."""
    import jax

    try:
        jax.eval_shape(fn, *args)
    except Exception as e:  # the user's code, as for the factory
        name = getattr(fn, "__name__", "the function")
        raise CliError(f"TARGET {target!r}: tracing {name}(*example_args) raised {_first_line(e)} (call "
                       "jax.make_jaxpr on it in Python to see the traceback)") from None


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def _import_file(path: Path):
    """Import a .py file: as `package.module` when it sits in packages (so its own
    imports work), else as a stand-alone module."""
    parts, folder = [path.stem], path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    if len(parts) > 1:
        sys.path.insert(0, str(folder))
        return importlib.import_module(".".join(parts))
    name = f"automap_target_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="automap", description="SPMD auto-partitioning for JAX train steps.")
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("search", help="find a plan for a train step and save it")
    s.add_argument("target", help="path/to/file.py:factory or package.module:factory returning (fn, args)")
    s.add_argument("--mesh", required=True, help="axis sizes, e.g. data=2,model=4")
    s.add_argument("--schedule", default="auto", help="comma-separated tactics, e.g. dp:data,megatron:model,auto")
    s.add_argument("--device", default=Options.default("device"),
                   help=f"{', '.join(search.PRESETS)} or a .json/.toml (default: %(default)s)")
    s.add_argument("--memory", default=None, help="memory limit per device, e.g. 80GB (default: the device's)")
    s.add_argument("--budget", default=f"{Options.default('budget_s'):g}", help="search time in seconds")
    s.add_argument("--seed", default=str(Options.default("seed")), help="search seed")
    s.add_argument("--episodes", default=None,
                   help="stop the search after this many episodes (a plan that does not depend on the machine)")
    s.add_argument("--pipelines", default=None,
                   help="microbatch counts the search may pipeline a layer scan with, e.g. 4,8 (default: none)")
    s.add_argument("--grad-accum", default=None,
                   help="micro-batches a step the program (the step of one) runs with gradient accumulation: the "
                        "search chooses by the accumulated step (default: 1)")
    s.add_argument("--donate", default=None,
                   help="arguments the train step runs with donated (positions, e.g. 0,1): the memory limit is "
                        "held against the peak with their buffers reused, as jax.jit's donate_argnums")
    s.add_argument("--out", required=True, help="where to write the plan (JSON)")
    s.add_argument("--lowering", default=Options.default("lowering"), choices=LOWERINGS,
                   help="how the plan runs by default: jit (XLA places the collectives) or shard_map "
                        "(exactly the modeled collectives)")
    s.add_argument("--png", default=None, help="also draw the plan to this PNG")
    s.add_argument("--timings", action="store_true",
                   help="also write the search's timings beside the plan (plan.timing.json)")
    s.add_argument("--best-effort", action="store_true",
                   help="write the best plan even if it does not fit --memory (else an error)")
    s.add_argument("--cache-dir", default=None,
                   help="plan cache to keep the plan in for automap.jit (default: $AUTOMAP_CACHE_DIR or "
                        "~/.cache/automap)")
    s.add_argument("--quiet", action="store_true", help="print nothing but errors")
    s.add_argument("--json", action="store_true", help="print a JSON summary instead of tables")
    w = sub.add_parser("show", help="explain a saved plan")
    w.add_argument("plan")
    w.add_argument("--png", default=None, help="also draw the plan to this PNG")
    sub.add_parser("demo", help="search, show and run a plan for the built-in GPT on 8 simulated CPU devices")
    return p


def _settings(ns) -> dict:
    """Every argument of `search` checked, and every output path, before any work."""
    from ._api import cache_folder
    from ._args import distinct_outputs, output_path, picture_path
    from ._errors import AutomapError
    from ._plan import timing_path

    mesh = parse_mesh(ns.mesh)
    budget = parse_budget(ns.budget)
    try:
        seed = int(ns.seed)
    except ValueError:
        raise CliError(f"--seed {_cut(ns.seed)!r}: give an integer") from None
    try:
        device = search.get_device(ns.device)
    except search.DeviceError as e:
        raise CliError(f"--device: {e}") from None
    memory = parse_memory(ns.memory) if ns.memory is not None else None
    episodes = None if ns.episodes is None else parse_count(ns.episodes, "--episodes", "a positive integer like 200")
    try:
        out = output_path(ns.out, "--out")
        png = picture_path(ns.png, "--png") if ns.png else None
        timings = output_path(timing_path(out), "--timings file") if ns.timings else None
        distinct_outputs({"--out": out, "--timings file": timings, "--png": png})
        cache = cache_folder(ns.cache_dir, "--cache-dir")
    except AutomapError as e:
        raise CliError(str(e)) from None
    device_name = ns.device if not ns.device.endswith((".json", ".toml")) else device
    pipelines = parse_pipelines(ns.pipelines) if ns.pipelines is not None else ()
    grad_accum = 1 if ns.grad_accum is None else parse_count(ns.grad_accum, "--grad-accum",
                                                             "the micro-batches a step, a positive integer like 8")
    schedule = parse_schedule(ns.schedule, mesh, budget=budget, seed=seed, device=device_name, memory=memory,
                              episodes=episodes, pipelines=pipelines, grad_accum=grad_accum)
    donated = parse_positions(ns.donate, "--donate") if ns.donate is not None else ()
    return dict(mesh=mesh, budget=budget, device=device_name, memory=memory, out=out, png=png, cache=cache,
                schedule=schedule, lowering=ns.lowering, donated=donated)


def _search(ns) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ._api import partition

    cfg = _settings(ns)
    fn, args = load_target(ns.target)
    trace_target(ns.target, fn, args)
    quiet = ns.quiet or ns.json
    console = Console(stderr=True, quiet=quiet)
    with Progress(TextColumn("searching"), BarColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                  console=console, transient=True, disable=quiet) as bar:
        task = bar.add_task("search", total=cfg["budget"], info="")

        def progress(episodes, best, elapsed):
            bar.update(task, completed=min(elapsed, cfg["budget"]),
                       info=f"{episodes} episodes, best {best * 1e3:.3f} ms")

        schedule = [_with_progress(t, progress) for t in cfg["schedule"]]
        plan = _plan(partition, fn, args, cfg, schedule, ns.best_effort)
    out = cfg["out"]
    _write_outputs(plan, cfg, ns.timings)
    if ns.json:
        c = plan.cost
        print(json.dumps({"plan": str(out), "mesh": str(cfg["mesh"]), "step_time_s": c.step_time,
                          "memory_peak_bytes": c.memory_peak, "fits": c.fits, "lowering": plan.lowering,
                          "schedule": [str(t) for t in schedule]}))
    elif not ns.quiet:
        plan.explain()  # on the terminal, or wide when piped
        print(f"plan written to {out}")
    return 0


def _plan(partition, fn, args, cfg, schedule, best_effort):
    """The plan, or a one-line `CliError` for anything the user can fix."""
    from partir import PartitioningError

    from ._api import overflow
    from ._errors import MemoryLimitError

    try:
        return partition(fn, mesh=cfg["mesh"], schedule=schedule, device=cfg["device"], memory_limit=cfg["memory"],
                         best_effort=best_effort, lowering=cfg["lowering"], donate_argnums=cfg["donated"])(*args)
    except MemoryLimitError as e:
        raise CliError(f"no plan fits --memory: {overflow(e.plan.cost)}; use a larger --mesh, a remat policy in the "
                       "train step or a larger --memory, or --best-effort to write this plan") from None
    except (PartitioningError, search.DeviceError) as e:
        raise CliError(str(e).splitlines()[0]) from None


def _write_outputs(plan, cfg, timings: bool) -> None:
    """The plan, its timings and picture, and the plan cache's entry: all or none (an
    error or Ctrl-C before they are in place leaves no file)."""
    from ._cache import PlanCache
    from ._plan import Writes, stage_plot

    with Writes() as writes:
        plan.stage(writes, cfg["out"], timings=timings)
        if cfg["png"]:
            stage_plot(writes, plan.to_json(), cfg["png"], plan.timings())
        writes.commit(then=lambda: PlanCache(cfg["cache"]).store(plan))


def _with_progress(tactic, progress):
    import dataclasses

    if isinstance(tactic, search.AutomaticPartition):
        return dataclasses.replace(tactic, progress=progress)
    return tactic


def _show(ns) -> int:
    from ._args import picture_path
    from ._errors import AutomapError
    from ._explain import explain_saved
    from ._plan import Writes, stage_plot, timing_path
    from ._planfile import load_plan

    try:
        png = picture_path(ns.png, "--png") if ns.png else None
        saved = load_plan(ns.plan)
    except AutomapError as e:
        raise CliError(str(e)) from None
    explain_saved(saved.data)
    if png:
        with Writes() as writes:
            stage_plot(writes, saved.data, png, _timings(timing_path(ns.plan)))
            writes.commit()
    return 0


def _timings(path: Path) -> dict | None:
    """The timings saved beside a plan, if there are usable ones (they only draw the
    search's progress)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("elapsed_s"), (int, float)) and isinstance(
        data.get("trace"), list) and all(isinstance(t, list) and len(t) == 3 for t in data["trace"])
    return data if ok else None


def main(argv=None) -> int:
    """Entry point of the `automap` console script."""
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed a one-line usage error
        return int(e.code or 0)
    try:
        if ns.command == "search":
            return _search(ns)
        if ns.command == "show":
            return _show(ns)
        if ns.command == "demo":
            from ._demo import run

            return run()
        parser.print_help()
        return 2
    except CliError as e:
        print(f"automap: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # every output is staged until all are made (see _plan.Writes)
        print("automap: interrupted, nothing written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ValueError as e:  # automap's and partir's errors (the folder of --out gone mid-search, ...)
        from partir import PartitioningError

        if not isinstance(e, PartitioningError):
            raise
        print(f"automap: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
