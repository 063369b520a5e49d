"""Real vLLM on CPU: shared fixtures. These tests run in the vLLM virtual environment
(`make test` creates it with ci/setup_vllm_cpu.sh and runs them there); anywhere vLLM is
not installed they are skipped with that reason."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
NO_VLLM = importlib.util.find_spec("vllm") is None
SKIP_REASON = ("vLLM is not installed in this environment: these tests run in .venv-vllm "
               "(make test sets it up with ci/setup_vllm_cpu.sh)")

# Engines are started offline, on the CPU, with a small KV cache; spawned engine
# processes must find this repository (the test connector is imported by path).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not NO_VLLM:
        return
    for item in items:
        if "tests/integration/vllm" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama with a locally built tokenizer (no hub is reachable)."""
    from tests.integration.vllm.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
