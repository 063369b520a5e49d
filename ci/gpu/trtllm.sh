#!/usr/bin/env bash
# The TensorRT-LLM GPU suite on an H200, inside NVIDIA's TensorRT-LLM release container
# (TensorRT-LLM is not installable from PyPI: its package there is a stub that downloads
# from NVIDIA's own index, and it needs CUDA, TensorRT and NCCL to import at all):
#
#   docker run --rm --gpus all --ipc=host -v "$PWD":/work -w /work \
#       -e QUIESCE_TRTLLM_MODEL=/models/<a small local HF checkpoint> -v /models:/models \
#       nvcr.io/nvidia/tensorrt-llm/release:1.2.1 bash ci/gpu/trtllm.sh
#
# (pick the image tag of the TensorRT-LLM version under test; 1.2.1 was the newest
# release when this was written.) quiesce is installed into the container's own Python,
# next to its tensorrt_llm, with the engine's packages held at the versions the image
# ships. Then `quiesce doctor trtllm` checks the installed sources for drift (its JSON
# goes to $RESULTS_DIR/trtllm-doctor.json), and tests/gpu/test_trtllm.py runs under a
# timeout. The suite runs even after a drift verdict, to show what drift does; the
# script then still exits non-zero. Needs PyPI for quiesce's server extra and pytest.
#
# Written from the project's research notes and the public TensorRT-LLM source; it has
# not been run (see the README's evidence level for TensorRT-LLM).
set -euo pipefail
cd "$(dirname "$0")/../.."
source ci/gpu/common.sh

require_gpu
PYTHON=${PYTHON:-python3}
TIMEOUT_S=${QUIESCE_TRTLLM_TIMEOUT_S:-3600}

if ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("tensorrt_llm") is None)'; then
    echo "trtllm.sh: $PYTHON has no tensorrt_llm: run this inside NVIDIA's TensorRT-LLM" \
         "release container (see the top of this script)" >&2
    exit 2
fi

# Hold what the image ships for the engine; install quiesce and the test tools around it.
constraints=$RESULTS_DIR/trtllm-constraints.txt
"$PYTHON" -m pip freeze | grep -iE '^(tensorrt|torch|triton|transformers|nvidia-|flashinfer|mpi4py|cuda-)' \
    > "$constraints" || true
"$PYTHON" -m pip install --quiet --disable-pip-version-check -c "$constraints" \
    --config-settings editable_mode=strict -e '.[server]' \
    'pytest==9.2.0' 'pytest-asyncio==1.5.0'

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

doctor_rc=0
"$PYTHON" -m quiesce doctor trtllm || doctor_rc=$?
"$PYTHON" -m quiesce doctor trtllm --json > "$RESULTS_DIR/trtllm-doctor.json" || true
if [[ $doctor_rc -ne 0 ]]; then
    echo "trtllm.sh: quiesce doctor trtllm exited $doctor_rc (1: drift, 6: no sources);" \
         "running the suite anyway" >&2
fi

rc=0
run_suite trtllm "$TIMEOUT_S" "$PYTHON" tests/gpu/test_trtllm.py "$@" || rc=$?
if [[ $rc -eq 0 && $doctor_rc -ne 0 ]]; then
    rc=$doctor_rc
fi
exit "$rc"
