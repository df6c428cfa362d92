"""`automap demo` (what `make demo` runs) works end to end."""

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
