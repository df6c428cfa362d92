"""A plan runs across processes: two processes of 4 simulated CPU devices each form one
`data=2, model=4` mesh (`jax.distributed`, gloo collectives), plan the GPT train step
independently, and train it with both lowerings to the losses and parameters of a
single-process run; their plan files are byte for byte the same."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from examples import gpt

STEPS = 3
WORKER = Path(__file__).with_name("multiprocess_worker.py")
ROOT = WORKER.parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, timeout: float = 240.0) -> None:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port), str(tmp_path), str(STEPS)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for i in range(2)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:  # a process left waiting for its peer must not outlive the test
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"


# Slow (14 s: two processes compile both lowerings): `make test-slow`, which CI runs.
@pytest.mark.slow
def test_two_processes_train_the_plan_of_one(tmp_path):
    _launch(tmp_path)
    for lowering in ("jit", "shard_map"):
        plans = [(tmp_path / f"plan-{i}-{lowering}.json").read_bytes() for i in range(2)]
        assert plans[0] == plans[1]
        assert json.loads(plans[0])["lowering"] == lowering
    step, args = gpt.make_train_step(gpt.GPTConfig(n_layers=2, adam_eps=1e-3))
    ref, state = [], tuple(args)
    for _ in range(STEPS):
        params, opt_state, loss = jax.jit(step)(*state)
        ref.append(float(loss))
        state = (params, opt_state, state[2])
    expected = [np.asarray(x) for x in jax.tree_util.tree_leaves(state[0])]
    for i in range(2):
        losses = json.loads((tmp_path / f"losses-{i}.json").read_text())
        for lowering in ("jit", "shard_map"):
            np.testing.assert_allclose(losses[lowering], ref, rtol=2e-5)
    for lowering in ("jit", "shard_map"):
        got = np.load(tmp_path / f"params-{lowering}.npz")
        assert len(got.files) == len(expected)
        for k, want in enumerate(expected):
            np.testing.assert_allclose(got[str(k)], want, rtol=2e-5, atol=2e-6, err_msg=f"{lowering} leaf {k}")
