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
  whose ``error.retryable`` is true: quiesce's closed gate) or a connection that never
  opened (refused, timed out), before any byte went to the client, is sent to another
  listed worker (at most :data:`ATTEMPTS` tries), as Dynamo's router does for requests
  that never reached an engine. Anything else is the client's answer.
- **A stream cut mid-way** (the worker closed the connection, or its process died): the
  client already has its 200, so the router ends the stream with an SSE error event
  (``data: {"error": {...}}``) and no ``[DONE]``, as real frontends do. That is the loss
  a load generator counting HTTP statuses calls a success.

Events are forwarded whole (split at the blank line that ends an SSE event), so a cut
never leaves a half event for the client to parse. Costs: one upstream HTTP/1.1
connection per request (httpx's pool), one extra copy of each event.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from quiesce.adapters.etcd import EtcdWatcher
from quiesce.admin.server import EmbeddedServer, bind_socket

log = logging.getLogger("bench.replay.router")

ATTEMPTS = 3
"""Tries per request across workers, for refusals and refused connections only."""
UPSTREAM_TIMEOUT = httpx.Timeout(connect=2.0, read=120.0, write=10.0, pool=10.0)
UPSTREAM_KEEPALIVE_S = 1.0
"""Idle upstream connections are dropped after this, well before the workers' own
keep-alive timeout (uvicorn: 5 s): reusing a connection the worker is closing would fail
a request the worker never saw."""
CLIENT_KEEPALIVE_S = 120
"""How long an idle client connection stays open (a load balancer's is 60-120 s): longer
than the clients' own (aiohttp: 15 s), so that a client never reuses a connection the
router is closing."""
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
    """Attempts that went to another worker after a refusal or a connection that never
    opened (one request can count more than once)."""
    cut: int = 0
    """Streams the router ended with an error event because the worker's stream broke."""
    no_worker: int = 0
    """Requests answered 503 because no listed worker took them."""
    first_request_at: float | None = None
    """Wall clock of the first generation request (the load has begun)."""

    def to_dict(self) -> dict[str, object]:
        return {"picks": dict(self.picks), "retried": self.retried, "cut": self.cut,
                "no_worker": self.no_worker, "first_request_at": self.first_request_at,
                "removed_at": dict(self.removed_at), "last_pick_at": dict(self.last_pick_at)}


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
        self._client = httpx.AsyncClient(
            timeout=UPSTREAM_TIMEOUT,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                keepalive_expiry=UPSTREAM_KEEPALIVE_S))
        app = Starlette(routes=[
            Route("/v1/completions", self._generate, methods=["POST"]),
            Route("/v1/chat/completions", self._generate, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/router/stats", self._stats, methods=["GET"]),
        ])
        self._server = EmbeddedServer(app, bind_socket(host, port),
                                      keep_alive_s=CLIENT_KEEPALIVE_S)
        self.watcher.watch(self._on_change)

    @property
    def port(self) -> int:
        return self._server.port

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

    async def _stats(self, request: Request) -> Response:
        return JSONResponse({**self.stats.to_dict(), "listed": self.listed()})

    async def _models(self, request: Request) -> Response:
        picked = self._pick(set())
        if picked is None:
            return JSONResponse({"error": {"type": "no_worker", "message": "no worker listed",
                                           "retryable": True}}, status_code=503)
        answer = await self._client.get(f"{picked[1]}/v1/models")
        return Response(answer.content, answer.status_code,
                        media_type=answer.headers.get("content-type"))

    async def _generate(self, request: Request) -> Response:
        if self.stats.first_request_at is None:
            self.stats.first_request_at = time.time()
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
            except (httpx.ConnectError, httpx.ConnectTimeout):  # never reached the worker
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


# -- the router as its own process ------------------------------------------------------
# ``python -m bench.replay.router --etcd HOST:PORT --prefix P`` serves on a free loopback
# port, prints one JSON line ``{"event": "ready", "port": N}`` once it follows etcd, and
# runs until SIGTERM or SIGINT. A real router is its own process: the replay's
# orchestration (status polls, preStop hooks, aiperf) then never delays its event loop.


async def _serve(etcd_host: str, etcd_port: int, prefix: str) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    router = Router(etcd_host, etcd_port, prefix)
    await router.start()
    try:
        print(json.dumps({"event": "ready", "port": router.port}), flush=True)
        await stop.wait()
    finally:
        await router.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay.router",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--etcd", required=True, metavar="HOST:PORT")
    parser.add_argument("--prefix", required=True)
    args = parser.parse_args(argv)
    host, _, port = args.etcd.rpartition(":")
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(host, int(port), args.prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
