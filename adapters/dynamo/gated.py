"""Admission for Dynamo endpoint handlers (:func:`gated`) and how their streams ended.

A Dynamo worker's handler is an async generator ``generate(request, context)`` that the
runtime serves with ``Endpoint.serve_endpoint``. :func:`gated` wraps it so that every
request is admitted through an :class:`~quiesce.admission.AdmissionGate` before any
work, and released with the outcome its stream shows:

- Dynamo's LLM handlers put the end of a stream in its chunks, not in an exception:
  ``finish_reason`` ``stop``/``length``/``eos``/``tool_calls`` is completed;
  ``cancelled`` (vLLM's ``abort`` as Dynamo normalizes it) is client gone when the
  request's context says the client stopped it, else lost; ``error...`` is lost. This
  reading is :func:`finish_outcome`, checked against ``dynamo/vllm/handlers.py`` 1.6.1.
- A stream that ended without any finish reason is client gone when the request's
  context says the client stopped it (a client's disconnect is never the drain's
  failure), else lost (fail closed): :func:`unstated_outcome`.
- A handler whose stream cannot say how the engine ended a request (Dynamo's SGLang
  prefill handler) gets it from a hook on its own engine loop (:class:`EngineEnds`);
  what the hook recorded decides.
- An exception or a cancellation gets the gate's usual outcome
  (:meth:`~quiesce.admission.Admission.end_by`), except an exception raised from a
  :class:`~quiesce.errors.RequestRejected` (``raise DynamoError(...) from rejected``:
  the handler refused the request's own input in its framework's terms, as
  :mod:`.token_handler` raises Dynamo's ``InvalidArgument``): rejected, not lost.

A closed gate raises ``refusal(WorkerDraining)`` before the handler runs; by default the
:class:`~quiesce.errors.WorkerDraining` itself. The component wrappers pass an exception
type Dynamo's frontend knows (:mod:`.component`).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from quiesce.admission import Admission, AdmissionGate, Outcome
from quiesce.errors import ConfigError, RequestRejected, WorkerDraining

Handler = Callable[..., AsyncIterator[Any]]
FinishOutcome = Callable[[Any, Any], "Outcome | None"]
"""``(chunk, context) -> Outcome | None``: how the stream ended if this chunk ends it."""

COMPLETED_REASONS = frozenset({"stop", "length", "eos", "tool_calls", "content_filter"})
CLIENT_STOPPED = ("is_stopped", "is_killed")
"""Methods of Dynamo's request ``Context`` that say the client stopped the request."""


def _client_stopped(context: Any) -> bool:
    for name in CLIENT_STOPPED:
        method = getattr(context, name, None)
        try:
            if callable(method) and method():
                return True
        except Exception:  # an unreadable context is not a client's word
            continue
    return False


def unstated_outcome(context: Any) -> Outcome:
    """How a stream that stated no outcome ended: client gone when the client stopped
    it (``context.is_stopped()``/``is_killed()``), else lost (fail closed)."""
    return Outcome.CLIENT_GONE if _client_stopped(context) else Outcome.LOST


def finish_outcome(chunk: Any, context: Any) -> Outcome | None:
    """The outcome a Dynamo LLM chunk states, or None when it does not end the stream."""
    if not isinstance(chunk, Mapping):
        return None
    reason = chunk.get("finish_reason")
    if reason is None or reason == "":
        return None
    text = str(reason)
    if text in COMPLETED_REASONS:
        return Outcome.COMPLETED
    if text.startswith(("cancelled", "abort")) and _client_stopped(context):
        return Outcome.CLIENT_GONE
    return Outcome.LOST


class EngineEnds:
    """How the engine ended each request of a handler whose stream does not say it
    (Dynamo's SGLang prefill handler consumes the engine's results off its stream).

    :func:`gated` opens an entry for each admitted request, by its ``context`` object,
    and takes it when the stream ends; :meth:`record`, called meanwhile with the same
    ``context`` (by a hook on the handler's own engine loop), sets it. A record for a
    request that is not open (not gated, or its stream ended) is dropped, so nothing
    outlives a stream. One event loop; not thread-safe.
    """

    def __init__(self) -> None:
        self._open: dict[int, tuple[Any, Outcome | None]] = {}
        """``id(context)`` → (the context, kept so that its id stays unique; the outcome)."""

    def open(self, context: Any) -> None:
        self._open[id(context)] = (context, None)

    def record(self, context: Any, outcome: Outcome) -> None:
        if id(context) in self._open:
            self._open[id(context)] = (context, outcome)

    def take(self, context: Any) -> Outcome | None:
        """The outcome recorded for ``context`` (None if none), closing its entry."""
        entry = self._open.pop(id(context), None)
        return entry[1] if entry is not None else None



def admit_or_refuse(gate: AdmissionGate, rid: str | None,
                    refusal: Callable[[WorkerDraining], BaseException] | None) -> Admission:
    """``gate.admit(rid)``; a closed gate raises ``refusal(refused)`` (Dynamo's typed error)
    if given, else :class:`WorkerDraining` itself."""
    try:
        return gate.admit(rid)
    except WorkerDraining as refused:
        if refusal is None:
            raise
        raise refusal(refused) from refused


def gated(handler: Handler, gate: AdmissionGate,
          request_id: Callable[..., str | None] | None = None, *,
          outcome: FinishOutcome | None = None,
          refusal: Callable[[WorkerDraining], BaseException] | None = None,
          ends: EngineEnds | None = None) -> Handler:
    """``handler`` with each request admitted through ``gate``.

    ``outcome``: reads how the stream ended from its chunks (``finish_outcome`` for
    Dynamo's LLM handlers); the last chunk that states one counts, and a stream that
    never states one is :func:`unstated_outcome`. Without it, a stream that ends
    normally is completed. An exception raised from ``RequestRejected`` is rejected
    (module docstring). ``refusal``: what a closed gate raises (default: the
    ``WorkerDraining`` itself). ``ends``: where the engine's own end of each request is
    recorded (:class:`EngineEnds`); when one was, it decides over the chunks.
    """
    if not callable(handler):
        raise ConfigError("handler", "must be an async generator function")
    if not isinstance(gate, AdmissionGate):
        raise ConfigError("gate", f"must be an AdmissionGate, got {type(gate).__name__}")

    async def admitted(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        rid = request_id(*args, **kwargs) if request_id is not None else None
        admission = admit_or_refuse(gate, rid, refusal)
        context = kwargs["context"] if "context" in kwargs else args[-1] if args else None
        ended: Outcome | None = None
        engine_end: Outcome | None = None
        watched = ends if ends is not None and context is not None else None
        with admission:
            if watched is not None:
                watched.open(context)
            try:
                async for item in handler(*args, **kwargs):
                    if outcome is not None:
                        ended = outcome(item, context) or ended
                    yield item
            except Exception as exc:
                if isinstance(exc.__cause__, RequestRejected):
                    admission.finish(Outcome.REJECTED)
                raise
            finally:
                if watched is not None:
                    engine_end = watched.take(context)
            admission.finish(engine_end or (Outcome.COMPLETED if outcome is None
                                            else ended or unstated_outcome(context)))

    # The handler's own signature (``inspect.signature`` follows ``__wrapped__``): Dynamo's
    # runtime passes ``context`` only to a handler whose signature names it.
    functools.update_wrapper(admitted, handler)
    return admitted
