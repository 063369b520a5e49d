"""Real vLLM on CPU: shared fixtures. These tests run in the vLLM virtual environment
(`make test` creates it with ci/setup_vllm_cpu.sh and runs them there); anywhere vLLM is
not installed they are skipped with that reason."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

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


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder the holding connector watches: while ``release_dir/release`` is absent,
    ``engine`` holds every finished request's KV blocks (tiny_model.holding_connector)."""
    return tmp_path_factory.mktemp("release")


def release(release_dir: Path) -> None:
    """Let the holding connector free the KV it holds, and every request's from now on."""
    (release_dir / "release").touch()


def hold(release_dir: Path) -> None:
    """Make the holding connector hold finished requests' KV again (until ``release``)."""
    (release_dir / "release").unlink(missing_ok=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model: Path, release_dir: Path) -> AsyncIterator[Any]:
    """One vLLM AsyncLLM per test module on ``tiny_model``, with the holding connector on
    ``release_dir``; shut down when the module is done."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from tests.integration.vllm.tiny_model import engine_kwargs, holding_connector

    args = AsyncEngineArgs(
        model=str(tiny_model), tokenizer=str(tiny_model), disable_log_stats=True,
        kv_transfer_config=holding_connector(release_dir), **engine_kwargs())
    llm = AsyncLLM.from_engine_args(args)
    try:
        yield llm
    finally:
        llm.shutdown()
