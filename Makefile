# Two commands for a newcomer: `make up` runs Atrium, `make test` tests it.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up test test-fast install lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# NOTE: torch is pinned in pyproject; this release's CPU build is on the machine's disk.
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# `make up PORT=9000` (or ATRIUM_PORT=9000) serves on another port.
up: $(STAMP)
	$(BIN)/atrium up $(if $(PORT),--port $(PORT))

# The order is shuffled each run (pytest-randomly prints the seed it used, and
# `PYTEST_ADDOPTS=--randomly-seed=N make test` replays it). `make test` runs on JOBS
# pytest-xdist workers (at most 3 share one Redis: platform/atrium/testing.py); the tests
# that start whole `atrium up`s and fleets share one of them (tests/conftest.py), the rest
# fill the others. `make test JOBS=0` runs everything in one process.
# `make test-fast` runs on FAST_JOBS workers.
JOBS ?= 2
FAST_JOBS ?= 2
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/vulture
	$(BIN)/pytest $(if $(filter-out 0,$(JOBS)),-n $(JOBS) --dist loadgroup)

# The inner loop: unit and in-process tests, none that starts a server, an engine, a worker
# or a browser (the `live` marker, tests/conftest.py). `make test` runs everything.
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -m "not live and not slow" -q $(if $(filter-out 0,$(FAST_JOBS)),-n $(FAST_JOBS))

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/vulture

clean:
	rm -rf $(VENV) var .pytest_cache
