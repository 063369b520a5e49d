"""quiesce inside SGLang's own HTTP server (``python -m sglang.launch_server``).

::

    pip install 'quiesce[sglang]'
    QUIESCE_SGLANG_ARGS="--admin-port 8001 --budget 60" python -m sglang.launch_server ...

Two pieces, both in the server's main process:

- :mod:`quiesce.serve.sglang_plugin` (a ``sglang.srt.plugins`` entry) runs before the
  engine starts: it checks quiesce's settings and the server's layout (a bad one: the
  server exits 2 naming it), binds the admin port, claims signal ownership (inherited by
  the scheduler and detokenizer processes, which quiesce's SGLang plugin guards) and adds
  :class:`QuiesceMiddleware` to SGLang's app;
- :class:`QuiesceMiddleware`: the shared server face (:mod:`quiesce.serve.server_worker`:
  admission, the worker, its shutdown and exit) with SGLang's routes
  (:data:`~quiesce.serve.asgi_admission.SGLANG_ROUTES`) and :class:`SglangHost`.

:class:`SglangHost`, built when SGLang's app has started (lifespan startup complete):

- the engine: the server's ``TokenizerManager`` (``http_server.get_global_state()``); the
  probe (:class:`~quiesce.adapters.sglang.SglangProbe`: ``rid_to_state``, every
  scheduler's own idle check over one round trip, the load snapshot) for the role of
  ``--role`` (``auto``: SGLang's ``--disaggregation-mode``);
- the signals: uvicorn's SIGTERM/SIGINT handlers are replaced by quiesce's, and SGLang's
  own SIGTERM drain (registered on the loop at the first request, polling every 5 s) is
  kept out (:func:`~quiesce.adapters.sglang.signals.own_main_process_signals`);
- the engine's shutdown after the drain: as ``Engine.shutdown()``
  (:class:`~quiesce.adapters.sglang.server.ServerEngine`: the subprocess watchdog stopped, every
  child SIGKILLed and reaped), bounded by the cleanup reserve;
- the server: uvicorn's ``Server``, read where it is at that moment: the owner of the
  SIGTERM handler uvicorn installed for the serve (``started`` says it listens,
  ``should_exit`` stops it: what SGLang's own shutdown does through its stop hook).

Refusals (the startup fails, uvicorn exits 3, nothing is served): no claim in this process,
no ``TokenizerManager``, several tokenizer workers, a ``TokenizerManager`` without the
``signal_handler_class`` that keeps SGLang's own SIGTERM drain out, no uvicorn ``Server``
owning SIGTERM, or a role that cannot be read.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from quiesce.engine import EngineControl
from quiesce.errors import ConfigError
from quiesce.probe import QuiescenceProbe, Role
from quiesce.serve.asgi_admission import SGLANG_ROUTES
from quiesce.serve.server_options import SGLANG_ARGS_ENV, ServerOptions
from quiesce.serve.server_worker import EngineHost, ServerMiddleware

__all__ = ["QuiesceMiddleware", "SglangHost"]

_ROLES = {"prefill": Role.PREFILL, "decode": Role.DECODE, "null": Role.AGGREGATED}


def uvicorn_server() -> Any:
    """The uvicorn ``Server`` serving this process, read from its SIGTERM handler (uvicorn
    installs its bound ``handle_exit`` with ``signal.signal`` for the serve); ConfigError
    if SIGTERM belongs to something else."""
    handler = signal.getsignal(signal.SIGTERM)
    server = getattr(handler, "__self__", None)
    if not (hasattr(server, "should_exit") and hasattr(server, "started")):
        raise ConfigError("launch_server", f"SIGTERM's handler is {handler!r}, not a uvicorn "
                          "Server's: quiesce serves SGLang's uvicorn HTTP app only")
    return server


class SglangHost:
    """:class:`~quiesce.serve.server_worker.EngineHost` for SGLang's server (module
    docstring)."""

    server = "sglang"

    def __init__(self, app: Any, options: ServerOptions) -> None:
        from quiesce.adapters.sglang import SglangEngineControl, SglangProbe  # noqa: PLC0415
        from quiesce.adapters.sglang.server import (  # noqa: PLC0415 (SGLang's server)
            ServerEngine,
            tokenizer_manager,
        )

        manager = tokenizer_manager()
        if manager is None:
            raise ConfigError("launch_server", "SGLang's server has no TokenizerManager: "
                              "there is no engine to drain")
        if not getattr(app, "is_single_tokenizer_mode", False):
            raise ConfigError("launch_server", "several tokenizer workers "
                              "(--tokenizer-worker-num > 1): run one")
        if not isinstance(getattr(manager, "signal_handler_class", None), type):
            raise ConfigError("launch_server", "SGLang's TokenizerManager has no "
                              "signal_handler_class: its own SIGTERM drain cannot be kept out "
                              "on this version")
        self.http_server = uvicorn_server()
        mode = getattr(getattr(manager, "disaggregation_mode", None), "value", None)
        if options.role == "auto" and mode not in _ROLES:
            raise ConfigError("--role", f"cannot read SGLang's disaggregation mode ({mode!r}):"
                              f" set --role in ${SGLANG_ARGS_ENV}")
        self.role = options.resolved_role(_ROLES.get(str(mode), Role.AGGREGATED))
        self.manager = manager
        self.probe: QuiescenceProbe = SglangProbe(manager, self.role)
        self.control: EngineControl = SglangEngineControl(ServerEngine(manager), self.role)

    def listening(self) -> bool:
        return bool(self.http_server.started)

    def take_signals(self) -> None:
        from quiesce.adapters.sglang.signals import (  # noqa: PLC0415
            own_main_process_signals,
        )

        own_main_process_signals(self.manager)

    def stop_server(self) -> None:
        self.http_server.should_exit = True

    def status(self) -> dict[str, object]:
        return {"sglang_serve": {"role": self.role.value, "pid": os.getpid()}}


class QuiesceMiddleware(ServerMiddleware):
    """The ASGI middleware quiesce's SGLang plugin adds to SGLang's app (module
    docstring)."""

    server = "sglang"
    routes = SGLANG_ROUTES
    missing_claim = (f"set ${SGLANG_ARGS_ENV} (empty for the defaults) in the server's "
                     "environment, start it with python -m sglang.launch_server, and install "
                     "quiesce in SGLang's own environment (pip install 'quiesce[sglang]')")

    def host(self, app: Any, options: ServerOptions) -> EngineHost:
        return SglangHost(app, options)
