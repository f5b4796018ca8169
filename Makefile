VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint typecheck clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m twophase.demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m bench

lint: $(STAMP)
	$(VENV)/bin/ruff check twophase tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info
