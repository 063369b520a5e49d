"""The simulated engine behind the reference worker (``quiesce serve --engine sim``):
requests in, OpenAI-style deltas out."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from quiesce.errors import RequestRejected
from quiesce.generation import Delta, Prompt, Sampling
from quiesce.probe import Role

from .engine import SimConfig, SimEngine, SimRequest
from .probe import SimProbe

SIM_DEFAULT_MAX_TOKENS = 16
"""Output length of a served request that sets no ``max_tokens`` (a chat request may not)."""


class SimServing:
    """The simulated engine behind the reference worker (``quiesce serve --engine sim``).

    What it honours of a request (:class:`~quiesce.generation.Sampling`): ``max_tokens``
    (unset: :data:`SIM_DEFAULT_MAX_TOKENS`), ``stop`` strings (the text ends before the
    first match, finish reason ``stop``; text is held back while a stop string could still
    match), ``ignore_eos`` and ``min_tokens`` (the sim has no end-of-sequence token: it
    always runs to ``max_tokens`` or a stop string). The sampling knobs (temperature,
    top_p, top_k, min_p, seed, penalties) are accepted and change nothing: its text,
    ``" t1 t2 ..."``, is deterministic. It rejects nothing a valid request can ask.

    Chat: :meth:`render_chat` writes each message as ``"role: content"`` on its own line,
    then ``"assistant:"``. KV transfer: ``do_remote_decode`` holds the KV for a decoder and
    the last delta returns ``{"do_remote_prefill": true, "remote_engine_id",
    "remote_request_id"}``, the handle a decoder's request carries; ``do_remote_prefill``
    awaits the KV first; ``sim_never_pulled``: that decoder never pulls (tests).
    """

    def __init__(self, config: SimConfig | None = None, role: Role | str = Role.AGGREGATED,
                 name: str = "sim", served_model_name: str = "quiesce") -> None:
        self.engine = SimEngine(config, name=name)
        self.probe = SimProbe(self.engine, role)
        self.control = self.engine
        self.model_names = (served_model_name,)

    async def start(self) -> None:
        await self.engine.start()

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        lines = [f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages]
        return "\n".join([*lines, "assistant:"])

    def stream(self, prompt: Prompt, sampling: Sampling, request_id: str,
               kv_transfer_params: Mapping[str, Any]) -> AsyncIterator[Delta]:
        """The request's deltas, one per token (fewer while text is held back for a stop
        string); the last carries the finish reason. Raises RequestAborted if aborted."""
        prompt_tokens = len(prompt) if isinstance(prompt, tuple) else len(prompt.split())
        max_tokens = sampling.max_tokens or SIM_DEFAULT_MAX_TOKENS
        request = SimRequest(request_id, prompt_tokens=max(1, prompt_tokens),
                             max_tokens=max_tokens,
                             remote_decode=bool(kv_transfer_params.get("do_remote_decode")),
                             remote_prefill=bool(kv_transfer_params.get("do_remote_prefill")),
                             never_pulled=bool(kv_transfer_params.get("sim_never_pulled")))
        handle = ({"do_remote_prefill": True, "do_remote_decode": False,
                   "remote_engine_id": self.engine.name, "remote_request_id": request_id}
                  if request.remote_decode else None)
        return self._deltas(request, sampling.stop, handle)

    async def _deltas(self, request: SimRequest, stop: tuple[str, ...],
                      handle: Mapping[str, Any] | None) -> AsyncIterator[Delta]:
        if self.engine.holds(request.request_id):  # ids key the engine's queues
            raise RequestRejected(f"request_id {request.request_id!r} is already in flight")
        holdback = max((len(s) for s in stop), default=1) - 1
        text, sent, pending = "", 0, 0
        tokens = self.engine.generate(request)
        try:
            async for token in tokens:
                text += f" t{token}"
                pending += 1
                hits = [i for i in (text.find(s, sent) for s in stop) if i >= 0]
                if hits:  # the text ends before the stop string; the engine stops here
                    yield Delta(text[sent:min(hits)], pending, "stop", request.prompt_tokens)
                    return
                done = token >= request.max_tokens
                upto = len(text) if done else max(sent, len(text) - holdback)
                if done or upto > sent:
                    yield Delta(text[sent:upto], pending, "length" if done else None,
                                request.prompt_tokens if done else None,
                                handle if done else None)
                    sent, pending = upto, 0
        finally:  # a stop string or a client that left: the engine drops the request
            close = getattr(tokens, "aclose", None)
            if close is not None:
                await close()
