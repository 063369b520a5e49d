"""The simulated LLM engine: the default engine of the demo, benchmarks and tests.

:class:`SimEngine` is an asyncio engine with a waiting queue, a running batch and a
per-token time model (prefill cost per prompt token, one decode step per output
token for the whole batch). It models the parts of disaggregated serving that make
shutdown dangerous:

- a request with ``remote_decode`` (this worker prefills, another decodes) ends its
  stream here but keeps its KV blocks **held** until a simulated decoder pulls them
  after ``kv_pull_latency_s``; a request with ``never_pulled`` is never pulled (the
  decoder died), so only an abort frees it;
- a request with ``remote_prefill`` (this worker decodes) first **awaits** its KV for
  ``kv_recv_latency_s`` before it can be scheduled.

Freeing held KV before the pull (``abort_all``) is what corrupts a real decode
worker; the engine records it so the demo can count it as a failed request.

Deterministic under ``seed``: every random choice (pull latencies) comes from one
``random.Random(seed)``; only wall-clock jitter of the event loop can shift timings.
``time_scale`` multiplies every simulated duration, so a demo can compress time.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import heapq
import random
import time
from collections import deque
from collections.abc import AsyncIterator
from enum import Enum

from quiesce.budget import check_seconds
from quiesce.errors import ConfigError, RequestAborted
from quiesce.eta import DrainEta


class KVFate(str, Enum):
    PULLED = "pulled"
    FREED_EARLY = "freed_early"


SIM_ETA_BASIS = "the step loop's schedule of the remaining tokens (simulated)"


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """The simulated engine's time model, in simulated seconds (scaled by ``time_scale``)."""

    max_running: int = 64
    decode_step_s: float = 0.02
    prefill_s_per_token: float = 0.00002
    kv_pull_latency_s: tuple[float, float] = (0.05, 0.3)
    kv_recv_latency_s: float = 0.05
    time_scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_running, bool) or not isinstance(self.max_running, int) \
                or self.max_running < 1:
            raise ConfigError("max_running", f"must be an int >= 1, got {self.max_running!r}")
        check_seconds("decode_step_s", self.decode_step_s, allow_zero=False)
        check_seconds("prefill_s_per_token", self.prefill_s_per_token)
        low, high = self.kv_pull_latency_s
        check_seconds("kv_pull_latency_s", low)
        check_seconds("kv_pull_latency_s", high)
        if high < low:
            raise ConfigError("kv_pull_latency_s", f"range ({low}, {high}) is reversed")
        check_seconds("kv_recv_latency_s", self.kv_recv_latency_s)
        check_seconds("time_scale", self.time_scale, allow_zero=False)


@dataclasses.dataclass
class SimRequest:
    request_id: str
    prompt_tokens: int = 16
    max_tokens: int = 16
    remote_decode: bool = False
    remote_prefill: bool = False
    never_pulled: bool = False

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be an int >= 1, got {value!r}")


_END = object()
_ABORTED = object()


class _Live:
    """Engine-side state of one request."""

    __slots__ = ("generated", "kv_fate", "outbox", "request")

    def __init__(self, request: SimRequest) -> None:
        self.request = request
        self.generated = 0
        self.outbox: asyncio.Queue[object] = asyncio.Queue()
        self.kv_fate: asyncio.Future[KVFate] = asyncio.get_running_loop().create_future()


