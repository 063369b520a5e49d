#!/usr/bin/env bash
# The vLLM GPU suite on an H200 (or any NVIDIA GPU with CUDA 12+): installs the CUDA
# build of vLLM and NIXL into their own virtual environment, then runs tests/gpu/test_vllm.py,
# which collects the CPU tier's scenarios again against the CUDA engine.
#
#   bash ci/gpu/vllm.sh              # from the repository root, on the GPU machine
#
# Needs network access to PyPI (the CUDA vLLM wheel is ~340 MB). It was prepared by
# reading vLLM 0.33's source; see the README for what has and has not been run.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${VLLM_GPU_VENV:-.venv-vllm-gpu}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}

nvidia-smi -L
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet "vllm==$VLLM_VERSION" "nixl[cu12]==1.5.1"
"$VENV/bin/python" -m pip install --quiet --config-settings editable_mode=strict -e '.[dev]'

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$VENV/bin/python" -m pytest tests/gpu/test_vllm.py -ra -v "$@"
