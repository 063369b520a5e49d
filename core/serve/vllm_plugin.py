"""quiesce's claim in ``vllm serve``'s API server process, made before the engine starts.

Registered as the ``quiesce_serve`` entry of ``vllm.general_plugins``: vLLM calls
:func:`register` in every process it starts, and in the API server process that is while
it builds its argument parser (``AsyncEngineArgs.add_cli_args``), before it parses the
command line, starts the engine or installs a signal handler. Only there, and only when
the command line names quiesce's middleware (``--middleware`` :data:`MIDDLEWARE`), does
it act; everywhere else it returns at once (cost: one ``sys.argv`` scan).

What it does, in order, so that a bad setting refuses the start before the (slow) engine:

1. read quiesce's settings from ``$QUIESCE_VLLM_ARGS`` (:mod:`quiesce.serve.vllm_options`),
   the admin token, the pod's identity (``--publish-deletion-cost``), and bind the admin
   port (not listening yet). Any problem: one line on stderr naming the setting, and
   ``vllm serve`` exits with code 2;
2. send quiesce's log lines to stderr in vLLM's format (vLLM configures only its own);
3. claim signal ownership (:class:`~quiesce.signal_guard.SignalOwnership`): the engine's
   processes, started next, inherit the claim and are guarded by quiesce's engine plugin
   (:mod:`quiesce.adapters.vllm.plugin`). The claim starts *permitted*: while vLLM starts
   nothing is admitted, so a signal then is vLLM's to act on, as without quiesce. The
   middleware takes the permit back (:meth:`~quiesce.signal_guard.SignalOwnership.hold`)
   when it starts serving (:mod:`quiesce.serve.vllm_serve`).

:func:`current_claim` hands the result to the middleware in the same process; ``None``
means no claim was made here (the middleware then refuses to start, saying why).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import os
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from quiesce.errors import ConfigError
from quiesce.serve.vllm_options import ARGS_ENV, VllmServeOptions, parse_vllm_serve_options
from quiesce.signal_guard import OWNER_ENV, SignalOwnership

if TYPE_CHECKING:
    from quiesce.admin.pod_deletion_cost import PodIdentity

log = logging.getLogger("quiesce.serve.vllm_plugin")

MIDDLEWARE = "quiesce.serve.vllm_serve.QuiesceMiddleware"
"""What ``vllm serve --middleware`` is given (``app.add_middleware`` of this class)."""
EXIT_CONFIG = 2


@dataclasses.dataclass
class Claim:
    """What :func:`register` prepared for the middleware of this process."""

    options: VllmServeOptions
    signals: SignalOwnership
    admin_socket: socket.socket
    token: str | None
    pod: PodIdentity | None


class _Claimed:
    claim: Claim | None = None


def current_claim() -> Claim | None:
    """The claim made in this process by :func:`register`, or None."""
    return _Claimed.claim


def names_middleware(argv: Sequence[str]) -> bool:
    """Whether ``argv`` passes quiesce's middleware to ``--middleware``."""
    for index, arg in enumerate(argv):
        if arg == f"--middleware={MIDDLEWARE}":
            return True
        if arg == "--middleware" and index + 1 < len(argv) and argv[index + 1] == MIDDLEWARE:
            return True
    return False


def register() -> None:
    """Entry point of ``vllm.general_plugins`` (module docstring). Idempotent; a no-op in
    the engine's processes and in any process whose command line does not name
    :data:`MIDDLEWARE`; exits the process with code 2 on a bad setting."""
    if _Claimed.claim is not None or multiprocessing.parent_process() is not None:
        return
    if not names_middleware(sys.argv) or OWNER_ENV in os.environ:
        return  # not vllm serve with quiesce, or started by another quiesce worker
    try:
        _Claimed.claim = _claim(parse_vllm_serve_options())
    except (ConfigError, OSError) as exc:
        print(f"vllm serve: quiesce refuses to start: {exc} (settings: ${ARGS_ENV})",
              file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG) from None


def _claim(options: VllmServeOptions) -> Claim:
    from quiesce.admin.pod_deletion_cost import PodIdentity  # noqa: PLC0415 (HTTP stack)
    from quiesce.admin.server import bind_socket, check_bind, load_token  # noqa: PLC0415

    token = load_token(options.admin_token_file)
    check_bind(options.admin_host, token)
    pod = PodIdentity.from_environment() if options.publish_deletion_cost else None
    try:
        admin_socket = bind_socket(options.admin_host, options.admin_port, listen=False)
    except OSError as exc:
        raise ConfigError("--admin-port", f"cannot bind {options.admin_host}:"
                          f"{options.admin_port}: {exc}") from None
    _log_like_vllm()
    signals = SignalOwnership()
    signals.claim()
    signals.permit_shutdown()  # vLLM's to act on until the middleware serves
    atexit.register(signals.release)
    log.info("quiesce claimed the signals of vllm serve (pid %d) before the engine starts; "
             "admin API on %s:%d", os.getpid(), options.admin_host,
             admin_socket.getsockname()[1])
    return Claim(options, signals, admin_socket, token, pod)


def _log_like_vllm() -> None:
    """vLLM configures its own loggers only: quiesce's INFO lines (the claim, the drain's
    progress, the shutdown's report) go to stderr in vLLM's format, unless the process's
    logging already has a handler for them."""
    logger = logging.getLogger("quiesce")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"(quiesce pid={os.getpid()}) %(levelname)s %(asctime)s [%(name)s] %(message)s",
        "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
