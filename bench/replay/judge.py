"""Judging every request of an aiperf run from its raw export, not from aiperf's own count.

:func:`read_outcomes` / :func:`summarize`: every request of ``profile_export_raw.jsonl``
judged from its HTTP status and every SSE event of its stream (see :func:`judge_record`).
aiperf 0.13 counts a 200 stream that ended in an ``error`` event (the worker's way of
reporting a lost request once the stream started) as a success
(:func:`bench.replay.aiperf.read_aiperf_summary`); :func:`read_outcomes` does not. Pure
stdlib: the unit tests run it in the core venv.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.replay.aiperf import LOG_NAME, RAW_EXPORT, RAW_RECORDS_DIR

NO_RESPONSE = "no_response"
"""No HTTP status at all: the connection was refused or broke before the headers."""
ERROR_EVENT = "error_event"
"""A ``data:`` event carried an ``error`` object (or an SSE ``event: error``): the worker's
report of a request lost after its stream started. aiperf 0.13 counts these as successes."""
MALFORMED_EVENT = "malformed_event"
"""A ``data:`` event that is neither JSON nor ``[DONE]``."""
NO_FINISH_REASON = "no_finish_reason"
SHORT_OUTPUT = "short_output"
"""Fewer completion tokens than the request's ``max_tokens``."""
NO_MAX_TOKENS = "no_max_tokens"
"""The request carried no ``max_tokens``: whether its answer was whole cannot be told."""
NO_DONE = "no_done"
"""The stream did not end with ``data: [DONE]``."""
CLIENT_ERROR = "client_error"
"""aiperf recorded an error (timeout, transport error...) and nothing else was wrong."""
REASONS_IN_ORDER = (NO_RESPONSE, "http_*", ERROR_EVENT, MALFORMED_EVENT, NO_FINISH_REASON,
                    NO_MAX_TOKENS, SHORT_OUTPUT, NO_DONE, CLIENT_ERROR)
"""Every reason that applies is kept; the first in this order is the outcome's ``reason``
(``http_*`` is ``http_<status>``, e.g. ``http_503``)."""


@dataclasses.dataclass(frozen=True)
class RequestOutcome:
    """One request of aiperf's raw export, judged. ``reasons`` is empty iff it completed."""

    request_id: str | None
    """aiperf's ``X-Request-ID`` (``metadata.x_request_id``)."""
    status: int | None
    reasons: tuple[str, ...]
    detail: str
    """The first of: the error event or bad event, aiperf's error message, the token
    shortfall; '' if none."""
    max_tokens: int | None
    completion_tokens: int | None
    token_source: str
    """``usage`` (the final usage chunk), ``chunks`` (text chunks counted) or ``none``."""
    finish_reason: str | None
    done: bool
    events: int
    """``data:`` events received, ``[DONE]`` included."""
    aiperf_error: str | None
    """aiperf's own verdict (its ``error.type``); None: aiperf took it for a success."""
    start_ns: int | None
    """Wall clock (``time.time_ns``) when aiperf sent the request (``request_start_ns``)."""
    end_ns: int | None
    """Wall clock when aiperf saw it end (``request_end_ns``)."""
    last_event_ns: int | None
    """Wall clock of the last event received (from the events' ``perf_ns``); None if none."""
    phase: str | None
    """aiperf's ``benchmark_phase`` (``profiling``, or ``warmup``)."""

    @property
    def completed(self) -> bool:
        return not self.reasons

    @property
    def lost(self) -> bool:
        return bool(self.reasons)

    @property
    def reason(self) -> str | None:
        return self.reasons[0] if self.reasons else None

    @property
    def missed_by_aiperf(self) -> bool:
        """Lost, yet aiperf counted it as a success."""
        return self.lost and self.aiperf_error is None


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def _events(record: Mapping[str, Any]) -> list[tuple[str, str, int | None]]:
    """(SSE field name, value, perf_ns) of every packet of every response, in order."""
    out: list[tuple[str, str, int | None]] = []
    for response in record.get("responses") or ():
        if not isinstance(response, Mapping):
            continue
        perf = _int_or_none(response.get("perf_ns"))
        for packet in response.get("packets") or ():
            if isinstance(packet, Mapping):
                out.append((str(packet.get("name", "")), str(packet.get("value", "")), perf))
    return out


