#!/usr/bin/env bash
# The NVML GPU-activity suite alone (tests/gpu/test_nvml.py) in a Python that already has
# a CUDA torch and pynvml (nvidia-ml-py), with no network: a GPU machine's own image.
# quiesce is installed from this checkout without dependencies (the core has none) into
# a private folder; pytest and pytest-asyncio come from wheels in $WHEELS when given
# (pip download pytest==9.2.0 pytest-asyncio==1.5.0 on a machine with network).
#
#   bash ci/gpu/nvml.sh                          # on the GPU machine
#   WHEELS=.whl QUIESCE_GPU_RESULTS=out bash ci/gpu/nvml.sh
#
# Environment: PYTHON (python3), WHEELS (none), QUIESCE_GPU_RESULTS (ci/gpu/results),
# QUIESCE_GPU_CLASS (H200), NVML_SUITE_TIMEOUT_S (600).
# Results: $RESULTS_DIR/nvml.{xml,json}. ci/gpu/vllm.sh runs the same suite in its own
# environment; this one needs no vLLM.
set -euo pipefail
cd "$(dirname "$0")/../.."
source ci/gpu/common.sh

PYTHON=${PYTHON:-python3}
SITE=$(mktemp -d /tmp/quiesce-nvml-site.XXXXXX)
trap 'rm -rf "$SITE"' EXIT

require_gpu
"$PYTHON" -c 'import torch, pynvml; assert torch.cuda.is_available(), "torch sees no GPU"'
wheels=()
if [[ -n ${WHEELS:-} ]]; then
    wheels=("$WHEELS"/*.whl)
fi
"$PYTHON" -m pip install --quiet --no-index --no-deps --no-build-isolation --no-compile \
    --target "$SITE" . "${wheels[@]}"
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
run_suite nvml "${NVML_SUITE_TIMEOUT_S:-600}" "$PYTHON" -p no:cacheprovider tests/gpu/test_nvml.py
