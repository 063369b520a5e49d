"""Typed errors of quiesce.

Every error a caller can act on has its own type. Configuration errors name the
field that was wrong and are raised at construction, before any state changes.
"""

from __future__ import annotations


class QuiesceError(Exception):
    """Base class of every error quiesce raises on purpose."""


class ConfigError(QuiesceError, ValueError):
    """A configuration value is invalid; `field` names it. Raised before any state changes."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class WorkerDraining(QuiesceError):
    """Admission is closed: the worker is draining or stopping.

    Retryable by contract: the request was not started, so a router may send it to
    another worker without any risk of running it twice.
    """

    retryable = True

    def __init__(self, request_id: str | None = None, *, state: str = "draining") -> None:
        what = f"request {request_id!r}" if request_id is not None else "request"
        super().__init__(
            f"worker is {state} and not accepting new requests; retry {what} elsewhere")
        self.request_id = request_id
        self.state = state


class RequestAborted(QuiesceError):
    """The engine ended this request before its end (engine abort, engine dead, the forced
    path): the request is ``lost``."""


class RequestRejected(QuiesceError):
    """The request's own input is invalid (found after admission, before any work): the
    request is ``rejected``, and the client gets a 400 with ``message``."""


class InvalidTransition(QuiesceError):
    """A lifecycle operation is not allowed in the current state (e.g. drain while stopping)."""

    def __init__(self, operation: str, state: str, reason: str) -> None:
        super().__init__(f"cannot {operation} while {state}: {reason}")
        self.operation = operation
        self.state = state


class ResumeFailed(QuiesceError):
    """Resume could not re-register the worker; admission was closed again and a drain restarted."""


class AdapterNotFound(QuiesceError, LookupError):
    """No adapter is registered under the requested name."""


class EngineNotInstalled(QuiesceError, ImportError):
    """An adapter's engine package is missing; the message names the extra to install."""

    def __init__(self, adapter: str, package: str, extra: str) -> None:
        super().__init__(
            f"the {adapter} adapter needs the {package!r} package: pip install 'quiesce[{extra}]'"
        )
        self.adapter = adapter
        self.package = package
        self.extra = extra
