"""quiesce inside vLLM's own OpenAI server: ``vllm serve MODEL --middleware`` this class.

::

    pip install 'quiesce[vllm]'
    vllm serve MODEL --middleware quiesce.serve.vllm_serve.QuiesceMiddleware
    # optional settings: QUIESCE_VLLM_ARGS="--admin-port 8001 --budget 60 --router-grace 5"

Two pieces, both in vLLM's API server process:

- :mod:`quiesce.serve.vllm_plugin` (a ``vllm.general_plugins`` entry) runs while vLLM
  builds its argument parser, before the engine starts: it checks quiesce's settings
  (a bad one: ``vllm serve`` exits 2 naming it), binds the admin port and claims signal
  ownership, which the engine's processes inherit (quiesce's engine plugin guards them).
- :class:`QuiesceMiddleware`, which vLLM adds to its app: the shared server face
  (:mod:`quiesce.serve.server_worker`: admission, the worker, its shutdown and exit) with
  vLLM's routes (:data:`~quiesce.serve.asgi_admission.VLLM_ROUTES`) and :class:`VllmHost`.

:class:`VllmHost`, built when vLLM's app has started (lifespan startup complete: the
engine is up, vLLM's loop signal handlers are installed, which quiesce's then replace):

- the engine: ``app.state.engine_client``; the probe
  (:class:`~quiesce.adapters.vllm.VllmProbe`: the frontend's unfinished requests and
  EngineCore's own state, held KV sends included) for the role of ``--role`` (``auto``:
  from ``--kv-transfer-config``: ``kv_producer`` → prefill, ``kv_consumer`` → decode);
- the engine's shutdown after the drain: ``AsyncLLM.shutdown`` (vLLM's engine-client
  shutdown, the call vLLM's own handler makes), bounded by the cleanup reserve;
- the server: ``app.state.server`` (vLLM's uvicorn server: ``started`` says it listens,
  ``should_exit`` stops it, what vLLM's own handler does after the engine shutdown).

Refusals (the startup fails, uvicorn exits 3, nothing is served): no claim was made in
this process (the middleware came from a ``--config`` file, where the plugin cannot see it
before the engine starts; several API servers, ``--api-server-count`` > 1, each a process
of its own), or vLLM's app has no ``engine_client``.
"""

from __future__ import annotations

import os
from typing import Any

from quiesce.engine import EngineControl
from quiesce.errors import ConfigError
from quiesce.probe import QuiescenceProbe, Role
from quiesce.serve.asgi_admission import VLLM_ROUTES
from quiesce.serve.server_options import ServerOptions
from quiesce.serve.server_worker import EngineHost, ServerMiddleware
from quiesce.serve.vllm_plugin import MIDDLEWARE

__all__ = ["QuiesceMiddleware", "VllmHost", "vllm_role"]


def vllm_role(kv_role: str | None) -> Role:
    """The role vLLM's ``--kv-transfer-config`` gives: ``kv_producer`` → prefill,
    ``kv_consumer`` → decode, anything else (``kv_both``, none) → aggregated."""
    return {"kv_producer": Role.PREFILL, "kv_consumer": Role.DECODE}.get(kv_role or "",
                                                                         Role.AGGREGATED)


class VllmHost:
    """:class:`~quiesce.serve.server_worker.EngineHost` for ``vllm serve`` (module
    docstring)."""

    server = "vllm serve"

    def __init__(self, app: Any, options: ServerOptions) -> None:
        state = getattr(app, "state", None)
        engine = getattr(state, "engine_client", None)
        if engine is None:
            raise ConfigError("--middleware", "vLLM's app has no engine_client (a "
                              "render-only or gRPC server?): there is no engine to drain")
        from quiesce.adapters.vllm import VllmEngineControl, VllmProbe  # noqa: PLC0415

        kv_config = getattr(getattr(engine, "vllm_config", None), "kv_transfer_config", None)
        self.role = options.resolved_role(vllm_role(getattr(kv_config, "kv_role", None)))
        self.probe: QuiescenceProbe = VllmProbe(engine, self.role)
        # vLLM's engine shutdown must fit in the cleanup reserve (its default is 5 s, then kill)
        self.control: EngineControl = VllmEngineControl(
            engine, max(1.0, options.shutdown_policy().cleanup_reserve_s - 1.0))
        self.http_server = getattr(state, "server", None)

    def listening(self) -> bool:
        return self.http_server is None or bool(self.http_server.started)

    def take_signals(self) -> None:
        """vLLM sets its loop handlers once, before the lifespan: nothing comes back."""

    def stop_server(self) -> None:
        if self.http_server is not None:
            self.http_server.should_exit = True

    def status(self) -> dict[str, object]:
        return {"vllm_serve": {"role": self.role.value, "pid": os.getpid()}}


class QuiesceMiddleware(ServerMiddleware):
    """The ASGI middleware ``vllm serve --middleware`` adds (module docstring)."""

    server = "vllm serve"
    routes = VLLM_ROUTES
    missing_claim = (f"name the middleware on vllm serve's command line (--middleware "
                     f"{MIDDLEWARE}), not in a --config file; run one API server "
                     "(--api-server-count 1); and install quiesce in vLLM's own "
                     "environment (pip install 'quiesce[vllm]')")

    def host(self, app: Any, options: ServerOptions) -> EngineHost:
        return VllmHost(app, options)
