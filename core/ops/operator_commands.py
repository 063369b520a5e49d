"""``quiesce status``, ``drain``, ``resume`` and ``prestop``: the operator commands.

Each talks to a running worker's admin API (:mod:`quiesce.admin.server`) through
:class:`quiesce.ops.admin_client.AdminClient` (imported when a command runs: httpx is an
optional extra). This module adds their subcommands to the ``quiesce`` parser
(:func:`add_operator_commands`) and holds what each one does:

- ``quiesce status [--json]``: state, generation, in-flight, pending work, drain progress;
- ``quiesce drain [--budget S] [--wait [--wait-timeout S]] [--json]``: start a drain and,
  with ``--wait``, follow it on stderr until the worker is drained;
- ``quiesce resume [--json]``: back to serving;
- ``quiesce prestop [--grace-period S] [--margin S]``: the Kubernetes preStop hook.

Common options: ``--url`` (else ``$QUIESCE_ADMIN_URL``, else ``http://127.0.0.1:8001``),
``--token-file`` (else ``$QUIESCE_ADMIN_TOKEN``), ``--timeout`` (per HTTP call).

Exit codes:

=== ==========================================================================
0   ok (``drain --wait`` and ``prestop``: the worker is drained)
1   the operation did not succeed: not drained in time, invalid transition (409),
    resume failed (503), or another error answer from the worker
2   usage: bad arguments or configuration, no request sent (or the worker
    rejected the request as invalid, changing nothing)
3   the worker's admin API is unreachable
4   unauthorized: missing or wrong bearer token
5   an HTTP call timed out
130 ``drain --wait`` interrupted (Ctrl-C); the drain goes on in the worker
=== ==========================================================================
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from quiesce.ops.status_format import Progress, ended_line, explain, format_status

if TYPE_CHECKING:
    from quiesce.ops.admin_client import AdminClient


EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_UNAUTHORIZED = 4
EXIT_TIMED_OUT = 5
EXIT_INTERRUPTED = 130

URL_ENV = "QUIESCE_ADMIN_URL"
TOKEN_ENV = "QUIESCE_ADMIN_TOKEN"
GRACE_ENV = "QUIESCE_GRACE_PERIOD_S"
DEFAULT_URL = "http://127.0.0.1:8001"
HTTP_TIMEOUT_S = 10.0
DEFAULT_GRACE_S = 30.0
DEFAULT_MARGIN_S = 5.0
MAX_SECONDS = 86_400.0
"""Largest budget or wait the admin API accepts (one day)."""
POLL_INTERVAL_S = 0.05
"""How often ``drain --wait`` and ``prestop`` read the worker's status."""
WAIT_SLACK_S = 2.0
"""``drain --wait`` with a budget: how long past the budget to wait for the worker's verdict."""

EXIT_CODES_EPILOG = """\
exit codes of status, drain, resume and prestop:
  0    ok (drain --wait, prestop: the worker is drained)
  1    the operation did not succeed: not drained in time, invalid transition
       (409), resume failed (503), or another error answer from the worker
  2    usage: bad arguments or configuration (no request sent)
  3    the worker's admin API is unreachable
  4    unauthorized: missing or wrong bearer token
  5    an HTTP call timed out
  130  drain --wait interrupted (the drain goes on in the worker)"""


class _UsageError(Exception):
    """A bad argument found after parsing (environment, combinations); exit 2, nothing sent."""


def _seconds(text: str) -> float:
    """argparse type: a positive, finite number of seconds, at most a day."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value <= 0 or value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be a positive number of seconds up to {MAX_SECONDS:g}, got {text!r}")
    return value


def _margin_seconds(text: str) -> float:
    """argparse type: zero or a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0 or value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text!r}")
    return value


