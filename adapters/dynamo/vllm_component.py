"""quiesce inside Dynamo's own ``dynamo.vllm`` worker (ai-dynamo 1.6.1, vLLM 0.31).

:class:`VllmComponent` (shared parts: :mod:`.component`) replaces, in Dynamo's
``dynamo/vllm/main.py`` and ``handlers.py``:

- ``main.parse_args_with_model_fetch`` — wrapped: after Dynamo parsed the arguments, a
  worker kind other than the LLM worker (aggregated, prefill, decode) is a
  :class:`~quiesce.errors.ConfigError` (exit 2) naming it, before any engine starts.
  ``worker_factory.WorkerFactory.create`` sends those kinds (:data:`OTHER_WORKERS`:
  ``--realtime``, ``--embedding-worker``, ``--classify-worker``, and
  ``--disaggregation-mode encode``; ``main.worker`` itself runs ``--headless`` without
  any Dynamo endpoint) through handler classes none of these hooks reach: they would
  serve ungated, and the encode worker registers its card with ``register_model`` and
  builds no engine, so the probe would read idle while it serves;
- ``main.install_signal_handlers`` — Dynamo's graceful-shutdown helper (unregister, sleep
  5 s, abort): the recorder (:meth:`~.component.DynamoComponent.record_shutdown`);
- ``main.setup_vllm_engine`` — wrapped: once vLLM's ``AsyncLLM`` exists the probe reads
  it (:class:`~quiesce.adapters.vllm.VllmProbe`: EngineCore's own counts through
  quiesce's plugin, held KV sends on a prefill worker included), role from
  ``config.disaggregation_mode``;
- ``main.register_vllm_model`` — wrapped: the model card (endpoint: its third argument,
  ``generate_endpoint``), then ``on_ready``;
- ``handlers.DecodeWorkerHandler.generate`` (outcome from Dynamo's ``finish_reason``) and
  ``handlers.PrefillWorkerHandler.generate`` (completed once the engine ran the prefill
  and it handed over the KV parameters: :func:`~.outcomes.vllm_prefill_outcome`).

Control: vLLM's :class:`~quiesce.adapters.vllm.VllmEngineControl` aborts what the engine
holds; Dynamo's own teardown (``runtime.shutdown()``, then its cleanup) stops the engine.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from quiesce.engine import EngineControl
from quiesce.errors import ConfigError
from quiesce.probe import QuiescenceProbe, Role

from .component import DynamoComponent, GatedHandler, Hook
from .gated import finish_outcome
from .outcomes import vllm_prefill_outcome

MAIN = "dynamo.vllm.main"
HANDLERS = "dynamo.vllm.handlers"
OTHER_WORKERS = {"realtime": "--realtime", "embedding_worker": "--embedding-worker",
                 "classify_worker": "--classify-worker", "headless": "--headless"}
"""Fields of dynamo.vllm's parsed ``Config`` (and their flags) that make the worker
something other than the LLM worker (1.6.1); the ``encode`` mode is the other one."""
MODE = "disaggregation_mode"


def _mode_of(config: Any) -> str:
    """``config.disaggregation_mode``'s name, lower case (``DisaggregationMode.ENCODE``:
    ``encode``)."""
    return str(getattr(getattr(config, MODE, None), "name", "")).lower()


def _role_of(config: Any) -> Role:
    return {"prefill": Role.PREFILL, "decode": Role.DECODE}.get(_mode_of(config),
                                                                Role.AGGREGATED)


def refuse_other_workers(config: Any) -> None:
    """ConfigError unless ``config`` (dynamo.vllm's parsed ``Config``) runs the LLM
    worker: the flags of the other kinds it sets are named, and a config without one of
    the fields read fails closed (a Dynamo whose arguments changed)."""
    missing = [name for name in (*OTHER_WORKERS, MODE) if not hasattr(config, name)]
    if missing:
        raise ConfigError("dynamo", f"dynamo.vllm's parsed config has no {', '.join(missing)}"
                          ": cannot tell which worker it runs (checked against 1.6.1)")
    others = [flag for name, flag in OTHER_WORKERS.items() if getattr(config, name)]
    if _mode_of(config) == "encode":
        others.append("--disaggregation-mode encode")
    if others:
        raise ConfigError("args", "quiesce dynamo vllm runs the LLM worker only "
                          f"(aggregated, prefill, decode), not {', '.join(others)}")


class VllmComponent(DynamoComponent):
    """Dynamo's ``dynamo.vllm`` worker with quiesce inside (module docstring)."""

    name = "vllm"
    requirement = ("ai-dynamo 1.6.1 and the vLLM it pins (0.31); ci/setup_dynamo.sh shows "
                   "how to install them")

    def hooks(self) -> Sequence[Hook]:
        return [Hook(MAIN, "parse_args_with_model_fetch", _wrap_parse),
                Hook(MAIN, "install_signal_handlers", lambda _: self.record_shutdown),
                Hook(MAIN, "setup_vllm_engine", self._wrap_setup),
                Hook(MAIN, "register_vllm_model",
                     lambda register: self.registration(register, 2, "generate_endpoint"))]

    def handlers(self) -> Sequence[GatedHandler]:
        return [GatedHandler(HANDLERS, "DecodeWorkerHandler", finish_outcome),
                GatedHandler(HANDLERS, "PrefillWorkerHandler", vllm_prefill_outcome)]

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


def _wrap_parse(parse: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(parse)
    async def parse_args_with_model_fetch(*args: Any, **kwargs: Any) -> Any:
        config = await parse(*args, **kwargs)
        refuse_other_workers(config)
        return config

    return parse_args_with_model_fetch
