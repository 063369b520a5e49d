"""The full shutdown path with a real vLLM engine on the CPU: `quiesce serve --engine vllm`
under streaming load, then SIGTERM: zero lost streams, a clean exit within the budget.
The GPU suite (tests/gpu/test_vllm.py) runs the same with the CUDA build."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.integration.vllm.conftest import SKIP_REASON
from tests.integration.worker_process import start_worker, stream_completion

pytest.importorskip("vllm", reason=SKIP_REASON)

pytestmark = [pytest.mark.slow]

BUDGET_S = 60.0


async def test_sigterm_under_streaming_load_loses_nothing(tiny_model: Path) -> None:
    from tests.integration.vllm.tiny_model import engine_kwargs

    kwargs = engine_kwargs()
    engine = ["--engine", "vllm", "--model", str(tiny_model),
              "--max-model-len", str(kwargs["max_model_len"]), "--dtype", kwargs["dtype"]]
    if "gpu_memory_utilization" in kwargs:
        engine += ["--gpu-memory-utilization", str(kwargs["gpu_memory_utilization"])]
    with start_worker("--budget", str(BUDGET_S), "--router-grace", "0.2", engine=tuple(engine),
                      startup_timeout=300) as worker:
        started = asyncio.Event()
        streams = [asyncio.create_task(stream_completion(worker.url, 48, started=started))
                   for _ in range(6)]
        await asyncio.wait_for(started.wait(), timeout=120)
        worker.signal()
        code, report = await asyncio.to_thread(worker.finish, BUDGET_S + 30)
        results = await asyncio.gather(*streams)
    assert code == 0, report
    assert report is not None and report["drained"] is True
    assert report["aborted_requests"] == 0
    for result in results:
        assert result.status == 200 and result.done and result.error is None, result
        assert result.tokens > 0
