#!/usr/bin/env bash
# Every GPU suite on this machine, one engine after another: runs each ci/gpu/<engine>.sh
# that exists (vllm, sglang, trtllm; override the list with QUIESCE_GPU_ENGINES and the
# folder with QUIESCE_GPU_SCRIPTS_DIR, which the unit tests use), keeps
# going after a failure, prints a table of the JSON summaries and exits non-zero if any
# engine script failed or none ran. An engine script that exits $ENGINE_ABSENT
# (ci/gpu/common.sh: its engine cannot run on this host, e.g. TensorRT-LLM outside its
# container) is counted as skipped, with its last output line as the reason.
#
#   bash ci/gpu/all.sh                       # from anywhere, on the GPU machine
#   QUIESCE_GPU_ENGINES="vllm" bash ci/gpu/all.sh
#
# Results: $RESULTS_DIR (ci/gpu/results unless QUIESCE_GPU_RESULTS is set): <suite>.xml
# (JUnit) and <suite>.json (summary) per suite, and each engine's log in <engine>.log.
# Summaries left from an earlier run are removed first, so the table shows this run only.
set -euo pipefail
cd "$(dirname "$0")/../.."
source ci/gpu/common.sh

require_gpu
rm -f "$RESULTS_DIR"/*.json "$RESULTS_DIR"/*.xml

scripts_dir=${QUIESCE_GPU_SCRIPTS_DIR:-ci/gpu}
ran=() failed=() missing=() skipped=()
for engine in ${QUIESCE_GPU_ENGINES:-vllm sglang trtllm}; do
    script=$scripts_dir/$engine.sh
    if [[ ! -f $script ]]; then
        missing+=("$engine")
        echo "all.sh: no $script: skipping $engine"
        continue
    fi
    echo "=== all.sh: $engine ($script) ==="
    rc=0
    bash "$script" 2>&1 | tee "$RESULTS_DIR/$engine.log" || rc=$?
    if [[ $rc -eq $ENGINE_ABSENT ]]; then
        reason=$(grep -v '^[[:space:]]*$' "$RESULTS_DIR/$engine.log" | tail -n 1 || true)
        skipped+=("$engine (${reason:-no reason given})")
        echo "=== all.sh: $engine SKIPPED: its engine is absent on this host ===" >&2
        continue
    fi
    ran+=("$engine")
    if [[ $rc -ne 0 ]]; then
        failed+=("$engine")
        echo "=== all.sh: $engine FAILED (exit $rc) ===" >&2
    fi
done

echo
shopt -s nullglob
summaries=("$RESULTS_DIR"/*.json)
python3 "$QUIESCE_GPU_COMMON_DIR/summarize.py" table ${summaries[@]+"${summaries[@]}"}
echo
echo "engines run: ${ran[*]:-none}; failed: ${failed[*]:-none}; no script: ${missing[*]:-none}"
for entry in ${skipped[@]+"${skipped[@]}"}; do
    echo "skipped: $entry"
done
echo "results: $RESULTS_DIR"
if [[ ${#failed[@]} -ne 0 || ${#ran[@]} -eq 0 ]]; then
    exit 1
fi
