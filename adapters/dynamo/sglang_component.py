"""quiesce inside Dynamo's own ``dynamo.sglang`` worker (ai-dynamo 1.6.1, which pins SGLang 0.5.21).

:class:`SglangComponent` (shared parts: :mod:`.component`) replaces, in Dynamo's
``dynamo/sglang/``:

- ``main.parse_args`` — wrapped: after Dynamo parsed the arguments, a worker kind other
  than the LLM worker (``init_decode``/``init_prefill``: aggregated, prefill, decode) is a
  :class:`~quiesce.errors.ConfigError` before any engine starts. Those kinds
  (:data:`OTHER_WORKERS`: diffusion, embedding, rerank, multimodal) register and serve
  through code none of these hooks reach: wrapped, they would serve ungated and read
  idle.
- ``main.install_graceful_shutdown`` — Dynamo's SGLang shutdown helper (it owns
  SIGTERM/SIGINT with ``signal.signal``, defers SGLang's own loop handlers and runs
  Dynamo's unregister-sleep-abort): replaced by the recorder, which installs no signal
  handler, keeps every later ``loop.add_signal_handler`` for SIGTERM/SIGINT out (SGLang's
  ``TokenizerManager`` registers one that starts SGLang's own shutdown: it would replace
  the quiesce worker's on the loop) and returns a ``run_deferred_handlers`` that runs
  none of them. Logged at WARNING for each one kept out.
- ``init_llm.register_model_with_readiness_gate`` — wrapped: its ``engine`` (SGLang's
  ``Engine``) and ``worker_type`` (the role) are handed to the probe before it runs
  (:class:`~quiesce.adapters.sglang.SglangProbe`: the scheduler's ``is_fully_idle`` on
  every DP rank through quiesce's SGLang plugin, ``rid_to_state``, the load snapshot).
- ``register.register_model`` (``dynamo.llm.register_model`` as that module calls it) —
  the model card (endpoint: its third argument), then ``on_ready``. A resume registers
  the card again with this call, not with ``register_model_with_readiness_gate`` (which
  shuts the engine down when a registration fails).
- ``init_llm.serve_via_gateway_children`` — refused (``ConfigError``): in gateway mode
  the requests are served by ``python -m dynamo.sglang`` children quiesce is not in.
- ``request_handlers.DecodeWorkerHandler.generate`` and ``PrefillWorkerHandler.generate``
  — gated, outcome read by :func:`~.outcomes.sglang_outcome`. The prefill handler yields
  its bootstrap parameters before the prefill runs and then consumes the engine's
  results off the stream, so its outcome is what ``PrefillWorkerHandler._consume_results``
  returns (the final ``meta_info``: :func:`~.outcomes.sglang_final_outcome`; wrapped),
  never the bootstrap chunk: an aborted prefill is lost (client gone when the client
  stopped it).

Version: the SGLang probe is tested on SGLang 0.5.23; on another release it answers
UNKNOWN naming the version, so a drain does not reach ``drained`` and a SIGTERM runs to
the budget (fail closed). 0.5.21, which ai-dynamo 1.6.1 pins, was checked against its
source and does not fit the adapter (:data:`~quiesce.adapters.sglang.UNSUPPORTED_VERSIONS`:
its scheduler lacks what the adapter reads, so every read is UNKNOWN). An operator who
checked another release accepts it with ``accept_untested_engine`` (``--accept-untested-
engine VERSION``: exactly the installed release, never a tested or unsupported one): the
probe then allows the version and the installed release's own ``is_fully_idle``
fingerprint, and :attr:`~.component.DynamoComponent.warnings` says so (log, ready line,
status).

Control: :class:`~quiesce.adapters.sglang.SglangEngineControl` aborts what the engine
holds (on a prefill worker it waits for the aborted KV writes); Dynamo's own teardown
(``runtime.shutdown()``, then ``handler.cleanup()`` → ``Engine.shutdown()``) stops it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from quiesce.adapters.sglang import (
    SglangEngineControl,
    SglangProbe,
    accept_untested,
    installed_sglang_version,
    untested_fingerprints,
)
from quiesce.engine import EngineControl
from quiesce.errors import ConfigError
from quiesce.probe import QuiescenceProbe, Role

from .component import CARD_ENDPOINT, DynamoComponent, EngineEnd, GatedHandler, Hook
from .outcomes import sglang_final_outcome, sglang_outcome

log = logging.getLogger("quiesce.adapters.dynamo.sglang_component")

MAIN = "dynamo.sglang.main"
INIT_LLM = "dynamo.sglang.init_llm"
REGISTER = "dynamo.sglang.register"
HANDLERS = "dynamo.sglang.request_handlers"
OTHER_WORKERS = ("image_diffusion_worker", "video_generation_worker", "rerank_worker",
                 "embedding_worker", "multimodal_encode_worker", "multimodal_worker",
                 "diffusion_worker")
"""``config.dynamo_args`` flags of the worker kinds ``main.worker`` sends elsewhere than
``init_decode``/``init_prefill`` (1.6.1)."""
ROLES = {"aggregated": Role.AGGREGATED, "prefill": Role.PREFILL, "decode": Role.DECODE}
"""``str(dynamo.llm.WorkerType.X)`` of the LLM worker's three kinds."""
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def role_of_worker_type(worker_type: Any) -> Role | None:
    """The role a Dynamo ``WorkerType`` names (``prefill``; ``WorkerType.Prefill``), or None."""
    return ROLES.get(str(worker_type).rsplit(".", 1)[-1].lower())


