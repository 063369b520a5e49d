#!/usr/bin/env bash
# The vLLM GPU suite on an H200 (or any NVIDIA GPU with CUDA 12+): installs the CUDA
# build of vLLM and NIXL into their own virtual environment, then runs tests/gpu/test_vllm.py,
# which collects the CPU tier's scenarios again against the CUDA engine, and
# tests/gpu/test_nvml.py, the NVML GPU-activity signal on the real device (same environment:
# it needs the CUDA torch to make the GPU busy).
#
#   bash ci/gpu/vllm.sh [pytest args...]   # from anywhere, on the GPU machine
#
# Environment: VLLM_GPU_VENV (default .venv-vllm-gpu), PYTHON (python3), VLLM_VERSION
# (0.33.0), QUIESCE_GPU_RESULTS (ci/gpu/results), QUIESCE_GPU_CLASS (H200),
# VLLM_SUITE_TIMEOUT_S (3600), NVML_SUITE_TIMEOUT_S (600).
# Results: $RESULTS_DIR/vllm.{xml,json} and $RESULTS_DIR/nvml.{xml,json}.
#
# Needs network access to PyPI (the CUDA vLLM wheel is ~340 MB). It was prepared by
# reading vLLM 0.33's source; see the README for what has and has not been run.
set -euo pipefail
cd "$(dirname "$0")/../.."
source ci/gpu/common.sh

VENV=${VLLM_GPU_VENV:-.venv-vllm-gpu}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}

require_gpu
make_venv "$VENV" "$PYTHON"
"$VENV/bin/python" -m pip install --quiet "vllm==$VLLM_VERSION" "nixl[cu12]==1.5.1"
"$VENV/bin/python" -m pip install --quiet --config-settings editable_mode=strict -e '.[dev]'

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
vllm_rc=0 nvml_rc=0
run_suite vllm "${VLLM_SUITE_TIMEOUT_S:-3600}" "$VENV/bin/python" tests/gpu/test_vllm.py "$@" \
    || vllm_rc=$?
run_suite nvml "${NVML_SUITE_TIMEOUT_S:-600}" "$VENV/bin/python" tests/gpu/test_nvml.py \
    || nvml_rc=$?
if [[ $vllm_rc -ne 0 ]]; then
    exit "$vllm_rc"
fi
exit "$nvml_rc"