class SimEngine:
    """The simulated engine. Start it with :meth:`start`, stop it with :meth:`shutdown`."""

    def __init__(self, config: SimConfig | None = None, *, name: str = "sim") -> None:
        self.config = config if config is not None else SimConfig()
        self.name = name
        self._rng = random.Random(self.config.seed)
        self._awaiting_kv: dict[str, _Live] = {}
        self._waiting: deque[_Live] = deque()
        self._running: dict[str, _Live] = {}
        self._held: dict[str, _Live] = {}
        self._wakeup = asyncio.Event()
        self._change_waiters: list[asyncio.Future[None]] = []
        self._loop_task: asyncio.Task[None] | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._kv_fates: dict[str, asyncio.Future[KVFate]] = {}
        self.stopped = False
        self.idle_since: float | None = time.monotonic()
        """Monotonic time the engine last became idle; ``None`` while it has work."""
        self.tokens_generated = 0
        self.kv_freed_early = 0

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(
                self._step_loop(), name=f"{self.name}-steps")

    async def shutdown(self) -> None:
        """Stop stepping; anything still held is aborted first."""
        if self.stopped:
            return
        await self.abort_all("engine shutdown")
        self.stopped = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait({self._loop_task})
        self._notify()

    # -- reading ------------------------------------------------------------------

    def counts(self) -> tuple[int, int, int, int]:
        """(waiting, running, kv_sends_held, kv_recvs_awaited)."""
        return len(self._waiting), len(self._running), len(self._held), len(self._awaiting_kv)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._held or self._awaiting_kv)

    def estimated_drain_s(self, pull_s: float | None = None) -> float:
        """Simulated seconds until all current work would be done (no new arrivals),
        following the step loop's own schedule (a waiting request starts when a slot
        frees, its prefill lengthens that step), a KV pull taking ``pull_s`` after its
        request finished (default: the slowest the time model allows)."""
        cfg = self.config
        pull = cfg.kv_pull_latency_s[1] if pull_s is None else pull_s
        # (end step, ends with a KV pull) per running request; the step loop is at step 0
        ends = [(live.request.max_tokens - live.generated, live.request.remote_decode)
                for live in self._running.values()]
        heapq.heapify(ends)
        waiting = collections.deque(live.request for live in self._waiting)
        step, elapsed, done_s = 0, 0.0, 0.0
        while ends or waiting:
            prefill = 0
            while waiting and len(ends) < cfg.max_running:  # admitted at this step's start
                request = waiting.popleft()
                heapq.heappush(ends, (step + request.max_tokens, request.remote_decode))
                prefill += request.prompt_tokens
            next_end = ends[0][0]
            elapsed += (next_end - step) * cfg.decode_step_s + prefill * cfg.prefill_s_per_token
            step = next_end
            while ends and ends[0][0] == step:
                _, pulled = heapq.heappop(ends)
                done_s = max(done_s, elapsed + (pull if pulled else 0.0))
        if self._held:
            done_s = max(done_s, pull)  # a pull already under way takes at most that
        if self._awaiting_kv:
            done_s += cfg.kv_recv_latency_s  # then they queue like the rest
        return done_s

    def drain_eta(self) -> DrainEta:
        """The time to quiescence in wall seconds: the step loop's schedule with the mean
        KV pull latency; bounded by the slowest pull, with a quarter and two steps of
        margin for the event loop's own time per step. No bound while a decoder that
        never pulls holds KV here (nothing would end its wait but the shutdown)."""
        cfg = self.config
        expected = self.estimated_drain_s(sum(cfg.kv_pull_latency_s) / 2) * cfg.time_scale
        lives = (*self._running.values(), *self._waiting, *self._held.values())
        if any(live.request.never_pulled and live.request.remote_decode for live in lives):
            return DrainEta(expected, None, SIM_ETA_BASIS,
                            "KV held for a decoder that never pulls it")
        upper = (self.estimated_drain_s() * 1.25 + 2 * cfg.decode_step_s) * cfg.time_scale
        return DrainEta(expected, max(upper, expected), SIM_ETA_BASIS)

    # -- requests -----------------------------------------------------------------

    async def generate(self, request: SimRequest) -> AsyncIterator[int]:
        """Stream the request's tokens. Raises :class:`RequestAborted` if aborted.

        Closing the iterator early (a client disconnect) aborts the request.
        """
        if self.stopped:
            raise RequestAborted(f"engine {self.name} is stopped")
        live = self._add(request)
        finished = False
        try:
            while True:
                item = await live.outbox.get()
                if item is _END:
                    finished = True
                    return
                if item is _ABORTED:
                    finished = True
                    raise RequestAborted(f"request {request.request_id} aborted")
                assert isinstance(item, int)
                yield item
        finally:
            if not finished:
                self.abort(request.request_id)

    async def kv_fate(self, request_id: str) -> KVFate:
        """For a ``remote_decode`` request: wait until the decoder pulled its KV, or it was
        freed before the pull (which would corrupt a real decode worker). Once per request."""
        fate = self._kv_fates.pop(request_id, None)
        if fate is None:
            raise KeyError(f"request {request_id!r} has no remote decode, or was asked already")
        return await fate

    def holds(self, request_id: str) -> bool:
        """Whether a request with this id is still in the engine (any queue, or KV held)."""
        return (request_id in self._running or request_id in self._held
                or request_id in self._awaiting_kv or request_id in self._kv_fates
                or any(r.request.request_id == request_id for r in self._waiting))

    def _add(self, request: SimRequest) -> _Live:
        live = _Live(request)
        if request.remote_decode:
            self._kv_fates[request.request_id] = live.kv_fate
        if request.remote_prefill:
            self._awaiting_kv[request.request_id] = live
            self._call_later(request.request_id, self.config.kv_recv_latency_s,
                             self._kv_received, request.request_id)
        else:
            self._waiting.append(live)
            self._wakeup.set()
        self._notify()
        return live

    def abort(self, request_id: str) -> bool:
        """Abort one request wherever it is. Returns whether it was found."""
        live = (self._running.pop(request_id, None) or self._awaiting_kv.pop(request_id, None)
                or self._held.pop(request_id, None))
        if live is None:
            for queued in self._waiting:
                if queued.request.request_id == request_id:
                    self._waiting.remove(queued)
                    live = queued
                    break
        if live is None:
            return False
        self._end(live, aborted=True)
        self._notify()
        return True

    async def abort_all(self, reason: str = "abort") -> int:
        """Abort every request and free every held KV block. Returns how many."""
        ids = [r.request.request_id for r in (*self._waiting, *self._running.values(),
                                               *self._held.values(), *self._awaiting_kv.values())]
        return sum(self.abort(rid) for rid in ids)

    def release_held(self, request_id: str | None = None) -> int:
        """Simulate the decoder's pull now, for one held request or all. Returns how many."""
        ids = [request_id] if request_id is not None else list(self._held)
        return sum(self._pulled(rid) for rid in ids)

    # -- engine internals ---------------------------------------------------------

    def _call_later(self, request_id: str, delay_s: float, callback: object, *args: str) -> None:
        loop = asyncio.get_running_loop()
        self._timers[request_id] = loop.call_later(
            delay_s * self.config.time_scale, callback, *args)  # type: ignore[arg-type]

    def _kv_received(self, request_id: str) -> None:
        self._timers.pop(request_id, None)
        live = self._awaiting_kv.pop(request_id, None)
        if live is not None:
            self._waiting.append(live)
            self._wakeup.set()
            self._notify()

    def _pulled(self, request_id: str) -> bool:
        self._timers.pop(request_id, None)
        live = self._held.pop(request_id, None)
        if live is None:
            return False
        if not live.kv_fate.done():
            live.kv_fate.set_result(KVFate.PULLED)
        self._notify()
        return True

    def _end(self, live: _Live, *, aborted: bool) -> None:
        timer = self._timers.pop(live.request.request_id, None)
        if timer is not None:
            timer.cancel()
        live.outbox.put_nowait(_ABORTED if aborted else _END)
        if not live.kv_fate.done():
            held = live.request.remote_decode and live.generated >= live.request.max_tokens
            if held:
                self.kv_freed_early += 1
            live.kv_fate.set_result(KVFate.FREED_EARLY)

    def _finish(self, live: _Live) -> None:
        """Normal end of generation: hold the KV for a remote decoder, or free it."""
        live.outbox.put_nowait(_END)
        request = live.request
        if not request.remote_decode:
            return
        self._held[request.request_id] = live
        if not request.never_pulled:
            low, high = self.config.kv_pull_latency_s
            self._call_later(request.request_id, self._rng.uniform(low, high),
                             self._pulled, request.request_id)

    def _notify(self) -> None:
        busy = self.has_work
        if not busy and self.idle_since is None:
            self.idle_since = time.monotonic()
        elif busy:
            self.idle_since = None
        if self._change_waiters:
            waiters, self._change_waiters = self._change_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def wait_for_change(self, timeout: float) -> None:
        """Return at the next change of any counter, or after ``timeout`` seconds."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._change_waiters.append(waiter)
        try:
            await asyncio.wait({waiter}, timeout=timeout)
        finally:
            if waiter in self._change_waiters:
                self._change_waiters.remove(waiter)

    async def _step_loop(self) -> None:
        cfg = self.config
        while True:
            if not self._waiting and not self._running:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            prefill_tokens = 0
            while self._waiting and len(self._running) < cfg.max_running:
                live = self._waiting.popleft()
                self._running[live.request.request_id] = live
                prefill_tokens += live.request.prompt_tokens
            if prefill_tokens:
                self._notify()
            await asyncio.sleep((cfg.decode_step_s + prefill_tokens * cfg.prefill_s_per_token)
                                * cfg.time_scale)
            done: list[_Live] = []
            for live in self._running.values():
                live.generated += 1
                live.outbox.put_nowait(live.generated)
                if live.generated >= live.request.max_tokens:
                    done.append(live)
            self.tokens_generated += len(self._running)
            for live in done:
                del self._running[live.request.request_id]
                self._finish(live)
            if done:
                self._notify()
