"""`python -m automap demo` (what `make demo` runs) works end to end."""

import subprocess
import sys


def test_demo_runs_and_matches_the_unpartitioned_loss():
    out = subprocess.run([sys.executable, "-m", "automap", "demo"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "params['layers'][0]['mlp']['w2']" in out.stdout and "P('model', None)" in out.stdout
    assert "collectives XLA inserted" in out.stdout and "all-reduce" in out.stdout
    assert "partitioned vs" in out.stdout
