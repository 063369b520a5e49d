# Every target sets up what it needs on a fresh machine, then runs.
#   make demo   - the field report's scale-down, fixed grace vs quiesce
#   make test   - lint, strict type check, and every test that needs no GPU, including
#                 the real vLLM engine on the CPU (in its own virtual environment)
#   make bench  - benchmarks; JSON results in bench/results/
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# vLLM's CPU build pins its own torch: it gets a virtual environment of its own.
VLLM_VENV := .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin

# The editable install is strict (a link tree under build/), so a new module needs a
# reinstall; the list of source files is part of the install stamp.
SOURCES := $(sort $(wildcard core/*.py core/*/*.py adapters/*.py adapters/*/*.py))

.PHONY: all demo test lint typecheck unit integration test-vllm bench clean FORCE
all: test

$(VENV)/.sources: FORCE
	@mkdir -p $(VENV)
	@echo '$(SOURCES)' | cmp -s - $@ || echo '$(SOURCES)' > $@

$(VENV)/.installed: pyproject.toml $(VENV)/.sources
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "quiesce needs Python >= 3.10"'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check \
		--config-settings editable_mode=strict -e '.[dev]'
	@touch $@

$(VLLM_VENV)/.installed: ci/setup_vllm_cpu.sh pyproject.toml $(VENV)/.sources
	VLLM_VENV=$(VLLM_VENV) bash ci/setup_vllm_cpu.sh

demo: $(VENV)/.installed
	$(BIN)/quiesce demo

lint: $(VENV)/.installed
	$(BIN)/ruff check .

typecheck: $(VENV)/.installed
	$(BIN)/mypy -p quiesce
	$(BIN)/mypy tests bench

unit: $(VENV)/.installed
	$(BIN)/pytest tests/unit

integration: $(VENV)/.installed
	$(BIN)/pytest tests/integration --ignore=tests/integration/vllm

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_BIN)/pytest tests/integration/vllm

test: lint typecheck $(VENV)/.installed $(VLLM_VENV)/.installed
	$(BIN)/pytest --ignore=tests/integration/vllm
	$(VLLM_BIN)/pytest tests/integration/vllm

bench: $(VENV)/.installed $(VLLM_VENV)/.installed
	$(BIN)/python -m bench
	$(VLLM_BIN)/python -m bench.vllm && $(VLLM_BIN)/python -m bench.shutdown

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
