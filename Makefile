# The two commands of the README. Both create .venv if missing and install what they need
# (idempotent: a stamp file records the installed pyproject.toml). `make test` also builds the
# engines the live tests run (a vLLM CPU env and llama.cpp's llama-server), cached outside the
# clone under ~/.cache/sprawl/engines, so only the first run pays for them (~13 min on 2 cores).
PY      ?= python3
VENV    := .venv
STAMP   := $(VENV)/.installed
BIN     := $(VENV)/bin
# mypy's cache outside the clone, like the engines: checked by content, so clones share it
MYPY_CACHE ?= $(HOME)/.cache/sprawl/mypy

.PHONY: demo test lint install engines

demo: $(STAMP)
	$(BIN)/python -m policies.codec.warm
	$(BIN)/orchestrate --config configs/demo.toml --run.name demo-$$(date +%Y%m%d-%H%M%S)

test: $(STAMP) lint engines
	$(BIN)/pytest -q

engines: $(STAMP)
	bash scripts/build-vllm-env.sh >/dev/null
	bash scripts/build-llama-server.sh >/dev/null

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy --cache-dir $(MYPY_CACHE)

install: $(STAMP)

# the verifiers environments the tests run, installed as users install theirs
VF_EXAMPLES := $(sort $(dir $(wildcard examples/verifiers/*/pyproject.toml)))

$(STAMP): pyproject.toml scripts/install-system-deps.sh scripts/constraints-cpu.txt \
		$(wildcard examples/verifiers/*/pyproject.toml)
	bash scripts/install-system-deps.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c scripts/constraints-cpu.txt -e '.[dev]'
	$(BIN)/python -m pip install --quiet -c scripts/constraints-cpu.txt $(addprefix -e ,$(VF_EXAMPLES))
	$(BIN)/python -m policies.codec.warm
	touch $(STAMP)
