"""FAKE Dynamo worker modules for the component tests (no ai-dynamo, no engine here).

Each fake mirrors the control flow of ai-dynamo 1.6.1's ``dynamo.sglang`` /
``dynamo.trtllm`` worker as far as quiesce's hooks see it (the names the worker looks up
at call time, their arguments, when the engine exists, when the model card is registered,
what the handlers yield), written from reading that source; that the real source still
has these names and signatures is checked by tests/integration/dynamo/test_contract_*.py
(with ``ast``, against the installed ai-dynamo). The engines are fakes too: the real ones
run in tests/gpu/test_dynamo_components.py.

:class:`FakeRuntime` plays Dynamo's runtime: ``serve_endpoint`` serves until
``shutdown()``, and :meth:`FakeEndpoint.call` calls the served handler as the runtime
does: ``context`` by keyword when the handler's signature names it, and a
``response_sender`` (push egress) when it names one.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import inspect
import sys
from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any, ClassVar

import pytest


class WorkerUnavailable(Exception):
    """Stands in for ``dynamo._core.WorkerUnavailable``."""


class WorkerType(enum.Enum):
    """Stands in for ``dynamo.llm.WorkerType``: ``str()`` is the lower-case name, as the
    real binding's is."""

    Aggregated = "aggregated"
    Prefill = "prefill"
    Decode = "decode"

    def __str__(self) -> str:
        return self.value


class FakeContext:
    def __init__(self, request_id: str, stopped: bool = False) -> None:
        self.request_id = request_id
        self.stopped = stopped

    def id(self) -> str:
        return self.request_id

    def is_stopped(self) -> bool:
        return self.stopped


class FakeSender:
    """Dynamo's push-egress ``response_sender``."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.closed = False

    def send(self, response: Any) -> None:
        self.sent.append(response)

    def close(self) -> None:
        self.closed = True


class FakeEndpoint:
    def __init__(self, runtime: FakeRuntime, path: str) -> None:
        self.runtime = runtime
        self.path = path
        self.handler: Callable[..., Any] | None = None
        self.log: list[str] = []

    async def serve_endpoint(self, handler: Callable[..., Any], **kwargs: Any) -> None:
        self.handler = handler
        await self.runtime.stopped.wait()

    async def unregister_endpoint_instance(self) -> None:
        self.log.append("unregister")

    async def register_endpoint_instance(self) -> None:
        self.log.append("register")

    async def call(self, request: Any, context: FakeContext) -> tuple[list[Any], FakeSender | None]:
        """One request as Dynamo's runtime sends it; returns what the client received and
        the sender if the push path was used."""
        assert self.handler is not None, "not served"
        parameters = inspect.signature(self.handler).parameters
        kwargs: dict[str, Any] = {"context": context} if "context" in parameters else {}
        if "response_sender" in parameters:
            sender = FakeSender()
            received = [item async for item in self.handler(request, response_sender=sender,
                                                            **kwargs)]
            assert received == [], "the push path yields nothing"
            return sender.sent, sender
        return [item async for item in self.handler(request, **kwargs)], None


class FakeRuntime:
    def __init__(self) -> None:
        self.stopped = asyncio.Event()
        self.endpoints: dict[str, FakeEndpoint] = {}

    def endpoint(self, path: str) -> FakeEndpoint:
        return self.endpoints.setdefault(path, FakeEndpoint(self, path))

    def shutdown(self) -> None:
        self.stopped.set()


class FakeDynamo:
    """The fake modules of one test, in ``sys.modules`` while it runs; ``calls`` records
    what Dynamo's own functions were asked to do (``dynamo's helper``: the shutdown
    helper ran, which quiesce must prevent)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self.calls: list[tuple[str, Any]] = []
        self.runtime = FakeRuntime()
        llm = self.module("dynamo.llm", WorkerType=WorkerType)
        self.module("dynamo.llm.exceptions", WorkerUnavailable=WorkerUnavailable)

        async def register_model(*args: Any, **kwargs: Any) -> None:
            self.calls.append(("register_model", args))
            if self.fail_registration:
                raise RuntimeError("discovery store unavailable")

        async def unregister_model(endpoint: Any, lora_name: str | None = None) -> None:
            self.calls.append(("unregister_model", endpoint))

        llm.register_model = register_model  # type: ignore[attr-defined]
        llm.unregister_model = unregister_model  # type: ignore[attr-defined]
        self.fail_registration = False

    def module(self, name: str, **attrs: Any) -> ModuleType:
        """A fake module ``name`` (with its parent packages) holding ``attrs``."""
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if not isinstance(sys.modules.get(parent), ModuleType) or \
                    not getattr(sys.modules[parent], "__quiesce_fake__", False):
                package = ModuleType(parent)
                package.__path__ = []
                package.__quiesce_fake__ = True  # type: ignore[attr-defined]
                self._monkeypatch.setitem(sys.modules, parent, package)
        module = ModuleType(name)
        module.__quiesce_fake__ = True  # type: ignore[attr-defined]
        module.__dict__.update(attrs)
        self._monkeypatch.setitem(sys.modules, name, module)
        return module

    def helper(self, name: str) -> Callable[..., Any]:
        """Dynamo's own shutdown helper: records that it ran (it must not)."""

        def helper(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args))

            async def run_deferred_handlers() -> None:
                self.calls.append(("deferred handlers", ()))

            return run_deferred_handlers

        return helper


