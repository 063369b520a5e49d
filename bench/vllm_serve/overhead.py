"""The middleware's serving overhead (:mod:`bench.vllm_serve`): the same engine served by a
plain ``vllm serve`` and by one with quiesce's middleware, both up at once and loaded in
alternating rounds (so that drift of the machine lands on both alike), no signal.

The server not being measured is stopped (SIGSTOP to its process group, SIGCONT after):
an idle vLLM does not sleep (its model runner polls the shared-memory queue with
``sched_yield``), and on two cores an idle neighbour took a core from the measured one,
in some rounds and not others (throughput per round between 300 and 2,500 tokens/s, on
either arm, when both ran)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.integration.vllm.serve_process import paced, vllm_serve

STEP_S = 0.02
ROUNDS = 8
OVERHEAD_CONCURRENCY = 16
THROUGHPUT_TOKENS = 64
TTFT_REQUESTS = 20
TTFT_TOKENS = 4


@dataclasses.dataclass
class Overhead:
    tokens_per_s: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {"vllm_own": [], "quiesce": []})
    ttft_ms: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {"vllm_own": [], "quiesce": []})
    failed: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"vllm_own": 0, "quiesce": 0})
    identical_streams: bool | None = None
    """Whether a greedy stream's events were the same on both servers (ids and
    timestamps aside): the middleware passes vLLM's bytes through unchanged."""

    @property
    def throughput_ratio(self) -> float:
        return (statistics.median(self.tokens_per_s["quiesce"])
                / statistics.median(self.tokens_per_s["vllm_own"]))

    @property
    def ttft_p50_delta_ms(self) -> float:
        return (statistics.median(self.ttft_ms["quiesce"])
                - statistics.median(self.ttft_ms["vllm_own"]))


async def _stream(client: httpx.AsyncClient, url: str, tokens: int, prompt: str
                  ) -> tuple[float | None, int, list[str]]:
    """One greedy streaming completion: (seconds to the first token, tokens, events)."""
    body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "temperature": 0.0}
    start = time.perf_counter()
    first: float | None = None
    events: list[str] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
        if answer.status_code != 200:
            return None, 0, []
        async for line in answer.aiter_lines():
            if line.startswith("data: "):
                if first is None and line != "data: [DONE]":
                    first = time.perf_counter() - start
                events.append(line)
    chunks = sum(1 for e in events if e != "data: [DONE]" and '"error"' not in e)
    ok = events[-1:] == ["data: [DONE]"]
    return (first if ok else None), chunks, events


async def _throughput_round(client: httpx.AsyncClient, url: str, result: Overhead, arm: str
                            ) -> None:
    start = time.perf_counter()
    answers = await asyncio.gather(*(_stream(client, url, THROUGHPUT_TOKENS, f"load {n}")
                                     for n in range(OVERHEAD_CONCURRENCY)))
    elapsed = time.perf_counter() - start
    result.failed[arm] += sum(1 for first, _, _ in answers if first is None)
    result.tokens_per_s[arm].append(sum(tokens for _, tokens, _ in answers) / elapsed)


async def _ttft_round(client: httpx.AsyncClient, url: str, result: Overhead, arm: str) -> None:
    for n in range(TTFT_REQUESTS):
        first, _, _ = await _stream(client, url, TTFT_TOKENS, f"first token {n}")
        if first is None:
            result.failed[arm] += 1
        else:
            result.ttft_ms[arm].append(first * 1000)


def _comparable(events: list[str]) -> list[str]:
    """A stream's events without what differs per request (id, created)."""
    import json

    out = []
    for event in events:
        data = event[len("data: "):]
        if data == "[DONE]":
            out.append(data)
            continue
        chunk = json.loads(data)
        chunk.pop("id", None)
        chunk.pop("created", None)
        out.append(json.dumps(chunk, sort_keys=True))
    return out


@contextlib.contextmanager
def _paused(group: int) -> Iterator[None]:
    """The server whose process group is ``group`` stopped while inside."""
    os.killpg(group, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(group, signal.SIGCONT)


async def _measure(servers: dict[str, tuple[str, int]]) -> Overhead:
    """``servers``: arm → (URL, process group)."""
    result = Overhead()
    own_url, mine_url = servers["vllm_own"][0], servers["quiesce"][0]
    async with httpx.AsyncClient(timeout=120) as client:
        for arm, (url, _) in servers.items():  # warm-up, and the same greedy stream on both
            await _throughput_round(client, url, Overhead(), arm)
        _, _, own = await _stream(client, own_url, 16, "same prompt for both")
        _, _, mine = await _stream(client, mine_url, 16, "same prompt for both")
        result.identical_streams = _comparable(own) == _comparable(mine)
        arms = list(servers)
        for index in range(ROUNDS):
            for arm in arms if index % 2 == 0 else arms[::-1]:
                url = servers[arm][0]
                other = servers[arms[1] if arm == arms[0] else arms[0]][1]
                with _paused(other):
                    await _throughput_round(client, url, result, arm)
                    await _ttft_round(client, url, result, arm)
    return result


async def measure(model: Path) -> Overhead:
    """Both servers up (plain ``vllm serve`` and with the middleware), then the rounds."""
    with contextlib.ExitStack() as stack:
        pacing = ("--kv-transfer-config", paced(STEP_S))
        own = stack.enter_context(vllm_serve(model, *pacing, quiesce_args=None,
                                             middleware=False))
        mine = stack.enter_context(vllm_serve(model, *pacing, quiesce_args=""))
        return await _measure({"vllm_own": (own.url, own.process.pid),
                               "quiesce": (mine.url, mine.process.pid)})
