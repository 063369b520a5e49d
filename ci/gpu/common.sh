# shellcheck shell=bash
# Shared helpers of the GPU suite scripts (ci/gpu/<engine>.sh). Source it from the
# repository root:
#
#   source ci/gpu/common.sh
#
# It turns on `set -euo pipefail` and sets
#   RESULTS_DIR   where suites write results: $QUIESCE_GPU_RESULTS, default ci/gpu/results
#                 (created; made absolute, so a later `cd` does not move it)
# and ENGINE_ABSENT (69, EX_UNAVAILABLE): the exit code of an engine script whose engine
# cannot run on this host at all (TensorRT-LLM outside NVIDIA's container); all.sh counts
# it as skipped, with the script's last output line as the reason. Not 2 (require_gpu and
# bad arguments), not 1-5 (pytest's own exit codes, which run_suite passes on) and not
# 124/137 (timeout).
# It defines, all safe under `set -euo pipefail`:
#   require_gpu                 print `nvidia-smi -L`; exit 2 with a clear message if no GPU
#   make_venv VENV [PYTHON]     create the virtual environment VENV with PYTHON (default
#                               $PYTHON or python3) unless VENV/bin/python exists
#   run_suite NAME TIMEOUT_S PYTHON [pytest args...]
#                               run `PYTHON -m pytest -ra -v -o junit_family=xunit1
#                               --junitxml=$RESULTS_DIR/NAME.xml (xunit1 keeps record_property)
#                               [args]` under `timeout TIMEOUT_S`, write $RESULTS_DIR/NAME.json
#                               (ci/gpu/summarize.py) and return pytest's exit code
#                               (124 when it timed out). Call it as
#                               `run_suite ... || rc=$?` to keep going after a failure.
#
# At the timeout pytest gets SIGINT first, so it still writes the JUnit XML of what ran;
# if it has not exited 60 s later it is killed.

set -euo pipefail

QUIESCE_GPU_COMMON_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RESULTS_DIR=${QUIESCE_GPU_RESULTS:-ci/gpu/results}
mkdir -p "$RESULTS_DIR"
RESULTS_DIR=$(cd "$RESULTS_DIR" && pwd)
export RESULTS_DIR
ENGINE_ABSENT=69
export ENGINE_ABSENT

require_gpu() {
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        echo "require_gpu: no GPU: nvidia-smi is not installed (no NVIDIA driver on this machine)" >&2
        exit 2
    fi
    local listing
    if ! listing=$(nvidia-smi -L 2>&1) || [[ $listing != *GPU* ]]; then
        echo "require_gpu: no GPU: nvidia-smi -L answered: ${listing:-nothing}" >&2
        exit 2
    fi
    echo "$listing"
}

make_venv() {
    local venv=${1:?make_venv VENV [PYTHON]}
    local python=${2:-${PYTHON:-python3}}
    if [[ ! -x $venv/bin/python ]]; then
        echo "make_venv: creating $venv with $python"
        "$python" -m venv "$venv"
    fi
}

_quiesce_now() {
    # Seconds since the epoch with a fraction (bash 5: EPOCHREALTIME; else date).
    if [[ -n ${EPOCHREALTIME:-} ]]; then
        echo "${EPOCHREALTIME/,/.}"
    else
        date +%s
    fi
}

run_suite() {
    local name=${1:?run_suite NAME TIMEOUT_S PYTHON [pytest args...]}
    local timeout_s=${2:?run_suite NAME TIMEOUT_S PYTHON [pytest args...]}
    local python=${3:?run_suite NAME TIMEOUT_S PYTHON [pytest args...]}
    shift 3
    local xml=$RESULTS_DIR/$name.xml json=$RESULTS_DIR/$name.json
    local rc=0 start end timed_out=()
    rm -f "$xml" "$json"
    echo "run_suite $name: timeout ${timeout_s}s: $python -m pytest $*"
    start=$(_quiesce_now)
    timeout --signal=INT --kill-after=60 "$timeout_s" \
        "$python" -m pytest -ra -v -o junit_family=xunit1 --junitxml="$xml" "$@" || rc=$?
    end=$(_quiesce_now)
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        timed_out=(--timed-out)
        echo "run_suite $name: TIMED OUT after ${timeout_s}s (exit $rc)" >&2
    fi
    local summarizer
    summarizer=$(command -v python3 || echo "$python")
    if ! "$summarizer" "$QUIESCE_GPU_COMMON_DIR/summarize.py" suite --name "$name" \
            --junit "$xml" --exit-code "$rc" \
            --duration "$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.3f", b - a }')" \
            ${timed_out[@]+"${timed_out[@]}"} --out "$json"; then
        echo "run_suite $name: could not write $json" >&2
    fi
    echo "run_suite $name: exit $rc; summary in $json"
    return "$rc"
}
