# automap: `make demo` and `make test` work on a fresh machine (they create .venv).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install test test-slow test-all demo bench bench-scale bench-published fuzz clean

# make fuzz N=2000: generated cases against jax.jit (tests/fuzz.py; docs/testing.md)
N ?= 2000

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# Test workers: one per core, at most 4 (each simulates 8 devices and compiles on its own);
# loadgroup keeps the tests of one xdist_group (a published row) in one worker.
test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses=4 --dist loadgroup

# The `slow` tests alone (CI runs them after `make test`: .ci/run).
test-slow: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses=4 --dist loadgroup -m slow

test-all: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses=4 --dist loadgroup -m "" --hypothesis-profile=thorough

fuzz: $(STAMP)
	$(PY) tests/fuzz.py $(N)

demo: $(STAMP)
	$(PY) -m automap demo

bench: $(STAMP)
	$(PY) benchmarks/propagation.py
	$(PY) benchmarks/cost.py
	$(PY) benchmarks/cost_fidelity.py --pipelines --llama
	$(PY) benchmarks/search.py
	$(PY) benchmarks/lowering.py

bench-scale: $(STAMP)
	$(PY) benchmarks/scale.py
	$(PY) benchmarks/pipeline_scale.py

# Published training runs: modeled vs measured MFU, and the searched plan (benchmarks/published/).
bench-published: $(STAMP)
	$(PY) benchmarks/published.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
