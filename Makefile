# The two commands of the README. Both create .venv if missing and install what they need
# (idempotent: a stamp file records the installed pyproject.toml).
PY      ?= python3
VENV    := .venv
STAMP   := $(VENV)/.installed
BIN     := $(VENV)/bin

.PHONY: demo test lint install

demo: $(STAMP)
	$(BIN)/orchestrate --config configs/demo.toml

test: $(STAMP) lint
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install-system-deps.sh
	bash scripts/install-system-deps.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)
