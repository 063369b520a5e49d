"""How the CLI shows a worker's status to a person: the ``quiesce status`` summary, the
one-line drain progress of ``quiesce drain --wait`` / ``prestop``, and the one-line
explanation of a drain that did not finish. Pure formatting of the admin API's status
dict (``GET /engine/status``); a missing or malformed field shows as ``?``, never raises.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TextIO

PLAIN_PROGRESS_INTERVAL_S = 1.0
"""Without a terminal, the progress display writes a plain line at most this often."""


def _num(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "?"
    return f"{value:.1f}s"


def _counters(pending: dict[str, Any]) -> list[tuple[str, object]]:
    names = ("waiting", "running", "kv_sends_held", "kv_recvs_awaited")
    out: list[tuple[str, object]] = [(name, pending.get(name)) for name in names]
    queues = pending.get("queues")
    if isinstance(queues, dict):
        out += sorted(queues.items())
    return out


def _pending_line(pending: dict[str, Any] | None) -> str:
    """``busy, 3 in total (waiting 0, running 3, ...) from sim.engine``."""
    if not pending:
        return "not read"
    counters = ", ".join(f"{name} {'?' if value is None else value}"
                         for name, value in _counters(pending))
    total = pending.get("total")
    total_text = "total unknown" if total is None else f"{total} in total"
    text = f"{pending.get('verdict', '?')}, {total_text} ({counters})"
    if pending.get("engine_has_work") is not None:
        text += f", engine_has_work {str(pending['engine_has_work']).lower()}"
    if pending.get("source"):
        text += f" from {pending['source']}"
    return text


def _pending_short(pending: dict[str, Any] | None) -> str:
    """``pending 3 (running 3)``: the total counting down, and what is not zero."""
    if not pending:
        return "pending ?"
    total = pending.get("total")
    busy = ", ".join(f"{name} {'?' if value is None else value}"
                     for name, value in _counters(pending) if value != 0)
    head = "pending ?" if total is None else f"pending {total}"
    return f"{head} ({busy})" if busy else head


def _eta_text(eta: object) -> str | None:
    """``~3.2 s (at most 7.5 s)``, ``unknown: why``; None where the probe gives no ETA."""
    if not isinstance(eta, dict):
        return None
    expected, upper = eta.get("expected_s"), eta.get("upper_s")
    if not isinstance(expected, (int, float)):
        return f"unknown: {eta.get('reason') or '?'}"
    bound = (f"at most {upper:.1f}s" if isinstance(upper, (int, float))
             else f"no bound: {eta.get('reason') or '?'}")
    return f"~{expected:.1f}s ({bound})"


BAR_WIDTH = 20


def _eta_bar(drain: dict[str, Any], eta: object) -> str | None:
    """``[########------------] 40% ETA ~3.0s (at most 5.0s)``: time spent draining
    against that plus the estimate still to go; None without an estimate."""
    text = _eta_text(eta)
    elapsed = drain.get("elapsed_s")
    expected = eta.get("expected_s") if isinstance(eta, dict) else None
    if text is None or not isinstance(expected, (int, float)) \
            or not isinstance(elapsed, (int, float)):
        return None if text is None else f"ETA {text}"
    done = elapsed / (elapsed + expected) if elapsed + expected > 0 else 1.0
    filled = round(done * BAR_WIDTH)
    return f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {done:4.0%} ETA {text}"


def _reasons(pending: dict[str, Any] | None) -> list[str]:
    reasons = (pending or {}).get("reasons")
    return [str(r) for r in reasons] if isinstance(reasons, list) else []


def _drain_line(drain: dict[str, Any]) -> str:
    budget = drain.get("budget_s")
    text = f"stage {drain.get('stage', '?')}, {_num(drain.get('elapsed_s'))} elapsed"
    if budget is None:
        text += " (no budget)"
    else:
        text += f" of {_num(budget)} budget ({_num(drain.get('budget_left_s'))} left)"
    trend = drain.get("trend")
    if isinstance(trend, list) and trend:
        points = [str(p[1]) if isinstance(p, list) and len(p) > 1 and p[1] is not None else "?"
                  for p in trend[-6:]]
        text += ", pending trend " + " → ".join(points)
    return text


def format_status(status: dict[str, Any]) -> str:
    """The human summary of ``quiesce status``."""
    rows: list[tuple[str, str]] = []
    rows.append(("state", f"{status.get('state', '?')} (generation {status.get('generation')}, "
                          f"{_num(status.get('seconds_in_state'))} in state)"))
    warnings = status.get("warnings")
    rows += [("WARNING", str(w)) for w in (warnings if isinstance(warnings, list) else ())]
    admission = "admission open" if status.get("accepting") else "admission closed"
    rows.append(("in-flight", f"{status.get('inflight_requests', '?')} request(s), {admission}"))
    pending = status.get("pending_work")
    rows.append(("pending work", _pending_line(pending if isinstance(pending, dict) else None)))
    rows += [("  unknown", reason) for reason in
             _reasons(pending if isinstance(pending, dict) else None)]
    eta = pending.get("eta") if isinstance(pending, dict) else None
    eta_text = _eta_text(eta)
    if eta_text is not None and isinstance(eta, dict):
        rows.append(("drain ETA", f"{eta_text} from {eta.get('basis', '?')}"))
    registered = status.get("discovery_registered")
    rows.append(("registration", "registered with discovery" if registered is True else
                 "not registered with discovery" if registered is False else
                 f"unknown ({status.get('discovery_error') or 'the backend does not say'})"))
    rows.append(("last error", str(status.get("last_error") or "none")))
    requests = status.get("requests")
    if isinstance(requests, dict):
        rows.append(("requests", ended_line(requests.get("ended_total"))
                     + f", {requests.get('refused_total', '?')} refused at the gate"))
        since = requests.get("ended_since_drain")
        if isinstance(since, dict):
            rows.append(("  since drain", ended_line(since)))
    guard = status.get("signal_guard")
    if isinstance(guard, dict):
        rows.append(("signal guard", str(guard.get("summary", "?"))))
    cost = status.get("drain_cost")
    if isinstance(cost, dict):
        rows.append(("drain cost", _cost_line(cost, status.get("deletion_cost"))))
    drain = status.get("drain")
    if isinstance(drain, dict):
        rows.append(("drain", _drain_line(drain)))
    last = status.get("last_drain")
    if isinstance(last, dict):
        result = "drained" if last.get("drained") else f"not drained ({last.get('outcome')})"
        rows.append(("last drain", f"{result} after {_num(last.get('elapsed_s'))} "
                                   f"(generation {last.get('generation')})"))
    width = max(len(label) for label, _ in rows) + 2
    return "\n".join(f"{label + ':':<{width}}{value}" for label, value in rows)


def _cost_line(cost: dict[str, Any], published: object) -> str:
    """``3 requests (pending_work)``, the fallback's reason, and the pod annotation's state."""
    line = f"{cost.get('value', '?')} {cost.get('unit', '')} ({cost.get('source', '?')})"
    if cost.get("reason"):
        line += f": a lower bound, {cost['reason']}"
    if isinstance(published, dict):
        line += f"; pod-deletion-cost {published.get('published')}"
        if published.get("last_error"):
            line += f" (not updating: {published['last_error']})"
    return line


def ended_line(counts: object) -> str:
    """``12 completed, 0 lost, 1 client gone, 0 rejected`` from an outcome-count dict."""
    if not isinstance(counts, dict):
        return "unknown"
    return ", ".join(f"{counts.get(key, '?')} {key.replace('_', ' ')}"
                     for key in ("completed", "lost", "client_gone", "rejected"))


def _lost_since_drain(status: dict[str, Any]) -> int:
    requests = status.get("requests")
    since = requests.get("ended_since_drain") if isinstance(requests, dict) else None
    lost = since.get("lost") if isinstance(since, dict) else 0
    return lost if isinstance(lost, int) else 0


def progress_line(status: dict[str, Any]) -> str:
    """One line of drain progress: state, stage, pending work, in-flight, elapsed vs budget,
    and a bar of the time spent against the estimated time still to go (the drain ETA)."""
    drain = status.get("drain")
    pending = status.get("pending_work")
    parts = [str(status.get("state", "?"))]
    if isinstance(drain, dict):
        parts[0] += f" [{drain.get('stage', '?')}]"
    parts.append(_pending_short(pending if isinstance(pending, dict) else None))
    parts.append(f"in-flight {status.get('inflight_requests', '?')}")
    lost = _lost_since_drain(status)
    if lost:
        parts.append(f"LOST {lost}")
    if isinstance(drain, dict):
        budget = drain.get("budget_s")
        parts.append(f"{_num(drain.get('elapsed_s'))} / "
                     + ("no budget" if budget is None else _num(budget)))
        bar = _eta_bar(drain, pending.get("eta") if isinstance(pending, dict) else None)
        if bar is not None:
            parts.append(bar)
    return " · ".join(parts)


class Progress:
    """Drain progress on a stream: one refreshed line on a TTY, else plain lines at most
    once per ``interval_s``."""

    def __init__(self, stream: TextIO, live: bool | None = None,
                 interval_s: float = PLAIN_PROGRESS_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.live = stream.isatty() if live is None else live
        self.interval_s = interval_s
        self._clock = clock
        self._last_at: float | None = None
        self._open_line = False

    def update(self, status: dict[str, Any]) -> None:
        line = progress_line(status)
        if self.live:
            self.stream.write("\r\x1b[K" + line[:self._width()])
            self._open_line = True
        else:
            now = self._clock()
            if self._last_at is not None and now - self._last_at < self.interval_s:
                return
            self._last_at = now
            self.stream.write(line + "\n")
        self.stream.flush()

    def _width(self) -> int:
        """The terminal's width less one, so the refreshed line never wraps."""
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError, AttributeError):
            columns = 0
        return columns - 1 if columns > 20 else 120  # 0: a terminal that tells no size

    def finish(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False


def explain(status: dict[str, Any], why: str) -> str:
    """One line: why, the last error, what is still pending and why it is unknown."""
    parts = [why]
    if status.get("last_error"):
        parts.append(f"last error: {status['last_error']}")
    pending = status.get("pending_work")
    pending = pending if isinstance(pending, dict) else None
    parts.append(f"in-flight {status.get('inflight_requests', '?')}, "
                 f"{_pending_short(pending)}")
    lost = _lost_since_drain(status)
    if lost:
        parts.append(f"{lost} admitted request(s) lost since the drain began")
    reasons = _reasons(pending)
    if reasons:
        parts.append("unknown because: " + "; ".join(reasons))
    return " — ".join(parts)
