"""A real disaggregated pair on the CPU: a prefill worker must not leave before the decoder
pulled its KV cache over NIXL.

Two AsyncLLMs in this process (tiny random-weight Llama), both with vLLM's real
``NixlConnector`` over NIXL's UCX backend: a prefill engine P (``kv_producer``) and a
decode engine D (``kv_consumer``), each with its own NIXL side-channel port on the
loopback. vLLM 0.32 reads that port from ``VLLM_NIXL_SIDE_CHANNEL_PORT`` only (no config
field; ``nixl/base_scheduler.py``), inside the spawned EngineCore process, so the variable
is set around each engine's start. One pair serves both scenarios (start-up is ~50 s).

A request on P with ``do_remote_decode`` finishes after one token; P keeps its KV blocks
(finished, held for a KV send) until D reads them and notifies P, or until the lease
(``kv_lease_duration``) expires. The drain of P must wait for exactly that.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from quiesce import AdmissionGate, InMemoryDiscovery, Role, StageOutcome, Verdict
from quiesce.budget import Deadline
from quiesce.drain import DrainConfig, wait_quiescent
from quiesce.lifecycle import EventKind, Lifecycle, LifecycleEvent, State
from tests.integration.vllm.conftest import SKIP_REASON
from tests.integration.vllm.nixl_workers import environ

vllm = pytest.importorskip("vllm", reason=SKIP_REASON)

from quiesce.adapters.vllm import VllmProbe  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

LOOPBACK = "127.0.0.1"
KV_LEASE_S = 30
"""P's lease on held KV blocks (vLLM's own safety net): long enough not to expire in a test."""
PULL_DRAIN_BUDGET_S = 20.0
"""Generous for a pull that takes well under a second here, yet below the lease: a
``drained`` within it can only come from D's pull, never from the lease running out."""
FORCED_DRAIN_BUDGET_S = 2.0
WAIT_S = 60.0
"""Bound of every wait on an engine (a hang fails the test instead of stalling it)."""
DECODE_TOKENS = 8
FAST = DrainConfig(router_grace_s=0, poll_base_s=0.001, poll_cap_s=0.02, probe_timeout_s=5)


@dataclasses.dataclass
class Pair:
    prefill: Any
    decode: Any
    prefill_port: int
    decode_port: int


def free_loopback_ports(count: int) -> list[int]:
    """``count`` distinct ports free on the loopback right now (held open together)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                   for _ in range(count)]
        for sock in sockets:
            sock.bind((LOOPBACK, 0))
        return [sock.getsockname()[1] for sock in sockets]


def side_channel(port: int) -> contextlib.AbstractContextManager[None]:
    """Set the NIXL side channel for the engine started inside (its EngineCore is spawned
    with this environment and reads it there), then restore the previous values."""
    return environ({"VLLM_NIXL_SIDE_CHANNEL_HOST": LOOPBACK,
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)})


def start_engine(model: Path, kv_role: str, port: int) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from tests.integration.vllm.tiny_model import engine_kwargs

    args = AsyncEngineArgs(
        model=str(model), tokenizer=str(model), disable_log_stats=True, **engine_kwargs(),
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector", kv_role=kv_role,
            kv_connector_extra_config={"kv_lease_duration": KV_LEASE_S}))
    with side_channel(port):
        return AsyncLLM.from_engine_args(args)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pair(tiny_model: Path) -> AsyncIterator[Pair]:
    prefill_port, decode_port = free_loopback_ports(2)
    prefill = start_engine(tiny_model, "kv_producer", prefill_port)
    try:
        decode = start_engine(tiny_model, "kv_consumer", decode_port)
    except BaseException:
        prefill.shutdown()
        raise
    engines = Pair(prefill, decode, prefill_port, decode_port)
    try:
        yield engines
    finally:  # both at once: each one's teardown takes seconds
        await asyncio.gather(asyncio.to_thread(decode.shutdown),
                             asyncio.to_thread(prefill.shutdown))
    # Collect the stopped engines now: left to the interpreter's exit, AsyncLLM.__del__
    # calls shutdown() again after module globals are gone and prints a TypeError.
    engines.prefill = engines.decode = prefill = decode = None
    gc.collect()


def prompt() -> str:
    """A fresh prompt per test, so that D's own prefix cache never hits."""
    words = " ".join(f"w{n}" for n in uuid.uuid4().bytes[:12])
    return f"hello world the quick brown fox {words} jumps over the lazy dog"


