#!/usr/bin/env bash
# The SGLang GPU suite on an H200 (or any NVIDIA GPU with CUDA 12+): installs SGLang's CUDA
# build and NIXL into their own virtual environment, then runs tests/gpu/test_sglang.py: a
# real prefill/decode pair over NIXL (the prefill probe must not read quiescent until the
# decode side took the KV), and the CPU tier's engine and worker scenarios collected again
# (probe over the real round trip, abort, signal guard, SIGTERM/SIGINT under streaming
# load delivered four ways, every stream read to its end).
#
#   bash ci/gpu/sglang.sh [pytest args...]   # from anywhere, on the GPU machine
#
# Environment: SGLANG_GPU_VENV (default .venv-sglang-gpu), PYTHON (python3.11: the wheel
# is cp311), SGLANG_VERSION (0.5.23), NIXL_SPEC (nixl[cu12]==1.5.1), QUIESCE_GPU_RESULTS
# (ci/gpu/results), QUIESCE_GPU_CLASS (H200), QUIESCE_GPU_MEMORY_UTILIZATION (0.2: each
# engine's mem_fraction_static; up to three engines share the GPU),
# QUIESCE_SGLANG_TRANSFER_BACKEND (nixl; mooncake needs RDMA), SGLANG_SUITE_TIMEOUT_S (3600).
# Results: $RESULTS_DIR/sglang.{xml,json}.
#
# Needs network access to PyPI (SGLang pins torch 2.14.1 with CUDA and flashinfer: several
# GB). Prepared by reading SGLang 0.5.23's source and running its engine on a CPU; not yet
# run on a GPU (see the README).
set -euo pipefail
cd "$(dirname "$0")/../.."
source ci/gpu/common.sh

VENV=${SGLANG_GPU_VENV:-.venv-sglang-gpu}
PYTHON=${PYTHON:-python3.11}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
NIXL_SPEC=${NIXL_SPEC:-nixl[cu12]==1.5.1}

require_gpu
make_venv "$VENV" "$PYTHON"
"$VENV/bin/python" -m pip install --quiet "sglang==$SGLANG_VERSION" "$NIXL_SPEC"
"$VENV/bin/python" -m pip install --quiet --config-settings editable_mode=strict -e '.[dev]'
# quiesce's SGLang plugin must be visible to every process SGLang starts
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
eps = [ep.name for ep in md.entry_points(group="sglang.srt.plugins")]
assert "quiesce" in eps, f"quiesce's sglang.srt.plugins entry point is missing: {eps}"
PY

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export QUIESCE_GPU_MEMORY_UTILIZATION=${QUIESCE_GPU_MEMORY_UTILIZATION:-0.2}
rc=0
run_suite sglang "${SGLANG_SUITE_TIMEOUT_S:-3600}" "$VENV/bin/python" tests/gpu/test_sglang.py \
    "$@" || rc=$?
exit "$rc"
