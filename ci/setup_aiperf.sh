#!/usr/bin/env bash
# Creates the virtual environment for the field-report replay with NVIDIA's aiperf load
# generator (aiperf 0.13.0 from PyPI; ~140 packages, no torch, the venv is ~1.2 GB), and
# the offline tokenizer aiperf needs, as a HuggingFace cache entry:
#
#   .cache/aiperf-hf/hub/models--local--quiesce-bpe/{refs/main,snapshots/<rev>/...}
#
# trained here by ci/aiperf_tokenizer.py (a byte-level BPE, vocabulary 4096, on the
# Shakespeare text bundled with aiperf; a few seconds). aiperf runs with
# `HF_HOME=.cache/aiperf-hf HF_HUB_OFFLINE=1 ... --tokenizer local/quiesce-bpe` and never
# reaches the hub (bench/replay/aiperf.py does that).
#
#   bash ci/setup_aiperf.sh                 # venv at .venv-aiperf, cache at .cache/aiperf-hf
#   AIPERF_VENV=/path/to/venv AIPERF_HF_HOME=/path/to/hf bash ci/setup_aiperf.sh
#
# It cannot share .venv: aiperf pins pydantic 2.14.4, pandas ~2.3.3 and pulls pytest 9.2,
# and it conflicts with ai-dynamo-runtime (pydantic<=2.13.5). quiesce itself is not
# installed there: aiperf only talks HTTP to the workers.
#
# Idempotent: skips the install when ${AIPERF_VENV}/.pip-installed is newer than this script;
# the tokenizer step does nothing when the cache entry is complete.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
AIPERF_VENV=${AIPERF_VENV:-.venv-aiperf}
case "$AIPERF_VENV" in /*) ;; *) AIPERF_VENV="$REPO/$AIPERF_VENV" ;; esac
AIPERF_HF_HOME=${AIPERF_HF_HOME:-.cache/aiperf-hf}
case "$AIPERF_HF_HOME" in /*) ;; *) AIPERF_HF_HOME="$REPO/$AIPERF_HF_HOME" ;; esac
PYTHON=${PYTHON:-python3}
STAMP=$AIPERF_VENV/.installed
PY=$AIPERF_VENV/bin/python
SPECS=("aiperf==0.13.0")

# shellcheck source=ci/lib.sh
source "$REPO/ci/lib.sh"  # pip_

# Two stamps: PIP_STAMP once aiperf is installed, STAMP (what make checks) only once the
# tokenizer is in place too, so that a failed tokenizer step is retried by the next make.
PIP_STAMP=$AIPERF_VENV/.pip-installed
if [ ! -f "$PIP_STAMP" ] || [ "$REPO/ci/setup_aiperf.sh" -nt "$PIP_STAMP" ]; then
    "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), "aiperf needs Python >= 3.10"'
    test -x "$PY" || "$PYTHON" -m venv "$AIPERF_VENV"
    echo "setup_aiperf: installing ${SPECS[*]} into $AIPERF_VENV (~2 min, ~1.2 GB)"
    T0=$SECONDS
    pip_ install --quiet "${SPECS[@]}"
    "$AIPERF_VENV/bin/aiperf" --help >/dev/null
    echo "setup_aiperf:   done in $((SECONDS - T0))s"
    touch "$PIP_STAMP"
fi
rm -f "$STAMP"
"$PY" "$REPO/ci/aiperf_tokenizer.py" --hf-home "$AIPERF_HF_HOME"
touch "$STAMP"
echo "setup_aiperf: ready ($("$PY" -m pip --disable-pip-version-check show aiperf 2>/dev/null | grep ^Version))"