def add_operator_commands(commands: Any) -> None:
    """Add ``status``, ``drain``, ``resume`` and ``prestop`` to ``quiesce``'s subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    connection = common.add_argument_group("connection to the worker's admin API")
    connection.add_argument(
        "--url", default=None,
        help=f"admin API URL (else ${URL_ENV}, else {DEFAULT_URL})")
    connection.add_argument(
        "--token-file", default=None,
        help=f"file holding the bearer token (else ${TOKEN_ENV}, else none)")
    connection.add_argument(
        "--timeout", type=_seconds, default=HTTP_TIMEOUT_S, metavar="S",
        help="limit of each HTTP call, s (%(default)s)")

    def add(name: str, help_text: str, description: str) -> argparse.ArgumentParser:
        paragraphs = description.split("\n\n")
        text = "\n\n".join(p if p.startswith(" ") else textwrap.fill(p, 79)
                           for p in paragraphs)
        sub: argparse.ArgumentParser = commands.add_parser(
            name, parents=[common], help=help_text, description=text,
            epilog=EXIT_CODES_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
        return sub

    status = add("status", "show a worker's state, in-flight requests and pending work",
                 "Read GET /engine/status: state, generation, in-flight requests, pending "
                 "work (verdict, counters, why it is unknown), discovery registration, time "
                 "in state, last error and drain progress. Only state 'drained' means the "
                 "worker is safe to delete.")
    status.add_argument("--json", action="store_true", help="print the status JSON")
    status.set_defaults(handler=_operator(_run_status))

    drain = add("drain", "start a drain; --wait follows it until the worker is drained",
                "Start (or join) a drain: unregister, router grace, close admission, wait for "
                "admitted requests and engine work to reach zero, then publish 'drained'. "
                "The drain runs in the worker: leaving (or Ctrl-C) does not stop it; "
                "'quiesce resume' does. With --wait, progress is shown on stderr and the "
                "command exits 0 once the worker is drained, 1 if the drain's budget (or "
                "--wait-timeout) ends first, saying why.")
    drain.add_argument("--budget", type=_seconds, default=None, metavar="S",
                       help="bound of the drain in seconds (default: the worker's, or none)")
    drain.add_argument("--wait", action="store_true",
                       help="follow the drain until drained (or its budget ends)")
    drain.add_argument("--wait-timeout", type=_seconds, default=None, metavar="S",
                       help="with --wait: stop waiting after S seconds (default: the drain's "
                            f"budget plus {WAIT_SLACK_S:g}s, or no limit without a budget)")
    drain.add_argument("--json", action="store_true", help="print the final status JSON")
    drain.set_defaults(handler=_operator(_run_drain))

    resume = add("resume", "return a draining or drained worker to serving",
                 "Cancel any drain run, open admission and re-register with discovery. "
                 "Fails (exit 1) while the worker is stopping (409) or if re-registration "
                 "failed (503: the worker closed admission and is draining again).")
    resume.add_argument("--json", action="store_true", help="print the status JSON")
    resume.set_defaults(handler=_operator(_run_resume))

    prestop = add(
        "prestop", "Kubernetes preStop hook: drain within the pod's grace period",
        "Drain the worker within the pod's termination grace period, minus a margin, and "
        "wait for it, printing progress lines. Kubernetes does not tell the container its "
        f"terminationGracePeriodSeconds, so pass it: --grace-period or ${GRACE_ENV} (set it "
        "in the manifest to the same value). The hook's time counts against the grace "
        "period. Exit 0 when drained, 1 otherwise; the kubelet ignores a hook's exit code "
        "and then sends SIGTERM, which runs the worker's own budgeted shutdown (it drains "
        "what is left, or aborts it at its budget). A drain already in progress is joined "
        "(its own budget is kept); prestop still waits at most grace period - margin.\n\n"
        "  terminationGracePeriodSeconds: 60\n"
        "  containers:\n"
        "  - env:\n"
        "    - {name: QUIESCE_GRACE_PERIOD_S, value: \"60\"}\n"
        "    lifecycle:\n"
        "      preStop:\n"
        "        exec: {command: [\"quiesce\", \"prestop\"]}")
    prestop.add_argument("--grace-period", type=_seconds, default=None, metavar="S",
                         help=f"the pod's terminationGracePeriodSeconds (else ${GRACE_ENV}, "
                              f"else {DEFAULT_GRACE_S:g})")
    prestop.add_argument("--margin", type=_margin_seconds, default=DEFAULT_MARGIN_S,
                         metavar="S", help="left for the SIGTERM shutdown, s (%(default)s)")
    prestop.set_defaults(handler=_operator(_run_prestop))


Operation = Callable[[argparse.Namespace, "AdminClient"], int]


def _error(args: argparse.Namespace, message: str) -> None:
    print(f"quiesce {args.command}: {message}", file=sys.stderr)


def _exit_code(exc: Exception) -> int:
    from quiesce.ops import admin_client as ac  # noqa: PLC0415 (httpx is an optional extra)

    if isinstance(exc, ac.AdminError):
        # the worker judged the request itself invalid: a usage error, nothing changed
        return EXIT_USAGE if exc.status in (400, 413, 422) else EXIT_FAILED
    codes: tuple[tuple[type[Exception], int], ...] = (
        (_UsageError, EXIT_USAGE), (ac.ClientConfigError, EXIT_USAGE),
        (ac.Unauthorized, EXIT_UNAUTHORIZED), (ac.WorkerUnreachable, EXIT_UNREACHABLE),
        (ac.RequestTimedOut, EXIT_TIMED_OUT))
    return next((code for kind, code in codes if isinstance(exc, kind)), EXIT_FAILED)


def _operator(operation: Operation) -> Callable[[argparse.Namespace], int]:
    """Run ``operation`` with a client; map every failure to one stderr line and an exit code."""

    def handler(args: argparse.Namespace) -> int:
        try:
            from quiesce.ops import admin_client as ac  # noqa: PLC0415 (httpx is an optional extra)
        except ImportError as exc:
            _error(args, f"needs httpx: pip install 'quiesce[server]' ({exc})")
            return EXIT_USAGE
        try:
            url = ac.resolve_url(args.url)
            token = ac.resolve_token(args.token_file)
            with ac.AdminClient(url, token, args.timeout) as client:
                return operation(args, client)
        except (_UsageError, ac.AdminClientError) as exc:
            _error(args, str(exc))
            return _exit_code(exc)
        except KeyboardInterrupt:
            _error(args, "interrupted; a drain already started goes on in the worker "
                         "('quiesce resume' cancels it)")
            return EXIT_INTERRUPTED

    return handler


def _print_json(status: dict[str, Any]) -> None:
    print(json.dumps(status, indent=2))


# -- waiting for drained ------------------------------------------------------------

def _drain_verdict(status: dict[str, Any]) -> tuple[bool, str] | None:
    """``(True, ...)`` once drained, ``(False, why)`` once it cannot happen, else None."""
    state = status.get("state")
    if state == "drained":
        return True, "drained"
    if state == "serving":
        return False, "the worker was resumed (state serving) before it drained"
    if state == "stopping":
        return False, ("the worker is shutting down (state stopping); its own budgeted "
                       "shutdown finishes the drain")
    if state == "draining" and status.get("drain") is None:
        return False, "the drain run ended without reaching drained"
    if state != "draining":
        return False, f"unexpected state {state!r}"
    return None


def _wait_drained(client: AdminClient, status: dict[str, Any], progress: Progress,
                  started: float, wait_s: float | None) -> tuple[bool, dict[str, Any], str]:
    """Poll the status until drained, impossible, or ``wait_s`` after ``started`` (monotonic)."""
    deadline = None if wait_s is None else started + wait_s
    while True:
        progress.update(status)
        verdict = _drain_verdict(status)
        if verdict is not None:
            return verdict[0], status, verdict[1]
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return False, status, (f"still {status.get('state')} after {now - started:.1f}s; "
                                   "stopped waiting (the drain goes on in the worker)")
        time.sleep(POLL_INTERVAL_S if deadline is None
                   else max(0.0, min(POLL_INTERVAL_S, deadline - now)))
        status = client.status()


# -- commands -----------------------------------------------------------------------

def _run_status(args: argparse.Namespace, client: AdminClient) -> int:
    status = client.status()
    if args.json:
        _print_json(status)
    else:
        print(format_status(status))
    return EXIT_OK


def _run_resume(args: argparse.Namespace, client: AdminClient) -> int:
    status = client.resume()
    if args.json:
        _print_json(status)
    else:
        print(f"{status.get('state')} (generation {status.get('generation')})")
    return EXIT_OK


def _run_drain(args: argparse.Namespace, client: AdminClient) -> int:
    started = time.monotonic()
    status = client.drain(budget_s=args.budget)
    if not args.wait:
        if args.json:
            _print_json(status)
        else:
            hint = ("; follow it with 'quiesce drain --wait' or 'quiesce status'"
                    if status.get("state") == "draining" else "")
            print(f"{status.get('state')} (generation {status.get('generation')}){hint}")
        return EXIT_OK
    wait_s: float | None = args.wait_timeout
    drain = status.get("drain")
    if wait_s is None and isinstance(drain, dict):
        left = drain.get("budget_left_s")
        if isinstance(left, (int, float)):  # the run's own budget, also when joining one
            wait_s = float(left) + WAIT_SLACK_S
    progress = Progress(sys.stderr)
    try:
        drained, status, why = _wait_drained(client, status, progress, started, wait_s)
    finally:
        progress.finish()
    if args.json:
        _print_json(status)
    if not drained:
        _error(args, "not drained: " + explain(status, why))
        return EXIT_FAILED
    if not args.json:
        requests = status.get("requests")
        since = requests.get("ended_since_drain") if isinstance(requests, dict) else None
        print(f"drained (generation {status.get('generation')}) after "
              f"{time.monotonic() - started:.1f}s: {ended_line(since)}")
    return EXIT_OK


def _grace_period(args: argparse.Namespace) -> float:
    if args.grace_period is not None:
        return float(args.grace_period)
    raw = os.environ.get(GRACE_ENV, "").strip()
    if not raw:
        return DEFAULT_GRACE_S
    try:
        return _seconds(raw)
    except argparse.ArgumentTypeError as exc:
        raise _UsageError(f"${GRACE_ENV}: {exc}") from None


def _run_prestop(args: argparse.Namespace, client: AdminClient) -> int:
    started = time.monotonic()
    grace = _grace_period(args)
    budget = grace - args.margin
    if budget <= 0:
        raise _UsageError(f"the grace period ({grace:g}s) leaves no time after the margin "
                          f"({args.margin:g}s); raise the grace period or lower --margin")
    print(f"quiesce prestop: draining {client.url} within {budget:g}s "
          f"(grace period {grace:g}s minus margin {args.margin:g}s)", file=sys.stderr)
    status = client.drain(budget_s=budget)
    progress = Progress(sys.stderr, live=False)
    drained, status, why = _wait_drained(client, status, progress, started, budget)
    if not drained:
        _error(args, f"not drained within {budget:g}s: {explain(status, why)}; SIGTERM "
                     "now runs the worker's own budgeted shutdown")
        return EXIT_FAILED
    print(f"drained (generation {status.get('generation')}) after "
          f"{time.monotonic() - started:.1f}s")
    return EXIT_OK
