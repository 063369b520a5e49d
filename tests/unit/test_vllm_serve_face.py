"""quiesce's middleware for ``vllm serve`` refusing to serve when it cannot do so truthfully
(quiesce.serve.vllm_serve), driven through the ASGI lifespan as uvicorn drives it, with a
small app in place of vLLM's: no claim was made in its process (the middleware came from
a ``--config`` file, or from one of several API servers), or vLLM's app has no engine.
On a refusal uvicorn exits with its startup-failure code and serves nothing; that path
with the real ``vllm serve`` is measured in tests/integration/vllm/test_vllm_serve.py for
a bad setting, and every serving path there too."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from quiesce.serve import server_claim
from quiesce.serve.asgi_admission import Message, Receive, Scope, Send
from quiesce.serve.vllm_serve import QuiesceMiddleware


async def lifespan_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Starlette's lifespan as vLLM's app runs it: startup, then wait for shutdown."""
    assert scope["type"] == "lifespan"
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def run_lifespan(app_state: Any) -> list[Message]:
    middleware = QuiesceMiddleware(lifespan_app)
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[Message] = []

    async def receive() -> Message:
        return incoming.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    await middleware({"type": "lifespan", "app": SimpleNamespace(state=app_state)},
                     receive, send)
    return sent


async def test_without_the_plugins_claim_the_startup_fails_saying_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_claim._Claimed, "claim", None)
    sent = await run_lifespan(SimpleNamespace(engine_client=object(), server=None))
    failed = [m for m in sent if m["type"] == "lifespan.startup.failed"]
    assert failed and not [m for m in sent if m["type"] == "lifespan.startup.complete"]
    assert "--middleware" in failed[0]["message"] and "--config" in failed[0]["message"]


async def test_an_app_without_an_engine_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    claim = SimpleNamespace(options=None)  # never reached past the engine check
    monkeypatch.setattr(server_claim._Claimed, "claim", claim)
    sent = await run_lifespan(SimpleNamespace(server=None))
    (failed,) = [m for m in sent if m["type"] == "lifespan.startup.failed"]
    assert "engine_client" in failed["message"]


async def test_before_the_worker_starts_requests_are_refused_as_starting() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("a request reached vLLM before quiesce admitted it")

    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}"}

    async def send(message: Message) -> None:
        sent.append(message)

    await QuiesceMiddleware(app)({"type": "http", "method": "POST", "path": "/v1/completions",
                                  "headers": []}, receive, send)
    assert sent[0]["status"] == 503
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body["error"]["type"] == "worker_draining" and "starting" in body["error"]["message"]


@pytest.mark.parametrize("asked", [None, 5])
def test_the_exit_code_asked_for_outlives_a_normal_return(asked: int | None) -> None:
    """vLLM's CLI returns normally (exit 0) after its server stopped on its own; with a
    lost request the worker asks for 5 (``exit_with``), applied by the handler the claim
    registers at exit. The real path: test_vllm_serve.py's EngineCore killed, no signal."""
    program = ("import atexit, sys\n"
               "from quiesce.serve import server_claim\n"
               "atexit.register(server_claim._apply_exit_code)\n"
               f"if {asked!r} is not None: server_claim.exit_with({asked!r})\n"
               "print('returned', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.stdout.strip() == "returned", done.stderr
    assert done.returncode == (asked or 0), done.stderr
