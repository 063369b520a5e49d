"""The replay's router: an OpenAI-compatible front door that picks workers from etcd.

It stands in for Dynamo's frontend or an llm-d gateway: the piece whose behaviour decides
whether a scale-down loses requests. What it does, and what it does not:

- **Which workers**: those listed under the etcd prefix, read and followed by one
  :class:`~quiesce.adapters.etcd.EtcdWatcher` (a snapshot, then a prefix watch). A worker
  is picked only while listed; the watcher's DELETE removes it at once, and the router
  records that moment (``removed_at``, wall clock) so that the replay can measure
  unregister → router.
- **How it picks**: round robin over the listed workers in name order (deterministic,
  knows nothing of their load, like a ReplicaSet's Service).
- **Retries**: only what never started. A worker's typed, retryable refusal (HTTP 503
  whose ``error.retryable`` is true: quiesce's closed gate) or a refused connection,
  before any byte went to the client, is sent to another listed worker (at most
  :data:`ATTEMPTS` tries), as Dynamo's router does for requests that never reached an
  engine. Anything else is the client's answer.
- **A stream cut mid-way** (the worker closed the connection, or its process died): the
  client already has its 200, so the router ends the stream with an SSE error event
  (``data: {"error": {...}}``) and no ``[DONE]``, as real frontends do. That is the loss
  a load generator counting HTTP statuses calls a success.

Events are forwarded whole (split at the blank line that ends an SSE event), so a cut
never leaves a half event for the client to parse. Costs: one upstream HTTP/1.1
connection per request (httpx's pool), one extra copy of each event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from quiesce.adapters.etcd import EtcdWatcher
from quiesce.server import EmbeddedServer, bind_socket

log = logging.getLogger("bench.replay.router")

ATTEMPTS = 3
"""Tries per request across workers, for refusals and refused connections only."""
UPSTREAM_TIMEOUT = httpx.Timeout(connect=2.0, read=120.0, write=10.0, pool=10.0)
EVENT_END = b"\n\n"


@dataclasses.dataclass
class RouterStats:
    """What the router saw; read by the replay after the run."""

    picks: Counter[str] = dataclasses.field(default_factory=Counter)
    last_pick_at: dict[str, float] = dataclasses.field(default_factory=dict)
    """Wall clock of each worker's latest pick."""
    removed_at: dict[str, float] = dataclasses.field(default_factory=dict)
    """Wall clock at which each worker left the pick set (its key's DELETE was seen)."""
    retried: int = 0
    """Requests sent to another worker after a refusal or refused connection."""
    cut: int = 0
    """Streams the router ended with an error event because the worker's stream broke."""
    no_worker: int = 0
    """Requests answered 503 because no listed worker took them."""
    first_request: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Set when the first generation request arrives (the load has begun)."""

    def to_dict(self) -> dict[str, object]:
        return {"picks": dict(self.picks), "retried": self.retried, "cut": self.cut,
                "no_worker": self.no_worker}


def _error_event(kind: str, message: str) -> bytes:
    body = {"error": {"type": kind, "message": message, "retryable": False}}
    return f"data: {json.dumps(body)}\n\n".encode()


def _retryable_refusal(status: int, body: bytes) -> bool:
    """A 503 whose JSON says ``error.retryable``: the worker started nothing."""
    if status != 503:
        return False
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return False
    return bool(isinstance(error, dict) and error.get("retryable"))


class Router:
    """See the module docstring. ``start()`` follows etcd and listens on loopback."""

    def __init__(self, etcd_host: str, etcd_port: int, prefix: str,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.watcher = EtcdWatcher(etcd_host, etcd_port, prefix)
        self.stats = RouterStats()
        self._next = 0
        self._client = httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT,
                                         limits=httpx.Limits(max_connections=None,
                                                             max_keepalive_connections=64))
        app = Starlette(routes=[
            Route("/v1/completions", self._generate, methods=["POST"]),
            Route("/v1/chat/completions", self._generate, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
        ])
        self._server = EmbeddedServer(app, bind_socket(host, port))
        self.watcher.watch(self._on_change)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.port}"

    def listed(self) -> list[str]:
        """The workers a request may go to now, in pick order."""
        return sorted(name for name, value in self.watcher.instances.items()
                      if value.get("role", "aggregated") == "aggregated"
                      and isinstance(value.get("address"), str))

    def _on_change(self, name: str, registered: bool) -> None:
        if registered:
            self.stats.removed_at.pop(name, None)
            log.info("router: %s listed", name)
        else:
            self.stats.removed_at[name] = time.time()
            log.info("router: %s removed", name)

    async def start(self) -> None:
        await self.watcher.start()
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop()
        await self._client.aclose()
        await self.watcher.close()

    def _pick(self, tried: set[str]) -> tuple[str, str] | None:
        names = [name for name in self.listed() if name not in tried]
        if not names:
            return None
        name = names[self._next % len(names)]
        self._next += 1
        self.stats.picks[name] += 1
        self.stats.last_pick_at[name] = time.time()
        return name, str(self.watcher.instances[name]["address"])

    async def _models(self, request: Request) -> Response:
        picked = self._pick(set())
        if picked is None:
            return JSONResponse({"error": {"type": "no_worker", "message": "no worker listed",
                                           "retryable": True}}, status_code=503)
        answer = await self._client.get(f"{picked[1]}/v1/models")
        return Response(answer.content, answer.status_code,
                        media_type=answer.headers.get("content-type"))

    async def _generate(self, request: Request) -> Response:
        self.stats.first_request.set()
        body = await request.body()
        tried: set[str] = set()
        for _ in range(ATTEMPTS):
            picked = self._pick(tried)
            if picked is None:
                break
            name, address = picked
            tried.add(name)
            upstream = self._client.build_request(
                "POST", f"{address}{request.url.path}", content=body,
                headers={"content-type": "application/json"})
            try:
                answer = await self._client.send(upstream, stream=True)
            except httpx.ConnectError:
                self.stats.retried += 1
                continue
            if answer.status_code != 200:
                content = await answer.aread()
                await answer.aclose()
                if _retryable_refusal(answer.status_code, content):
                    self.stats.retried += 1
                    continue
                return Response(content, answer.status_code,
                                media_type=answer.headers.get("content-type"))
            return StreamingResponse(self._relay(name, answer), status_code=200,
                                     media_type=answer.headers.get("content-type"))
        self.stats.no_worker += 1
        return JSONResponse({"error": {"type": "no_worker", "retryable": True,
                                       "message": f"no listed worker took the request "
                                                  f"(tried {sorted(tried)})"}},
                            status_code=503)

    async def _relay(self, name: str, answer: httpx.Response) -> AsyncIterator[bytes]:
        """The worker's stream, whole events at a time; a cut ends it with an error event."""
        pending = b""
        try:
            async for chunk in answer.aiter_raw():
                pending += chunk
                end = pending.rfind(EVENT_END)
                if end >= 0:
                    yield pending[:end + len(EVENT_END)]
                    pending = pending[end + len(EVENT_END):]
            if pending:
                yield pending  # a non-streaming answer, or a last event without its end
        except (httpx.TransportError, asyncio.IncompleteReadError) as exc:
            self.stats.cut += 1
            log.warning("router: stream from %s cut: %r", name, exc)
            yield _error_event("upstream_lost", f"the worker's stream broke: {exc!r}")
        finally:
            await answer.aclose()