class FakeEngine:
    """What the handlers and the tests need of an engine: it was shut down, or not."""

    def __init__(self) -> None:
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True


def push_egress_capable(func: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
    """The push-egress dispatcher's contract (ai-dynamo 1.6.1,
    ``trtllm/request_handlers/push_egress.py``): a plain function whose signature names
    ``response_sender``; with a sender it drains the stream into it and returns an async
    generator that yields nothing, without one it returns the stream itself."""

    async def drain(stream: AsyncIterator[Any], sender: Any) -> AsyncIterator[Any]:
        async for response in stream:
            sender.send(response)
        sender.close()
        return
        yield

    @functools.wraps(func)
    def dispatch(self: Any, request: Any, context: Any = None, response_sender: Any = None,
                 **kwargs: Any) -> AsyncIterator[Any]:
        stream = func(self, request, context, **kwargs)
        return stream if response_sender is None else drain(stream, response_sender)

    del dispatch.__wrapped__
    return dispatch


def chunks_handler(base: type | None = None) -> type:
    """A handler class whose ``generate`` yields ``request["chunks"]`` (after
    ``request["wait"]``, an event, if given) and records each call on the class."""

    class Handler(*(base,) if base else ()):  # type: ignore[misc]
        started: ClassVar[list[Any]] = []

        def __init__(self, engine: Any, *args: Any) -> None:
            self.engine = engine

        async def generate(self, request: dict[str, Any], context: Any
                           ) -> AsyncIterator[Any]:
            type(self).started.append(context.id())
            if "wait" in request:
                await request["wait"].wait()
            for chunk in request["chunks"]:
                yield chunk

        def cleanup(self) -> None:
            self.engine.shutdown()

    return Handler


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met in time")


def served_endpoint(runtime: FakeRuntime) -> FakeEndpoint:
    (endpoint,) = [e for e in runtime.endpoints.values() if e.path.endswith(".generate")]
    return endpoint


async def run_until_ready(component: Any, argv: tuple[str, ...] = ("--model-path", "/models/m")
                          ) -> asyncio.Task[None]:
    """Install ``component`` (a :class:`~quiesce.adapters.dynamo.component.DynamoComponent`
    over the fake Dynamo) and run its worker until the model is registered; its
    ``on_ready`` opens the gate. Raises what the worker raised if it ended first."""
    ready = asyncio.Event()

    async def on_ready() -> None:
        component.gate.open()
        ready.set()

    component.on_ready = on_ready
    component.install()
    task: asyncio.Task[None] = asyncio.create_task(component.run(list(argv)))
    done, _ = await asyncio.wait({task, asyncio.create_task(ready.wait())}, timeout=5,
                                 return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # raises what the worker raised
    assert ready.is_set(), "the model was never registered"
    return task
