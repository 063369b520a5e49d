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
# next to its tensorrt_llm, with --no-deps: only what is missing is added, and every
# package the image ships is held at its version (a conflict stops the script). Outside
# the container (no tensorrt_llm) it exits $ENGINE_ABSENT (ci/gpu/common.sh), which
# all.sh counts as skipped. Then `quiesce doctor trtllm` checks the installed sources for drift (its JSON
# goes to $RESULTS_DIR/trtllm-doctor.json), and tests/gpu/test_trtllm.py runs under a
# timeout. The suite runs even after a drift verdict, to show what drift does; the
# script then still exits non-zero. Needs PyPI for what the container lacks.
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
    echo "trtllm.sh: ENGINE ABSENT: $PYTHON has no tensorrt_llm: run this inside NVIDIA's" \
         "TensorRT-LLM release container (see the top of this script)" >&2
    exit "$ENGINE_ABSENT"
fi

# Never change what the image ships. quiesce goes in with --no-deps; then only the
# requirements (of the server extra, and the test tools) that are not installed at all are
# added, under constraints frozen from the container's whole `pip freeze`, so that pip
# fails rather than replace an installed package. A requirement that is installed at a
# version outside quiesce's pin is a conflict: the script stops and names it (set
# QUIESCE_TRTLLM_ALLOW_CONFLICTS=1 to keep the container's version and go on, warned).
constraints=$RESULTS_DIR/trtllm-constraints.txt
"$PYTHON" -m pip freeze --exclude-editable | grep -E '^[A-Za-z0-9._-]+==[^ ;]+$' \
    > "$constraints" || true
echo "trtllm.sh: $(wc -l < "$constraints") installed packages held by $constraints"
"$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps \
    --config-settings editable_mode=strict -e .

# Prints the requirements that are missing; exits 3 on a conflict (named on stderr).
check_requirements() {
    "$PYTHON" - "$@" <<'PY'
import importlib.metadata as md, os, sys
try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement
wanted = [r for r in md.requires("quiesce") or []
          if Requirement(r).marker is None
          or Requirement(r).marker.evaluate({"extra": "server"})]
wanted += sys.argv[1:]
missing, conflicts = [], []
for text in wanted:
    req = Requirement(text)
    req.marker = None
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        missing.append(str(req))
        continue
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        conflicts.append(f"{req.name} {have} is installed; quiesce wants {req}")
for line in conflicts:
    print(f"trtllm.sh: CONFLICT: {line}", file=sys.stderr)
print(" ".join(missing))
sys.exit(3 if conflicts and os.environ.get("QUIESCE_TRTLLM_ALLOW_CONFLICTS") != "1" else 0)
PY
}
TOOLS=('pytest==9.2.0' 'pytest-asyncio==1.5.0')
missing=$(check_requirements "${TOOLS[@]}") || {
    echo "trtllm.sh: the container's packages conflict with quiesce's pins (above); not" \
         "replacing them. Set QUIESCE_TRTLLM_ALLOW_CONFLICTS=1 to run with the" \
         "container's versions." >&2
    exit 1
}
if [[ -n $missing ]]; then
    echo "trtllm.sh: installing what is missing: $missing"
    # shellcheck disable=SC2086  # one word per requirement
    if ! "$PYTHON" -m pip install --quiet --disable-pip-version-check -c "$constraints" \
            $missing; then
        echo "trtllm.sh: CONFLICT: installing $missing would change packages the container" \
             "ships (pip refused under $constraints)" >&2
        exit 1
    fi
fi
check_requirements "${TOOLS[@]}" > /dev/null || exit 1

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