@dataclasses.dataclass
class _Stream:
    """What one record's SSE events say (see :func:`_scan`)."""

    reasons: list[str] = dataclasses.field(default_factory=list)
    details: list[str] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    usage_tokens: int | None = None
    text_chunks: int = 0
    data_events: int = 0
    last_data: str | None = None
    last_perf: int | None = None

    @property
    def done(self) -> bool:
        return self.last_data == "[DONE]"

    def tokens(self) -> tuple[int | None, str]:
        """(completion tokens, source): the usage chunk's count, else the text chunks."""
        if self.usage_tokens is not None:
            return self.usage_tokens, "usage"
        if self.data_events:
            return self.text_chunks, "chunks"
        return None, "none"

    def add_chunk(self, obj: Mapping[str, Any]) -> None:
        if obj.get("error") is not None:
            self.reasons.append(ERROR_EVENT)
            err = obj["error"]
            self.details.append(err if isinstance(err, str) else json.dumps(err))
        usage = obj.get("usage")
        if isinstance(usage, Mapping):
            tokens = _int_or_none(usage.get("completion_tokens"))
            if tokens is not None:
                self.usage_tokens = tokens
        for choice in obj.get("choices") or ():
            if not isinstance(choice, Mapping):
                continue
            text = choice.get("text")
            if text is None and isinstance(choice.get("delta"), Mapping):
                text = choice["delta"].get("content")  # chat completions
            if text:
                self.text_chunks += 1
            if choice.get("finish_reason") is not None:
                self.finish_reason = str(choice["finish_reason"])


def _scan(record: Mapping[str, Any]) -> _Stream:
    """Reads every event of a record's stream, to the end."""
    stream = _Stream()
    for name, value, perf in _events(record):
        if perf is not None:
            stream.last_perf = perf
        if name == "event" and value.strip() == "error":
            stream.reasons.append(ERROR_EVENT)
            stream.details.append("event: error")
            continue
        if name != "data":
            continue
        stream.data_events += 1
        stream.last_data = value.strip()
        if stream.last_data == "[DONE]":
            continue
        try:
            obj = json.loads(value)
        except ValueError:
            obj = None
        if not isinstance(obj, Mapping):
            stream.reasons.append(MALFORMED_EVENT)
            stream.details.append(f"not JSON: {value[:120]!r}"
                                  if obj is None else f"not an object: {value[:120]!r}")
            continue
        stream.add_chunk(obj)
    return stream


def judge_record(record: Mapping[str, Any], *, expect_max_tokens: bool = True) -> RequestOutcome:
    """Judges one raw-export record (one JSON object of ``profile_export_raw.jsonl``).

    The record (aiperf 0.13.0): ``status`` (absent when no response came), ``error``
    (aiperf's own verdict, absent on success), ``payload`` (the request body: ``max_tokens``
    is the trace's ``output_length``), ``responses`` (one per SSE message: ``perf_ns`` and
    ``packets`` [{``name``: ``data``, ``value``: the line after ``data: ``}]),
    ``start_perf_ns``, ``metadata`` (``x_request_id``, ``request_start_ns``,
    ``request_end_ns``, ``benchmark_phase``...).

    Lost, with every reason that applies (:data:`REASONS_IN_ORDER`): no status; a status
    other than 200; any event with an ``error`` object; an event that is not JSON; no
    ``finish_reason`` in any choice; fewer completion tokens than ``max_tokens`` (when
    ``expect_max_tokens``: the trace's requests carry ``ignore_eos``, so a complete answer
    has exactly ``max_tokens``); no ``[DONE]`` as the last event; an aiperf error when
    nothing else was wrong.

    Tokens: the final usage chunk's ``completion_tokens`` when the stream has one (the
    server's own count, sent after the last token; aiperf asks for it), else the number of
    events whose choice carries non-empty text (one token per chunk for the sim worker; a
    lower bound where a server bundles tokens). A usage chunk only arrives at the very end,
    so a cut stream is counted from its chunks.
    """
    status = _int_or_none(record.get("status"))
    metadata = record.get("metadata") or {}
    payload = record.get("payload") or {}
    error = record.get("error") or None
    aiperf_error = None
    if isinstance(error, Mapping):
        aiperf_error = str(error.get("type") or error.get("code") or "error")
    max_tokens = _int_or_none(payload.get("max_tokens", payload.get("max_completion_tokens")))

    stream = _scan(record)
    details = list(stream.details)
    completion_tokens, token_source = stream.tokens()
    if isinstance(error, Mapping) and error.get("message"):
        details.append(str(error["message"]))
    judged: list[str] = []
    if status is None:
        judged.append(NO_RESPONSE)
    elif status != 200:
        judged.append(f"http_{status}")
    if status == 200:
        judged += [r for r in (ERROR_EVENT, MALFORMED_EVENT) if r in stream.reasons]
        if stream.finish_reason is None:
            judged.append(NO_FINISH_REASON)
        if expect_max_tokens and max_tokens is None:
            judged.append(NO_MAX_TOKENS)  # cannot tell a complete answer: fail closed
        elif expect_max_tokens and max_tokens is not None and (completion_tokens or 0) < max_tokens:
            judged.append(SHORT_OUTPUT)
            details.append(f"{completion_tokens} of {max_tokens} tokens ({token_source})")
        if not stream.done:
            judged.append(NO_DONE)
    if not judged and aiperf_error is not None:
        judged.append(CLIENT_ERROR)

    start_ns = _int_or_none(metadata.get("request_start_ns"))
    start_perf = _int_or_none(record.get("start_perf_ns"))
    last_event_ns = None
    if start_ns is not None and start_perf is not None and stream.last_perf is not None:
        last_event_ns = start_ns + (stream.last_perf - start_perf)
    request_id = metadata.get("x_request_id")
    phase = metadata.get("benchmark_phase")
    return RequestOutcome(
        request_id=str(request_id) if request_id is not None else None,
        status=status,
        reasons=tuple(judged),
        detail=details[0] if details else "",
        max_tokens=max_tokens,
        completion_tokens=completion_tokens,
        token_source=token_source,
        finish_reason=stream.finish_reason,
        done=stream.done,
        events=stream.data_events,
        aiperf_error=aiperf_error,
        start_ns=start_ns,
        end_ns=_int_or_none(metadata.get("request_end_ns")),
        last_event_ns=last_event_ns,
        phase=str(phase) if phase is not None else None,
    )