async def run_prefill(engine: Any, text: str) -> dict[str, Any]:
    """One prefill request on P, to the end of its stream; returns its kv_transfer_params."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True}})

    async def stream() -> Any:
        final = None
        async for output in engine.generate(text, params, request_id=uuid.uuid4().hex):
            final = output
        return final

    final = await asyncio.wait_for(stream(), WAIT_S)
    assert final is not None and final.finished
    kv_params = final.kv_transfer_params
    assert isinstance(kv_params, dict), kv_params
    assert kv_params.get("do_remote_prefill") is True, kv_params
    return kv_params


async def run_decode(engine: Any, text: str, kv_params: dict[str, Any]) -> int:
    """The decode request on D for P's request: D pulls P's KV over NIXL, then generates.
    Returns how many tokens it produced."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=DECODE_TOKENS, min_tokens=DECODE_TOKENS,
                            temperature=0.0, extra_args={"kv_transfer_params": kv_params})

    async def stream() -> int:
        produced = 0
        async for output in engine.generate(text, params, request_id=uuid.uuid4().hex):
            produced = len(output.outputs[0].token_ids)
        return produced

    produced: int = await asyncio.wait_for(stream(), WAIT_S)
    return produced


async def assert_quiescent(probe: VllmProbe) -> None:
    report, last = await wait_quiescent(probe, Deadline.after(WAIT_S), FAST)
    assert report.outcome is StageOutcome.COMPLETED, last.summary()


def held(work: Any) -> int:
    count = work.kv_sends_held
    assert isinstance(count, int), work.summary()
    return count


async def serving_prefill(pair: Pair, name: str) -> tuple[VllmProbe, AdmissionGate, Lifecycle]:
    """P's probe, gate and lifecycle, serving; both engines quiescent to begin with."""
    probe = VllmProbe(pair.prefill, Role.PREFILL)
    await assert_quiescent(probe)
    await assert_quiescent(VllmProbe(pair.decode, Role.DECODE))
    gate = AdmissionGate()
    lifecycle = Lifecycle(gate=gate, probe=probe, discovery=InMemoryDiscovery(name),
                          config=FAST)
    await lifecycle.start()
    return probe, gate, lifecycle


async def test_prefill_drain_completes_only_after_the_decoder_pulled_the_kv(pair: Pair) -> None:
    probe, gate, lifecycle = await serving_prefill(pair, "prefill-pulled")
    text = prompt()
    async with gate.admit():
        kv_params = await run_prefill(pair.prefill, text)
    assert kv_params["remote_port"] == pair.prefill_port, kv_params

    # the stream ended: the frontend sees nothing, the engine holds the KV for D
    assert pair.prefill.output_processor.get_num_unfinished_requests() == 0
    work = await probe.pending_work()
    assert work.verdict is Verdict.BUSY, work.summary()
    assert held(work) >= 1

    engine_read = asyncio.Event()

    def on_event(event: LifecycleEvent) -> None:
        if event.kind is EventKind.PROBE_READ:
            engine_read.set()

    lifecycle.add_listener(on_event)
    run = await lifecycle.drain(budget_s=PULL_DRAIN_BUDGET_S)
    assert lifecycle.state is State.DRAINING
    assert run.report is None
    # once the run has read the engine, it is still draining: nothing pulled the KV yet
    await asyncio.wait_for(engine_read.wait(), WAIT_S)
    assert run.last_pending_work is not None
    assert held(run.last_pending_work) >= 1, run.last_pending_work.summary()
    assert lifecycle.state is State.DRAINING
    assert run.report is None

    # the decoder pulls: P is notified, frees the blocks, and the drain completes
    produced = await run_decode(pair.decode, text, kv_params)
    report = await run.wait(PULL_DRAIN_BUDGET_S + WAIT_S)
    assert report is not None and report.drained, lifecycle.last_error
    assert report.outcome is StageOutcome.COMPLETED
    assert lifecycle.state is State.DRAINED
    after = await probe.pending_work()
    assert after.is_quiescent, after.summary()
    assert held(after) == 0
    assert produced == DECODE_TOKENS
    await assert_quiescent(VllmProbe(pair.decode, Role.DECODE))
    await lifecycle.stop()


async def test_prefill_drain_whose_decoder_never_pulls_is_forced_never_drained(
        pair: Pair) -> None:
    probe, gate, lifecycle = await serving_prefill(pair, "prefill-abandoned")
    text = prompt()
    async with gate.admit():
        kv_params = await run_prefill(pair.prefill, text)

    # nobody pulls within the budget: the run ends forced, never with a false drained
    run = await lifecycle.drain(budget_s=FORCED_DRAIN_BUDGET_S)
    report = await run.wait(FORCED_DRAIN_BUDGET_S + WAIT_S)
    assert report is not None and not report.drained
    assert report.outcome is StageOutcome.TIMED_OUT
    assert lifecycle.state is State.DRAINING
    assert "kv_sends_held=1" in (lifecycle.last_error or ""), lifecycle.last_error
    assert held(await probe.pending_work()) == 1
    await lifecycle.stop()

    # Left alone, P's lease (kv_lease_duration=30 s, vLLM's own safety net) would free
    # the blocks ~30 s after the request finished. Instead the decoder pulls now, so the
    # pair ends quiescent and shuts down without waiting on held KV.
    assert await run_decode(pair.decode, text, kv_params) == DECODE_TOKENS
    await assert_quiescent(probe)
