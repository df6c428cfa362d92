"""`make fuzz N=2000`: run N generated cases (`tests/generated.py`) through
`test_generated_programs_stay_equivalent` with the hypothesis profile `fuzz`.

A failing case is shrunk by hypothesis and saved as `tests/fuzz_regressions/<hash>.json`
(the case and the error), which `test_hand_made_and_saved_cases_stay_equivalent` replays in every
`make test`. The summary (cases, failures, wall time, what the cases covered) is printed
as a table and as one JSON line; record releases' runs in `docs/testing.md`.

    python tests/fuzz.py N [--seed S]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAVED = ROOT / "tests" / "fuzz_regressions"
TEST = "tests/test_properties.py::test_generated_programs_stay_equivalent"


def run(n: int, seed: int | None, work: Path) -> tuple[int, float, str]:
    """Run the cases; `(pytest's status, wall seconds, its output's tail)`."""
    env = {**os.environ, "AUTOMAP_FUZZ_N": str(n), "AUTOMAP_FUZZ_LOG": str(work / "cases.jsonl"),
           "AUTOMAP_FUZZ_FAILURE": str(work / "failure.json")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", TEST, "--hypothesis-profile=fuzz",
           "--hypothesis-show-statistics"] + (["--hypothesis-seed", str(seed)] if seed is not None else [])
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return done.returncode, time.perf_counter() - start, (done.stdout + done.stderr)[-6000:]


def save_failure(work: Path, output: str) -> Path | None:
    """The shrunk failing case, kept as a regression test."""
    failure = work / "failure.json"
    if not failure.is_file():
        return None
    case = json.loads(failure.read_text())
    name = hashlib.sha256(json.dumps(case, sort_keys=True).encode()).hexdigest()[:12]
    # The exception and where it was raised, from pytest's report.
    lines = output.splitlines()
    raised = [ln[1:].strip() for ln in lines if ln.startswith("E ") and "Error" in ln][:1]
    where = [ln for ln in lines if re.match(r"^\S+\.py:\d+: \w+", ln)][-1:]
    SAVED.mkdir(exist_ok=True)
    path = SAVED / f"{name}.json"
    path.write_text("{\n" + f' "found_by": "make fuzz",\n "error": {json.dumps(" at ".join(raised + where))},\n'
                    f' "case": {json.dumps(case)}\n' + "}\n")
    return path


def summary(work: Path, n: int, status: int, wall: float, saved: Path | None) -> dict:
    """What ran: cases passed, failures, wall time, and coverage counts."""
    log = work / "cases.jsonl"
    rows = [json.loads(ln) for ln in log.read_text().splitlines()] if log.is_file() else []
    ops = collections.Counter(op for r in rows for op in r["ops"])
    return {"cases_requested": n, "cases_passed": len(rows), "failures": int(status != 0), "wall_s": round(wall, 1),
            "share_applying_an_action": round(sum(r["applied"] >= 1 for r in rows) / max(len(rows), 1), 3),
            "share_with_a_refused_action": round(sum(r["refused"] >= 1 for r in rows) / max(len(rows), 1), 3),
            "plans": dict(collections.Counter(r["plan"] for r in rows)),
            "mesh_axes": dict(collections.Counter(str(r["mesh_axes"]) for r in rows)),
            "bf16_cases": sum(r["bf16"] for r in rows),
            "shard_map_cases": sum("shard_map" in r.get("lowerings", ()) for r in rows),
            "ops": dict(sorted(ops.items())),
            "saved_regression": str(saved.relative_to(ROOT)) if saved else None}


def main(argv=None) -> int:
    """Run, save a failure, print the summary; the status is pytest's."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("n", type=int, help="number of generated cases")
    p.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    ns = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="automap-fuzz-") as tmp:
        work = Path(tmp)
        status, wall, output = run(ns.n, ns.seed, work)
        saved = save_failure(work, output) if status else None
        result = summary(work, ns.n, status, wall, saved)
    if status:
        print(output)
    for k, v in result.items():
        print(f"{k:28s} {v}")
    print(json.dumps(result))
    return status


if __name__ == "__main__":
    sys.exit(main())