async def _no_deferred_handlers() -> None:
    """What Dynamo's helper returns, run after the endpoints stop: SGLang's own signal
    handlers stay out (they would start SGLang's own shutdown)."""


class SglangComponent(DynamoComponent):
    """Dynamo's ``dynamo.sglang`` worker with quiesce inside (module docstring)."""

    name = "sglang"
    requirement = "ai-dynamo 1.6.1 and the SGLang it pins (pip install 'ai-dynamo[sglang]')"

    def __init__(self, *args: Any, accept_untested_engine: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kept_out: list[tuple[int, Callable[..., Any]]] = []
        """The loop signal handlers kept out (signal, callback): SGLang's, normally."""
        self.untested = accept_untested_engine is not None
        """The operator accepted the installed SGLang untested (module docstring)."""
        if accept_untested_engine is not None:
            self._warn(accept_untested(accept_untested_engine, installed_sglang_version()))

    def hooks(self) -> Sequence[Hook]:
        return [Hook(MAIN, "parse_args", self._wrap_parse),
                Hook(MAIN, "install_graceful_shutdown", lambda _: self._record_graceful),
                Hook(INIT_LLM, "register_model_with_readiness_gate", self._wrap_readiness),
                Hook(REGISTER, "register_model",
                     lambda register: self.registration(register, *CARD_ENDPOINT)),
                Hook(INIT_LLM, "serve_via_gateway_children", lambda _: _refuse_gateway)]

    def handlers(self) -> Sequence[GatedHandler]:
        return [GatedHandler(HANDLERS, "DecodeWorkerHandler", sglang_outcome),
                GatedHandler(HANDLERS, "PrefillWorkerHandler", sglang_outcome,
                             engine_end=EngineEnd("_consume_results", sglang_final_outcome))]

    def build_probe(self, engine: Any, role: Role) -> QuiescenceProbe:
        if not self.untested:
            return SglangProbe(engine, role)
        fingerprints, said = untested_fingerprints()
        self._warn(said)
        return SglangProbe(engine, role, allow_untested_version=True,
                           idle_fingerprints=fingerprints)

    def _warn(self, text: str) -> None:
        self.warnings.append(text)
        log.warning("%s", text)

    def engine_control(self) -> EngineControl | None:
        # an unknown role settles as a prefill worker would (counts KV writes left behind)
        return SglangEngineControl(self.engine, self.role or Role.PREFILL)

    def _wrap_parse(self, parse: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(parse)
        async def parse_args(*args: Any, **kwargs: Any) -> Any:
            config = await parse(*args, **kwargs)
            dynamo_args = getattr(config, "dynamo_args", None)
            if dynamo_args is None:
                raise ConfigError("dynamo", "dynamo.sglang's parsed config has no dynamo_args: "
                                  "cannot tell which worker it runs")
            others = [f"--{kind.replace('_', '-')}" for kind in OTHER_WORKERS
                      if getattr(dynamo_args, kind, False)]
            if others:
                raise ConfigError("args", f"quiesce dynamo sglang runs the LLM worker only "
                                  f"(aggregated, prefill, decode), not {', '.join(others)}")
            return config

        return parse_args

    def _record_graceful(self, loop: asyncio.AbstractEventLoop, runtime: Any,
                         endpoints: list[Any], shutdown_event: asyncio.Event, *,
                         signals: tuple[int, ...] = SIGNALS) -> Callable[[], Awaitable[None]]:
        """In place of ``dynamo.sglang.shutdown.install_graceful_shutdown`` (same
        parameters; module docstring)."""
        self.record_shutdown(loop, runtime, endpoints, shutdown_event)
        kept = frozenset(signals)
        add = loop.add_signal_handler

        def add_signal_handler(sig: int, callback: Callable[..., object], *args: Any) -> None:
            if sig in kept:
                self.kept_out.append((sig, callback))
                log.warning("loop handler %r for signal %d kept out: the quiesce worker owns "
                            "SIGTERM and SIGINT", callback, sig)
                return None
            return add(sig, callback, *args)

        loop.add_signal_handler = add_signal_handler  # type: ignore[method-assign, assignment]
        return _no_deferred_handlers

    def _wrap_readiness(self, register: Callable[..., Awaitable[None]]
                        ) -> Callable[..., Awaitable[None]]:
        @functools.wraps(register)
        async def register_model_with_readiness_gate(*args: Any, **kwargs: Any) -> None:
            engine = args[0] if args else kwargs.get("engine")
            worker_type = kwargs.get("worker_type")
            self.attach_engine(engine, role_of_worker_type(worker_type),
                               f"worker_type={worker_type!r}")
            await register(*args, **kwargs)

        return register_model_with_readiness_gate


async def _refuse_gateway(*args: Any, **kwargs: Any) -> None:
    """In place of ``init_llm.serve_via_gateway_children`` (module docstring)."""
    raise ConfigError("args", "SGLang gateway mode (more than one gateway worker) serves "
                      "requests from `python -m dynamo.sglang` child processes quiesce does "
                      "not run in: quiesce dynamo sglang does not support it")
