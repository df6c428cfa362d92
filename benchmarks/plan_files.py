"""Plan files of the examples, to check that a change of code is no change of behaviour.

Writes the plan file of every example under each schedule of `SCHEDULES` and under an
episode-limited search (on the `cpu` and `h100` devices), one file per case, into a folder, and prints one SHA-256 per case and one
for all. Run it before and after a refactor (`git worktree add` the old commit) and
compare the lines: plans are deterministic, so equal code gives equal bytes.

Run: `python benchmarks/plan_files.py OUT_DIR [--episodes N]`.
"""

from __future__ import annotations

import os
import sys

sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
# The examples are not installed: import them from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import hashlib  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import automap  # noqa: E402
import search  # noqa: E402
import tactics as T  # noqa: E402
from examples import REGISTRY  # noqa: E402

#: The mesh every case is planned on.
MESH = "data=2,model=4"
#: Episodes of each search: enough to take several macros, few enough to run in minutes.
EPISODES = 40
#: Hand-written schedules (with best_effort: a tactic that does not apply is skipped).
SCHEDULES = {
    "dp": lambda: [T.DataParallel("data")],
    "dp+tp": lambda: [T.DataParallel("data"), T.Megatron("model")],
    "fsdp+tp+sp": lambda: [T.FSDP("data"), T.Megatron("model"), T.SequenceParallel("model")],
    "zero1+tp+remat": lambda: [T.DataParallel("data"), T.ZeRO("data", 1), T.Megatron("model"), T.Remat("dots")],
    "ep": lambda: [T.DataParallel("data"), T.ExpertParallel("model")],
}


def cases(episodes: int):
    """(name, example, schedule, device) of every case."""
    for name in sorted(REGISTRY):
        for schedule in SCHEDULES:
            yield f"{name}-{schedule}", name, SCHEDULES[schedule], "cpu"
        for device in ("cpu", "h100"):
            yield f"{name}-search-{device}", name, \
                lambda d=device: [search.AutomaticPartition(max_episodes=episodes, device=d)], device


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--episodes", type=int, default=EPISODES)
    ns = p.parse_args(argv)
    out = pathlib.Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    total = hashlib.sha256()
    for case, name, schedule, device in cases(ns.episodes):
        step, args = REGISTRY[name]()
        try:
            plan = automap.partition(step, mesh=MESH, schedule=schedule(), device=device, best_effort=True)(*args)
        except Exception as e:  # a strategy that does not apply to this example
            line = f"{case} error {type(e).__name__}"
        else:
            path = out / f"{case}.json"
            plan.save(path)
            line = f"{case} {hashlib.sha256(path.read_bytes()).hexdigest()}"
        total.update(line.encode())
        print(line, flush=True)
    print(f"all {total.hexdigest()}")


if __name__ == "__main__":
    main()
