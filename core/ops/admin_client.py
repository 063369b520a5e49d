"""A small synchronous client of a worker's admin API (:mod:`quiesce.admin.server`), for the CLI.

:class:`AdminClient` wraps ``GET /engine/status``, ``POST /engine/drain`` and
``POST /engine/resume``; each returns the worker's status as a dict (the keys of
:meth:`quiesce.lifecycle.Status.to_dict`). Failures are typed, each with a one-line
message, all subclasses of :class:`AdminClientError`:

- :class:`WorkerUnreachable`: no connection (refused, reset, bad host);
- :class:`RequestTimedOut`: the call did not finish within the client's timeout;
- :class:`Unauthorized`: the worker answered 401 (missing or wrong bearer token);
- :class:`AdminError`: any other 4xx/5xx, with the worker's error ``type`` and message.

The client talks to the admin API directly: proxy variables of the environment are
ignored (the API binds loopback by default). It needs ``httpx`` (``quiesce[server]``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

TOKEN_ENV = "QUIESCE_ADMIN_TOKEN"
URL_ENV = "QUIESCE_ADMIN_URL"
DEFAULT_URL = "http://127.0.0.1:8001"
"""The reference worker's default admin address (``quiesce serve --admin-port 8001``)."""
DEFAULT_TIMEOUT_S = 10.0


class AdminClientError(Exception):
    """Base class of every error the admin client raises; ``str()`` is one line."""


class ClientConfigError(AdminClientError):
    """The client itself is misconfigured (bad URL, unreadable token file); nothing was sent."""


class WorkerUnreachable(AdminClientError):
    """No connection to the admin API."""


class RequestTimedOut(AdminClientError):
    """The admin API did not answer within the timeout."""


class Unauthorized(AdminClientError):
    """The admin API answered 401: the bearer token is missing or wrong."""


class AdminError(AdminClientError):
    """The admin API answered another 4xx/5xx; ``type`` is the worker's error type."""

    def __init__(self, status: int, type: str, message: str,
                 retryable: bool = False) -> None:
        super().__init__(f"HTTP {status} {type}: {message}")
        self.status = status
        self.type = type
        self.message = message
        self.retryable = retryable


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def resolve_token(token_file: str | None = None) -> str | None:
    """The bearer token: ``token_file`` if given, else ``$QUIESCE_ADMIN_TOKEN``, else None."""
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ClientConfigError(
                f"cannot read token file {token_file}: {exc.strerror or exc}") from exc
        if not token:
            raise ClientConfigError(f"token file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV, "").strip() or None


def resolve_url(url: str | None = None) -> str:
    """The admin URL: ``url`` if given, else ``$QUIESCE_ADMIN_URL``, else :data:`DEFAULT_URL`.

    Raises :class:`ClientConfigError` unless it is an ``http(s)://host[:port]`` URL.
    """
    chosen = (url or os.environ.get(URL_ENV, "").strip() or DEFAULT_URL).rstrip("/")
    try:
        parsed = httpx.URL(chosen)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise ClientConfigError(f"invalid admin URL {chosen!r}: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ClientConfigError(
            f"invalid admin URL {chosen!r}: expected http://HOST:PORT (e.g. {DEFAULT_URL})")
    return chosen


def _check_seconds(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ClientConfigError(f"{name} must be a positive number of seconds, got {value!r}")


class AdminClient:
    """Synchronous client of one worker's admin API. Use it as a context manager or ``close()``.

    ``timeout`` bounds every HTTP call (connect, read, write). A ``drain(wait=True)``
    call may last longer: its read timeout is extended by ``wait_timeout_s`` (and is
    unbounded when the server-side wait is).
    """

    def __init__(self, url: str, token: str | None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        _check_seconds("timeout", timeout)
        self.url = resolve_url(url)
        self.timeout = float(timeout)
        headers = {"Accept": "application/json", "User-Agent": "quiesce-cli"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        self._client = httpx.Client(base_url=self.url, headers=headers,
                                    timeout=self.timeout, trust_env=False)

    # -- context ------------------------------------------------------------------

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- operations ---------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """``GET /engine/status``: state, generation, in-flight, pending work, drain progress."""
        return self._call("GET", "/engine/status")

    def drain(self, budget_s: float | None = None, wait: bool = False,
              wait_timeout_s: float | None = None) -> dict[str, Any]:
        """``POST /engine/drain``: start (or join) a drain; the status afterwards.

        ``state == "drained"`` in the answer is the only deletion-safety signal; with
        ``wait=False`` the answer is normally ``draining``.
        """
        _check_seconds("budget_s", budget_s)
        _check_seconds("wait_timeout_s", wait_timeout_s)
        body: dict[str, Any] = {"wait": bool(wait)}
        if budget_s is not None:
            body["budget_s"] = float(budget_s)
        if wait_timeout_s is not None:
            body["wait_timeout_s"] = float(wait_timeout_s)
        timeout: httpx.Timeout | None = None
        if wait:
            read = None if wait_timeout_s is None else self.timeout + wait_timeout_s
            timeout = httpx.Timeout(self.timeout, read=read)
        return self._call("POST", "/engine/drain", body=body, timeout=timeout)

    def resume(self) -> dict[str, Any]:
        """``POST /engine/resume``: back to serving; the status afterwards."""
        return self._call("POST", "/engine/resume")

    # -- plumbing -----------------------------------------------------------------

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
              timeout: httpx.Timeout | None = None) -> dict[str, Any]:
        where = f"{method} {self.url}{path}"
        try:
            if timeout is None:
                response = self._client.request(method, path, json=body)
            else:
                response = self._client.request(method, path, json=body, timeout=timeout)
        except httpx.TimeoutException as exc:
            what = "connecting" if isinstance(exc, httpx.ConnectTimeout) else "waiting for"
            raise RequestTimedOut(f"{what} {where} timed out "
                                  f"(timeout {self.timeout:g}s)") from exc
        except httpx.ConnectError as exc:
            raise WorkerUnreachable(f"cannot connect to the worker's admin API at {self.url}: "
                                    f"{_one_line(str(exc)) or type(exc).__name__}") from exc
        except httpx.TransportError as exc:
            raise WorkerUnreachable(f"{where} failed: {type(exc).__name__}: "
                                    f"{_one_line(str(exc))}") from exc
        return self._parse(response, where)

    @staticmethod
    def _parse(response: httpx.Response, where: str) -> dict[str, Any]:
        try:
            payload: Any = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            payload = None
        if response.status_code >= 400:
            error = payload.get("error") if isinstance(payload, dict) else None
            if isinstance(error, dict):
                kind = str(error.get("type") or "error")
                message = _one_line(str(error.get("message") or response.reason_phrase))
                retryable = bool(error.get("retryable", False))
            else:
                kind = "http_error"
                message = _one_line(response.text) or response.reason_phrase
                retryable = False
            if response.status_code == 401:
                raise Unauthorized(f"{where} was refused (401 {kind}): {message}; set "
                                   f"${TOKEN_ENV} or --token-file")
            raise AdminError(response.status_code, kind, message, retryable)
        if not isinstance(payload, dict) or "state" not in payload:
            raise AdminError(response.status_code, "bad_response",
                             f"{where} did not answer with a worker status "
                             f"(is this a quiesce admin API?): {_one_line(response.text, 120)}")
        return payload
