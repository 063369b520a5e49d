"""quiesce's claim in an engine's own server process, made before the engine starts.

An engine's plugin hook runs in the server's main process before the engine's processes
start (vLLM: :mod:`quiesce.serve.vllm_plugin`; SGLang: :mod:`quiesce.serve.sglang_plugin`).
There, once per process, :func:`make_claim`:

1. loads the admin token and the pod's identity (``--publish-deletion-cost``), and binds
   the admin port (not listening yet); any problem raises ConfigError naming the setting
   (the plugin then exits 2, before the engine loads);
2. sends quiesce's log lines to stderr in the engine's style (the engines configure only
   their own loggers);
3. claims signal ownership (:class:`~quiesce.signal_guard.SignalOwnership`): the engine's
   processes, started next, inherit the claim and are guarded by quiesce's engine plugin.
   The claim starts *permitted*: while the engine starts nothing is admitted, so a signal
   then is the engine's to act on, as without quiesce. The server face takes the permit
   back (:meth:`~quiesce.signal_guard.SignalOwnership.hold`) when it starts serving
   (:mod:`quiesce.serve.server_worker`).

:func:`current_claim` hands the claim to the face in the same process; ``None`` means no
claim was made here (the face then refuses to start, saying why). :func:`exit_with` makes
the process exit with a given code however the engine's own unwinding ends.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from quiesce.errors import ConfigError
from quiesce.serve.server_options import ServerOptions
from quiesce.signal_guard import SignalOwnership

if TYPE_CHECKING:
    from quiesce.admin.pod_deletion_cost import PodIdentity

log = logging.getLogger("quiesce.serve.server_claim")

EXIT_CONFIG = 2
"""The exit code of a server whose quiesce settings are bad (before the engine starts)."""


@dataclasses.dataclass
class Claim:
    """What :func:`make_claim` prepared for the server face of this process."""

    options: ServerOptions
    signals: SignalOwnership
    admin_socket: socket.socket
    token: str | None
    pod: PodIdentity | None


class _Claimed:
    claim: Claim | None = None
    exit_code: int | None = None


def current_claim() -> Claim | None:
    """The claim made in this process by :func:`make_claim`, or None."""
    return _Claimed.claim


def make_claim(options: ServerOptions, engine: str) -> Claim:
    """Make this process's claim (module docstring, steps 1-3) and keep it for
    :func:`current_claim`. ``engine`` names the server in log lines. ConfigError or
    OSError before anything was claimed."""
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
    _log_to_stderr()
    atexit.register(_apply_exit_code)  # runs after the release below (last in, first out)
    signals = SignalOwnership()
    signals.claim()
    signals.permit_shutdown()  # the engine's to act on until the face serves
    atexit.register(signals.release)
    log.info("quiesce claimed the signals of %s (pid %d) before the engine starts; "
             "admin API on %s:%d", engine, os.getpid(), options.admin_host,
             admin_socket.getsockname()[1])
    _Claimed.claim = Claim(options, signals, admin_socket, token, pod)
    return _Claimed.claim


def exit_with(code: int) -> None:
    """Make this process exit with ``code`` however the engine's own unwinding ends (a
    server that stopped on its own returns normally: exit code 0). Applied by an
    ``atexit`` handler :func:`make_claim` registered before the engine registered its own:
    it runs after theirs, flushes the logs, stdout and stderr, then ``os._exit(code)``."""
    _Claimed.exit_code = code


def _apply_exit_code() -> None:
    code = _Claimed.exit_code
    if code is None:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _log_to_stderr() -> None:
    """The engines configure their own loggers only: quiesce's INFO lines (the claim, the
    drain's progress, the shutdown's report) go to stderr, unless the process's logging
    already has a handler for them."""
    logger = logging.getLogger("quiesce")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"(quiesce pid={os.getpid()}) %(levelname)s %(asctime)s [%(name)s] %(message)s",
        "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
