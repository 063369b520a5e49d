"""quiesce inside Dynamo's own ``dynamo.trtllm`` worker (ai-dynamo 1.6.1; TensorRT-LLM 1.3.0rc29).

:class:`TrtllmComponent` (shared parts: :mod:`.component`) replaces, in Dynamo's
``dynamo/trtllm/``:

- ``main.parse_args`` — wrapped: after Dynamo parsed the arguments, a worker other than
  the text or multimodal LLM worker in mode ``prefill_and_decode``, ``prefill`` or
  ``decode`` (a diffusion modality, or the ``encode`` mode) is a
  :class:`~quiesce.errors.ConfigError` before any engine starts: those serve through
  code none of these hooks reach.
- ``main.install_signal_handlers`` — Dynamo's graceful-shutdown helper: the recorder
  (:meth:`~.component.DynamoComponent.record_shutdown`). Dynamo's prefill
  ``drain_callback`` (a 30 s poll of the iteration statistics' active + queued counts)
  is kept but not run: the probe's reading is stronger (it counts context requests whose
  KV is still being sent, which those statistics never do).
- ``workers.llm_worker.get_llm_engine`` — wrapped: once Dynamo's ``TensorRTLLMEngine``
  is initialized, the probe reads its ``llm``
  (:func:`~quiesce.adapters.trtllm.probe_for_llm`: per executor layout; the MPI proxy's
  statistics are a weak signal and always UNKNOWN on a prefill worker), role from its
  ``disaggregation_mode``. An engine whose ``llm`` cannot be had: UNKNOWN with why.
- ``workers.llm_worker.register_model`` (``dynamo.llm.register_model`` as that module
  calls it) — the model card (endpoint: its third argument), then ``on_ready``.
- ``AggregatedHandler.generate`` (``request_handlers.aggregated_handler``),
  ``PrefillHandler.generate`` and ``DecodeHandler.generate``
  (``request_handlers.handlers``) — push-egress dispatchers, gated with
  :func:`~.gated_push.gated_push`; outcome from Dynamo's ``finish_reason``, also on a
  prefill (its ``length``, stated beside ``disaggregated_params``, is completed; the
  parameters alone are not; ``{"error": ...}`` is lost).
  A request the client cancelled ends without a finish reason in this handler: client
  gone when its context says the client stopped it, else lost (fail closed).

Control: :class:`~quiesce.adapters.trtllm.TrtllmEngineControl` aborts what the ``LLM``
holds (counting context KV abandoned in transfer); Dynamo's own teardown
(``runtime.shutdown()``, then ``get_llm_engine``'s exit → ``llm.shutdown()``) stops it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from quiesce.adapters.trtllm import TrtllmEngineControl, probe_for_llm
from quiesce.engine import EngineControl
from quiesce.errors import ConfigError
from quiesce.probe import QuiescenceProbe, Role

from .component import CARD_ENDPOINT, DynamoComponent, GatedHandler, Hook
from .gated import finish_outcome

MAIN = "dynamo.trtllm.main"
LLM_WORKER = "dynamo.trtllm.workers.llm_worker"
AGGREGATED = "dynamo.trtllm.request_handlers.aggregated_handler"
HANDLERS = "dynamo.trtllm.request_handlers.handlers"
ROLES = {"prefill_and_decode": Role.AGGREGATED, "prefill": Role.PREFILL,
         "decode": Role.DECODE}
"""``DisaggregationMode`` values (``dynamo.trtllm.constants``) of the LLM worker's roles."""
LLM_MODALITIES = ("text", "multimodal")
"""``Modality`` values served by ``init_llm_worker``."""


def _value(member: Any) -> str:
    return str(getattr(member, "value", member))


class TrtllmComponent(DynamoComponent):
    """Dynamo's ``dynamo.trtllm`` worker with quiesce inside (module docstring)."""

    name = "trtllm"
    requirement = ("ai-dynamo 1.6.1 and the TensorRT-LLM it pins "
                   "(pip install 'ai-dynamo[trtllm]', from NVIDIA's index)")

    def hooks(self) -> Sequence[Hook]:
        return [Hook(MAIN, "parse_args", self._wrap_parse),
                Hook(MAIN, "install_signal_handlers", lambda _: self.record_shutdown),
                Hook(LLM_WORKER, "get_llm_engine", self._wrap_engine),
                Hook(LLM_WORKER, "register_model",
                     lambda register: self.registration(register, *CARD_ENDPOINT))]

    def handlers(self) -> Sequence[GatedHandler]:
        return [GatedHandler(AGGREGATED, "AggregatedHandler", finish_outcome, push=True),
                GatedHandler(HANDLERS, "PrefillHandler", finish_outcome, push=True),
                GatedHandler(HANDLERS, "DecodeHandler", finish_outcome, push=True)]

    def build_probe(self, engine: Any, role: Role) -> QuiescenceProbe:
        return probe_for_llm(engine.llm, role)  # .llm raises while not initialized

    def engine_control(self) -> EngineControl | None:
        llm = getattr(self.engine, "_llm", None)  # None before initialize, after shutdown
        return TrtllmEngineControl(llm) if llm is not None else None

    def _wrap_parse(self, parse: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(parse)
        def parse_args(*args: Any, **kwargs: Any) -> Any:
            config = parse(*args, **kwargs)
            modality = _value(getattr(config, "modality", None))
            mode = _value(getattr(config, "disaggregation_mode", None))
            if modality not in LLM_MODALITIES or mode not in ROLES:
                raise ConfigError("args", "quiesce dynamo trtllm runs the text or multimodal "
                                  "LLM worker in mode prefill_and_decode, prefill or decode "
                                  f"only, not modality {modality!r} in mode {mode!r}")
            return config

        return parse_args

    def _wrap_engine(self, get_engine: Callable[..., Any]) -> Callable[..., Any]:
        @contextlib.asynccontextmanager
        async def get_llm_engine(engine_args: Any, disaggregation_mode: Any = None,
                                 *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            async with get_engine(engine_args, disaggregation_mode, *args,
                                  **kwargs) as engine:
                # the engine's own mode: it reads None as prefill_and_decode
                mode = _value(getattr(engine, "disaggregation_mode", disaggregation_mode))
                self.attach_engine(engine, ROLES.get(mode), f"disaggregation_mode={mode!r}")
                yield engine

        return functools.update_wrapper(get_llm_engine, get_engine)
