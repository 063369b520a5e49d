#!/usr/bin/env bash
# Creates the virtual environment for the Dynamo discovery tests and benchmark: the real
# ai-dynamo-runtime 1.6.1 (a cp310-abi3 wheel, ~75 MB; the venv is ~280 MB; no GPU or CUDA
# needed to import or run it with the `file` discovery backend and the `tcp` request
# plane), pytest, and quiesce itself (editable, strict, no dependencies).
#
#   bash ci/setup_dynamo.sh                 # venv at .venv-dynamo
#   DYNAMO_VENV=/path/to/venv bash ci/setup_dynamo.sh
#
# It cannot share .venv: ai-dynamo-runtime 1.6.1 pins pydantic<=2.13.5, and the server
# extra's FastAPI stack there resolves to pydantic 2.14.
#
# Idempotent: skips the installs when ${DYNAMO_VENV}/.installed is newer than this script;
# it always redoes the (quick) editable install, since the link tree under build/ needs
# new modules to be linked.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
DYNAMO_VENV=${DYNAMO_VENV:-.venv-dynamo}
case "$DYNAMO_VENV" in /*) ;; *) DYNAMO_VENV="$REPO/$DYNAMO_VENV" ;; esac
PYTHON=${PYTHON:-python3}
STAMP=$DYNAMO_VENV/.installed
PY=$DYNAMO_VENV/bin/python
SPECS=("ai-dynamo-runtime==1.6.1" "pytest==9.2.0" "pytest-asyncio==1.5.0")

SOURCES_FILE=$DYNAMO_VENV/.sources
# shellcheck source=ci/lib.sh
source "$REPO/ci/lib.sh"  # pip_, editable_install

if [ ! -f "$STAMP" ] || [ "$0" -nt "$STAMP" ]; then
    "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), "Dynamo needs Python >= 3.10"'
    test -x "$PY" || "$PYTHON" -m venv "$DYNAMO_VENV"
    echo "setup_dynamo: installing ${SPECS[*]} into $DYNAMO_VENV"
    pip_ install --quiet "${SPECS[@]}"
    "$PY" -c 'from dynamo.runtime import DistributedRuntime' # imports without a GPU
fi
editable_install
touch "$STAMP"
echo "setup_dynamo: ready ($("$PY" -m pip --disable-pip-version-check show ai-dynamo-runtime 2>/dev/null | grep ^Version))"
