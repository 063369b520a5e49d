"""quiesce inside Dynamo's own ``dynamo.vllm`` worker (ai-dynamo 1.6.1, vLLM 0.31).

:class:`VllmComponent` (shared parts: :mod:`.component`) replaces, in Dynamo's
``dynamo/vllm/main.py`` and ``handlers.py``:

- ``main.install_signal_handlers`` — Dynamo's graceful-shutdown helper (unregister, sleep
  5 s, abort): the recorder (:meth:`~.component.DynamoComponent.record_shutdown`);
- ``main.setup_vllm_engine`` — wrapped: once vLLM's ``AsyncLLM`` exists the probe reads
  it (:class:`~quiesce.adapters.vllm.VllmProbe`: EngineCore's own counts through
  quiesce's plugin, held KV sends on a prefill worker included), role from
  ``config.disaggregation_mode``;
- ``main.register_vllm_model`` — wrapped: the model card (endpoint: its third argument,
  ``generate_endpoint``), then ``on_ready``;
- ``handlers.DecodeWorkerHandler.generate`` (outcome from Dynamo's ``finish_reason``) and
  ``handlers.PrefillWorkerHandler.generate`` (completed once it handed over
  ``disaggregated_params``: :func:`~.outcomes.handoff_outcome`).

Control: vLLM's :class:`~quiesce.adapters.vllm.VllmEngineControl` aborts what the engine
holds; Dynamo's own teardown (``runtime.shutdown()``, then its cleanup) stops the engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from quiesce.engine import EngineControl
from quiesce.probe import QuiescenceProbe, Role

from .component import DynamoComponent, GatedHandler, Hook
from .gated import finish_outcome
from .outcomes import handoff_outcome

MAIN = "dynamo.vllm.main"
HANDLERS = "dynamo.vllm.handlers"


def _role_of(config: Any) -> Role:
    mode = str(getattr(getattr(config, "disaggregation_mode", None), "name", "")).lower()
    return {"prefill": Role.PREFILL, "decode": Role.DECODE}.get(mode, Role.AGGREGATED)


class VllmComponent(DynamoComponent):
    """Dynamo's ``dynamo.vllm`` worker with quiesce inside (module docstring)."""

    name = "vllm"
    requirement = ("ai-dynamo 1.6.1 and the vLLM it pins (0.31); ci/setup_dynamo.sh shows "
                   "how to install them")

    def hooks(self) -> Sequence[Hook]:
        return [Hook(MAIN, "install_signal_handlers", lambda _: self.record_shutdown),
                Hook(MAIN, "setup_vllm_engine", self._wrap_setup),
                Hook(MAIN, "register_vllm_model",
                     lambda register: self.registration(register, 2, "generate_endpoint"))]

    def handlers(self) -> Sequence[GatedHandler]:
        return [GatedHandler(HANDLERS, "DecodeWorkerHandler", finish_outcome),
                GatedHandler(HANDLERS, "PrefillWorkerHandler", handoff_outcome)]

    def build_probe(self, engine: Any, role: Role) -> QuiescenceProbe:
        from quiesce.adapters.vllm import VllmProbe  # noqa: PLC0415 (needs vLLM)

        return VllmProbe(engine, role)

    def engine_control(self) -> EngineControl | None:
        from quiesce.adapters.vllm import VllmEngineControl  # noqa: PLC0415 (needs vLLM)

        return VllmEngineControl(self.engine)

    def _wrap_setup(self, setup: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(setup)
        def setup_vllm_engine(config: Any, *args: Any, **kwargs: Any) -> Any:
            result = setup(config, *args, **kwargs)
            self.attach_engine(result[0], _role_of(config))
            return result

        return setup_vllm_engine
