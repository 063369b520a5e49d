"""vLLM on an H200 with the CUDA build: the same scenarios as on the CPU.

Run by ``ci/gpu/vllm.sh`` (which installs the CUDA vLLM and NIXL); skipped, with the
reason, where there is no GPU or no vLLM (tests/gpu/conftest.py). The scenarios are the
CPU tier's own test functions, collected here again so that both tiers can never drift
apart: busy/idle, KV held by a connector until released, a drain that waits for the KV
and never lies, the board waking a drain, abort, drift, the probe after shutdown, two DP
engines (KV held on the second rank), a real NIXL prefill/decode pair
(two engines on one GPU, each with a share of its memory: QUIESCE_GPU_MEMORY_UTILIZATION),
SIGTERM to ``quiesce serve --engine vllm`` under streaming load, and the signal deliveries
of test_vllm_signals (main process, process group, SIGINT to the group, every process,
EngineCore killed mid-drain): on vLLM 0.33 they also check that the plugin still wraps
vLLM's own handlers there (the ready line's ``signal_guard``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.gpu.conftest import gpu_reason

REQUIRES = ("vllm", "nixl")

_why = gpu_reason() or next((f"engine not installed: {m}" for m in REQUIRES
                             if importlib.util.find_spec(m) is None), None)
if _why:
    pytest.skip(_why, allow_module_level=True)

# Up to six engines share the GPU at once: the collected modules' engines are all
# module-scoped here (the NIXL pair, the probe tests' engine, the two DP engines) and the
# worker test starts one more in its own process.
# tests/integration/vllm/tiny_model.py:engine_kwargs reads it.
os.environ.setdefault("QUIESCE_GPU_MEMORY_UTILIZATION", "0.12")

from tests.integration.vllm.conftest import (  # noqa: E402, F401 (fixtures)
    engine,
    release_dir,
    tiny_model,
)
from tests.integration.vllm.test_nixl_pair import *  # noqa: E402, F403
from tests.integration.vllm.test_vllm_dp import *  # noqa: E402, F403
from tests.integration.vllm.test_vllm_probe import *  # noqa: E402, F403
from tests.integration.vllm.test_vllm_signals import *  # noqa: E402, F403
from tests.integration.vllm.test_vllm_worker import *  # noqa: E402, F403

# The star imports brought each module's own marks; this module's are all of them.
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
