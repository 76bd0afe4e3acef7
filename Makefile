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

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/pytest

# The inner loop: unit and in-process tests, none that starts a server, an engine, a worker
# or a browser (the `live` marker, tests/conftest.py). `make test` runs everything.
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -m "not live and not slow" -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) var .pytest_cache
