"""``quiesce dynamo sglang`` and ``quiesce dynamo trtllm`` on an H200: Dynamo's own worker,
the real engine, Dynamo's real frontend. Written, **not run** (no GPU machine had
ai-dynamo with an engine; see docs/dynamo.md, Evidence).

What runs here on the CPU instead: the hooks against fakes
(tests/unit/test_dynamo_components_sglang.py, tests/unit/test_dynamo_components_trtllm.py)
and the hooked names against ai-dynamo 1.6.1's real source
(tests/integration/dynamo/test_contract_sglang.py, test_contract_trtllm.py).

Each test starts Dynamo's frontend and one ``quiesce dynamo ENGINE`` worker on the tiny
random-weight Llama (64-wide heads, as the other GPU suites), opens streams longer than
Dynamo's 5 s grace, sends SIGTERM to the worker's process group once each stream has its
first token, and reads every stream to its end. With an engine release quiesce's probe
was tested on, every stream completes and the worker exits 0 ``drained``; with another
one (ai-dynamo 1.6.1 pins SGLang 0.5.21, the SGLang probe is tested on 0.5.23) the probe
is UNKNOWN naming the version, so the drain must not claim ``drained`` (fail closed).

Needs: a GPU, ``dynamo`` (ai-dynamo 1.6.1) and the engine (``sglang`` or
``tensorrt_llm``) in this environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gpu.conftest import gpu_reason

_why = gpu_reason() or (None if importlib.util.find_spec("dynamo") else
                        "ai-dynamo is not installed")
if _why:
    pytest.skip(_why, allow_module_level=True)

from quiesce.adapters.sglang import TESTED_VERSIONS as SGLANG_TESTED  # noqa: E402
from quiesce.adapters.sglang import installed_sglang_version  # noqa: E402
from tests.integration.dynamo.processes import (  # noqa: E402
    dynamo_env,
    exit_report,
    free_port,
    frontend,
    wait_for_model,
    write_template,
)
from tests.integration.worker_process import (  # noqa: E402
    Worker,
    running,
    signal_group,
    stream_completion,
    tail,
)

pytestmark = [pytest.mark.slow]

STREAMS = 3
TOKENS = 400
BUDGET_S = 120
EXIT_TIMEOUT_S = 240.0
MEMORY_SHARE = "0.2"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CPU tests' tiny Llama with 2 heads of 64 (GPU attention kernels want 64+)."""
    from tests.integration.vllm import tiny_model as tiny

    saved = dict(tiny.CONFIG)
    tiny.CONFIG.update(hidden_size=128, head_dim=64, intermediate_size=256)
    try:
        return tiny.build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-dynamo"))
    finally:
        tiny.CONFIG.clear()
        tiny.CONFIG.update(saved)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, str]]:
    """(discovery store, chat template, frontend URL) of one module's Dynamo cluster."""
    directory = tmp_path_factory.mktemp("dynamo-gpu")
    (directory / "store").mkdir()
    template = write_template(directory)
    with frontend(directory / "store") as front:
        yield directory / "store", template, front.url


@contextlib.contextmanager
def _worker(engine: str, store: Path, args: list[str]) -> Iterator[Worker]:
    port = free_port()
    command = [sys.executable, "-m", "quiesce", "dynamo", engine, "--admin-port", str(port),
               "--budget", str(BUDGET_S), "--", *args]
    with running(command, dynamo_env(store), '"event": "ready"', timeout_s=900,
                 name=f"quiesce dynamo {engine}") as worker:
        worker.admin_port = port
        yield worker


async def _drain_under_load(engine: str, args: list[str], model: str,
                            cluster: tuple[Path, Path, str], *, probe_tested: bool) -> None:
    store, _, url = cluster
    with _worker(engine, store, args) as worker:
        wait_for_model(url, model, timeout_s=300)
        started = [asyncio.Event() for _ in range(STREAMS)]
        tasks = [asyncio.create_task(stream_completion(
            url, TOKENS, started=event, model=model, ignore_eos=True, include_usage=True,
            timeout_s=300)) for event in started]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        signal_group(worker.process.pid, signal.SIGTERM)
        results = await asyncio.gather(*tasks)
        # every stream ended: an untested engine is idle now, and the drain (waiting for
        # the budget) must still read it UNKNOWN, never quiescent
        status = None if probe_tested else worker.status()
        code, _ = await asyncio.to_thread(worker.finish, EXIT_TIMEOUT_S)
        report = exit_report(worker)
        assert report is not None, tail(worker.lines)
        if probe_tested:
            assert all(r.complete for r in results), f"{results}\n{tail(worker.lines)}"
            assert code == 0 and report["outcome"] == "drained", report
            requests = report["requests"]
            assert isinstance(requests, dict) and requests["completed"] == STREAMS, report
        else:  # fail closed: an untested engine release is never read idle
            assert status is not None and status["state"] == "draining", status
            assert status["inflight_requests"] == 0, status
            pending = status["pending_work"]
            assert isinstance(pending, dict) and pending["verdict"] == "unknown", status
            assert code != 0 and report["outcome"] != "drained", report


async def test_dynamo_sglang_drains_under_load(tiny_model: Path,
                                               cluster: tuple[Path, Path, str]) -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed")
    template = cluster[1]
    version = installed_sglang_version() or ""
    args = ["--model-path", str(tiny_model), "--mem-fraction-static", MEMORY_SHARE,
            "--context-length", "1024", "--custom-jinja-template", str(template)]
    await _drain_under_load("sglang", args, str(tiny_model), cluster,
                            probe_tested=version.split("+")[0] in SGLANG_TESTED)


async def test_dynamo_trtllm_drains_under_load(tiny_model: Path,
                                               cluster: tuple[Path, Path, str]) -> None:
    if importlib.util.find_spec("tensorrt_llm") is None:
        pytest.skip("TensorRT-LLM is not installed")
    template = cluster[1]
    args = ["--model", str(tiny_model), "--free-gpu-memory-fraction", MEMORY_SHARE,
            "--max-seq-len", "1024", "--custom-jinja-template", str(template)]
    await _drain_under_load("trtllm", args, str(tiny_model), cluster, probe_tested=True)
