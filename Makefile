# Two commands for a newcomer: `make up` runs Atrium, `make test` tests it.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up test install lint clean

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

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) var .pytest_cache
