"""Admission for a Dynamo handler served by push egress (:func:`gated_push`).

Dynamo's TensorRT-LLM handlers (ai-dynamo 1.6.1, ``trtllm/request_handlers/push_egress.py``)
decorate ``generate`` with ``push_egress_capable``: a plain function
``generate(self, request, context=None, response_sender=None, **kwargs)``. Dynamo's runtime
passes a ``response_sender`` to a handler whose signature names one; the handler then
sends each response with ``response_sender.send(obj)`` and ``close()`` and returns an
async generator that yields nothing (advanced once, it runs the whole request). Without
a sender (in-process callers, the health canary) it returns the handler's own stream.

:func:`~.gated.gated` alone would see no chunk on the push path and count every pushed
request lost. :func:`gated_push` admits the request the same way, and on the push path
reads the outcome from what passes through the sender (the last response that states
one counts; none stated → :func:`~.gated.unstated_outcome`: client gone when the client
stopped the request, else lost). The pull path is :func:`~.gated.gated`'s.
Its signature is the dispatcher's (``inspect.signature`` follows ``__wrapped__``), so the
runtime still chooses push.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

from quiesce.admission import AdmissionGate, Outcome
from quiesce.errors import ConfigError, WorkerDraining

from .gated import FinishOutcome, Handler, admit_or_refuse, gated, unstated_outcome


class _WatchedSender:
    """Dynamo's ``response_sender``, reading each response's outcome on its way."""

    def __init__(self, sender: Any, context: Any, outcome: FinishOutcome) -> None:
        self._sender = sender
        self._context = context
        self._outcome = outcome
        self.ended: Outcome | None = None

    def send(self, response: Any) -> Any:
        self.ended = self._outcome(response, self._context) or self.ended
        return self._sender.send(response)

    def __getattr__(self, name: str) -> Any:  # close(), and whatever else Dynamo adds
        return getattr(self._sender, name)


def gated_push(dispatch: Callable[..., Any], gate: AdmissionGate,
               request_id: Callable[..., str | None] | None = None, *,
               outcome: FinishOutcome,
               refusal: Callable[[WorkerDraining], BaseException] | None = None
               ) -> Callable[..., Any]:
    """``dispatch`` (a push-egress ``generate``) with each request admitted through ``gate``
    (module docstring); ``refusal`` as in :func:`~.gated.gated`."""
    if not callable(dispatch):
        raise ConfigError("handler", "must be callable")
    pull: Handler = gated(dispatch, gate, request_id, outcome=outcome, refusal=refusal)

    async def pushed(self: Any, request: Any, context: Any, sender: Any,
                     kwargs: dict[str, Any]) -> AsyncIterator[Any]:
        rid = request_id(self, request, context) if request_id is not None else None
        admission = admit_or_refuse(gate, rid, refusal)
        watched = _WatchedSender(sender, context, outcome)
        with admission:
            # relayed as they come: the push path yields nothing (responses go through
            # the sender), and the runtime advances this generator once to run it all
            async for item in dispatch(self, request, context, response_sender=watched,
                                       **kwargs):
                yield item
            admission.finish(watched.ended or unstated_outcome(context))

    @functools.wraps(dispatch)
    def admitted(self: Any, request: Any, context: Any = None, response_sender: Any = None,
                 **kwargs: Any) -> AsyncIterator[Any]:
        if response_sender is None:
            return pull(self, request, context, **kwargs)
        return pushed(self, request, context, response_sender, kwargs)

    return admitted
