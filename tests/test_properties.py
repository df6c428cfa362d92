"""Generated programs (`tests/generated.py`): random programs of many primitives (dot
generals with any dimension numbers and batch dims, embedding gathers and scatters,
reshapes that split and merge dims, concatenates, pads, dynamic slices, `scan`,
`while`, `cond`, `jax.checkpoint`, int32 and bfloat16) on meshes of 1 to 3 axes,
partitioned by random tiles, random schedules of tactics or short searches, and checked
against `jax.jit` (values and gradients).

The default suite runs a few cases and replays the saved ones; `make fuzz N=2000`
(`tests/fuzz.py`) runs many, and saves a failing case, shrunk by hypothesis, to
`tests/fuzz_regressions/`, where `test_hand_made_and_saved_cases_stay_equivalent`
replays it (with hand-made cases that use every kind of op)."""

import json
import os
from pathlib import Path

import pytest
from hypothesis import event, given, reject

from generated import EXAMPLES, KINDS, Unsupported, cases, check_case, describe

SAVED = sorted((Path(__file__).parent / "fuzz_regressions").glob("*.json"))
REPLAYED = {f"example-{k}": case for k, case in EXAMPLES.items()} | {
    f"saved-{p.stem}": json.loads(p.read_text())["case"] for p in SAVED}


def _record(case, applied: int, refused: int) -> None:
    """For `make fuzz`: one line per case passed, in the file AUTOMAP_FUZZ_LOG names."""
    log = os.environ.get("AUTOMAP_FUZZ_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"applied": applied, "refused": refused, **describe(case)}) + "\n")


@given(case=cases())
def test_generated_programs_stay_equivalent(case):
    try:
        applied, refused = check_case(case)
    except Unsupported:
        reject()  # no oracle for this program on this backend: not a case
    except BaseException:
        # For `make fuzz`: the last case written is the one hypothesis shrank to (it
        # replays it last).
        failure = os.environ.get("AUTOMAP_FUZZ_FAILURE")
        if failure:
            Path(failure).write_text(json.dumps(case))
        raise
    event(f"plan: {case['plan']['kind']}; {min(applied, 3)}{'+' if applied > 3 else ''} actions applied, "
          f"{'some' if refused else 'none'} refused")
    _record(case, applied, refused)
    # The first tile of every plan applies (it is drawn among those that divide), so a
    # case whose other actions are refused still checks a partitioned program.
    assert applied >= 1, case["plan"]


def test_the_examples_use_every_kind_of_op():
    assert sorted({op[0] for case in EXAMPLES.values() for op in case["recipe"]}) == sorted(KINDS)
    assert {case["plan"]["kind"] for case in EXAMPLES.values()} == {"tiles", "schedule", "search"}


@pytest.mark.parametrize("name", sorted(REPLAYED))
def test_hand_made_and_saved_cases_stay_equivalent(name):
    applied, _ = check_case(REPLAYED[name])
    assert applied >= 1
