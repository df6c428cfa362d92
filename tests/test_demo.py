"""`automap demo` (what `make demo` runs) works end to end."""

import os
import pathlib
import subprocess
import sys

import pytest


# A subprocess that installs nothing but searches, explains and trains (about 20 s): the
# pieces it strings together have their own tests; `make test-all` runs the whole.
@pytest.mark.slow
def test_demo_searches_shows_and_trains():
    out = subprocess.run([sys.executable, "-m", "automap", "demo"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "AutomaticPartition" in text and "episodes" in text
    assert "params['layers'][*]['mlp']['w1']" in text and "Megatron('model')" in text
    assert "training steps: partitioned vs unpartitioned" in text
    assert "the parameters come back with the plan's shardings" in text


# The README's first example, as written (about 25 s: a 10 s search, compiles, two steps).
@pytest.mark.slow
def test_the_readme_first_example_splits_something(tmp_path):
    root = pathlib.Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    code = readme.split("### The decorator", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"AUTOMAP_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert out.returncode == 0, out.stderr
    assert "Megatron('model')" in out.stdout and "P(None, 'model')" in out.stdout