def read_outcomes(raw_export: Path, *, expect_max_tokens: bool = True,
                  include_warmup: bool = False) -> list[RequestOutcome]:
    """Every request of ``profile_export_raw.jsonl`` (``raw_export`` may be the artifact
    directory: see :func:`raw_export_files`), judged by :func:`judge_record`, in the file's
    order (aiperf writes records as they complete). Warm-up records are left out unless
    ``include_warmup``.

    Raises FileNotFoundError when the export is missing (aiperf did not get as far as
    exporting: see its log) and ValueError naming the line for a line that is not a JSON
    object (e.g. a file cut by a killed aiperf)."""
    outcomes: list[RequestOutcome] = []
    for path in raw_export_files(raw_export):
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{number}: not JSON ({exc})") from exc
                if not isinstance(record, Mapping):
                    raise ValueError(f"{path}:{number}: not a JSON object")
                outcome = judge_record(record, expect_max_tokens=expect_max_tokens)
                if outcome.phase == "warmup" and not include_warmup:
                    continue
                outcomes.append(outcome)
    return outcomes


def raw_export_files(path: Path) -> list[Path]:
    """The raw records of a run: ``path`` itself if it is a file; for an artifact
    directory its ``profile_export_raw.jsonl``, or, when aiperf did not write that (it
    exits 1 without exporting when *every* request failed), the per-processor files it
    left under ``raw_records/`` (same record format, unmerged). FileNotFoundError if none."""
    if not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(f"no raw export at {path}")
        return [path]
    if (path / RAW_EXPORT).is_file():
        return [path / RAW_EXPORT]
    parts = sorted((path / RAW_RECORDS_DIR).glob("*.jsonl"))
    if not parts:
        raise FileNotFoundError(f"no {RAW_EXPORT} (nor {RAW_RECORDS_DIR}/*.jsonl) in {path}: "
                                f"did aiperf get as far as sending requests? See {LOG_NAME}")
    return parts


def summarize(outcomes: Sequence[RequestOutcome]) -> dict[str, Any]:
    """``sent`` (records), ``completed``, ``failed``, ``failures`` (primary reason -> count,
    most frequent first), ``aiperf_failed`` (records aiperf itself flagged) and
    ``missed_by_aiperf`` (lost, yet counted as a success by aiperf)."""
    failures = Counter(o.reason for o in outcomes if o.reason is not None)
    completed = sum(o.completed for o in outcomes)
    return {
        "sent": len(outcomes),
        "completed": completed,
        "failed": len(outcomes) - completed,
        "failures": dict(failures.most_common()),
        "aiperf_failed": sum(o.aiperf_error is not None for o in outcomes),
        "missed_by_aiperf": sum(o.missed_by_aiperf for o in outcomes),
    }
