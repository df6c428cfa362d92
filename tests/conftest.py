"""Every test runs with 8 simulated CPU devices.

The flag must be set before JAX initialises its backend, which happens at the first
device query, so it is set here, at import time of the test session.
"""

import os
import tempfile

# The examples are not installed: this process finds them through pytest's `pythonpath`
# (pyproject.toml), and the subprocesses tests start (the CLI, a restarted job, a second
# process) through PYTHONPATH.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
# Plans cached by automap.jit go to a fresh folder, never to the user's cache.
os.environ["AUTOMAP_CACHE_DIR"] = tempfile.mkdtemp(prefix="automap-test-cache-")
# XLA:CPU's LLVM backend at optimization level 0: what the tests compare (values against
# `jax.jit` compiled the same way, the HLO's collectives, buffer assignment's memory) is
# decided before LLVM runs, and the suite spends a third of its time compiling (measured:
# test_remat + test_cost 70 s -> 49 s). A level the user sets wins.
_LEVEL = "" if "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "") else \
    " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + _LEVEL + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same program (the plain-jit reference of an example under each
# plan, a plan in-process and again in a subprocess): XLA's persistent cache, in a folder
# of this run only, compiles each once. Set in the environment so that the tests'
# subprocesses share it too, and named by pytest-xdist's run id so that its workers do.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
_XLA_CACHE = os.path.join(tempfile.gettempdir(), f"automap-test-xla-cache-{_RUN}") if _RUN else \
    tempfile.mkdtemp(prefix="automap-test-xla-cache-")
os.makedirs(_XLA_CACHE, exist_ok=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# JAX writes an entry in place, not through a rename: a process reading one that another
# is writing warns and compiles. This process lets it go (`pytest_configure`), and so do
# the subprocesses, whose stderr some tests read line by line.
_TORN = "ignore:Error reading persistent compilation cache entry:UserWarning"
os.environ["PYTHONWARNINGS"] = ",".join(w for w in (os.environ.get("PYTHONWARNINGS"), _TORN) if w)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from hypothesis import HealthCheck, settings  # noqa: E402

# Each generated program compiles twice on 8 devices: keep the default run short (the
# hand-made cases of tests/generated.py cover every kind of op whatever is drawn), and
# let `make test-all` (`--hypothesis-profile=thorough`) run many more.
settings.register_profile("automap", max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# `make fuzz N=...` (tests/fuzz.py): N generated cases, shrunk on failure.
settings.register_profile("fuzz", max_examples=int(os.environ.get("AUTOMAP_FUZZ_N", "2000")), deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.filter_too_much])
settings.load_profile("automap")


def _usable_cpus() -> int:
    """The CPUs this process may run on: its affinity set, cut to the cgroup's CPU quota
    where one is set (a container's `cpu.max`)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def pytest_configure(config):
    # After pyproject.toml's "error", so it wins for this one warning.
    config.addinivalue_line("filterwarnings", _TORN)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per usable CPU. pytest-xdist's own count is psutil's
    *physical* cores when psutil is installed (flax brings it): 1 on a 2-vCPU machine
    whose vCPUs are one core's two threads, which ran this suite serially, 1.9x slower
    than on a machine whose 2 vCPUs are 2 cores; and every core of the host inside a
    container with a CPU quota."""
    return _usable_cpus()
