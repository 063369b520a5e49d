"""Driving NVIDIA's aiperf (0.13.0) offline, and judging every request from its raw export.

- :func:`write_trace`: a seeded mooncake trace (JSONL: ``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids``): Poisson arrivals at each :class:`Phase`'s rate, one
  phase after the other; input lengths from ``input_lengths`` (uniform 64-512 tokens by
  default), consistent with ``hash_ids`` and the block size; output lengths from
  ``output_lengths`` (a log-normal with a long tail by default: at the sim engine's
  0.02 s a token, a few percent run longer than 5 s). Pure, deterministic for a seed,
  milliseconds. Invalid arguments raise :class:`ValueError` naming the argument.
- :func:`aiperf_command` / :func:`run_aiperf` (asyncio):
  ``.venv-aiperf/bin/aiperf profile`` with a fixed schedule over that trace (streaming
  completions, ``ignore_eos``, usage in the stream, raw export), fully offline: the
  tokenizer is ``local/quiesce-bpe`` from the HF cache that ``ci/setup_aiperf.sh`` lays
  out under ``.cache/aiperf-hf`` (``HF_HUB_OFFLINE=1``), ``HOME`` is a fresh temporary
  directory (removed afterwards), no server metrics, no GPU telemetry, no UI. Its
  output goes to ``aiperf.log`` in the artifact directory. It costs ~10-30 s of start-up
  (services, prompt synthesis) on top of the trace's span, and a lot of one core while it
  runs. On timeout (or cancellation of :func:`run_aiperf`) its whole process group is
  killed (SIGTERM, then SIGKILL after 5 s) and the :class:`AiperfRun` says ``timed_out``;
  whatever it exported so far stays. A missing venv raises :class:`AiperfNotInstalled`
  before anything starts. aiperf's exit code is 0 even when requests failed, unless
  ``failed_request_threshold`` is given (then non-zero once that ratio is exceeded, armed
  after 10 records), and 1 without ``profile_export_raw.jsonl`` nor the summary when
  *every* request failed (:func:`raw_export_files` then reads the unmerged records).
- :func:`read_outcomes` / :func:`summarize`: every request of ``profile_export_raw.jsonl``
  judged from its HTTP status and every SSE event of its stream (see
  :func:`judge_record`). Pure stdlib: the unit tests run it in the core venv.
- :func:`read_aiperf_summary`: aiperf's own counts from ``profile_export_aiperf.json``,
  to show next to ours. aiperf 0.13 counts a 200 stream that ended in an ``error``
  event (the worker's way of reporting a lost request once the stream started) as a
  success; :func:`read_outcomes` does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

REPO = Path(__file__).resolve().parents[2]
AIPERF_VENV = REPO / ".venv-aiperf"
"""Where ``ci/setup_aiperf.sh`` installs aiperf 0.13.0."""
AIPERF_HF_HOME = REPO / ".cache" / "aiperf-hf"
"""The HF cache ``ci/setup_aiperf.sh`` lays the offline tokenizer out in."""
TOKENIZER = "local/quiesce-bpe"
BLOCK_SIZE = 64
"""Tokens per ``hash_ids`` block (aiperf's ``--isl-block-size``)."""
KILL_GRACE_S = 5.0

RAW_EXPORT = "profile_export_raw.jsonl"
RAW_RECORDS_DIR = "raw_records"
RECORDS_EXPORT = "profile_export.jsonl"
SUMMARY_EXPORT = "profile_export_aiperf.json"
LOG_NAME = "aiperf.log"


class AiperfNotInstalled(RuntimeError):
    """``.venv-aiperf`` (or the offline tokenizer) is missing: run ``ci/setup_aiperf.sh``."""


# --- the trace ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Phase:
    """``duration_s`` seconds of Poisson arrivals at ``rate_rps`` (0: no arrivals)."""

    rate_rps: float
    duration_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_rps) and self.rate_rps >= 0):
            raise ValueError(f"Phase.rate_rps must be a finite number >= 0, got {self.rate_rps!r}")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"Phase.duration_s must be a finite number > 0, "
                             f"got {self.duration_s!r}")


class LengthDistribution(Protocol):
    """Token counts of a trace: ``sample`` draws one (>= 1) from the trace's generator."""

    def sample(self, rng: random.Random) -> int: ...


@dataclasses.dataclass(frozen=True)
class UniformLengths:
    """Uniform integers in ``[low, high]``."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"UniformLengths needs 1 <= low <= high, got {self.low}, {self.high}")

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclasses.dataclass(frozen=True)
class LogNormalLengths:
    """``median * exp(sigma * N(0, 1))``, rounded and clipped to ``[minimum, maximum]``: a long
    right tail. The defaults (median 60, sigma 1.0, up to 600) put ~8 % of the requests over
    250 tokens (5 s at the sim engine's 0.02 s a token) and ~0.5 % at 600 (12 s)."""

    median: float = 60.0
    sigma: float = 1.0
    minimum: int = 8
    maximum: int = 600

    def __post_init__(self) -> None:
        if not (math.isfinite(self.median) and self.median > 0):
            raise ValueError(f"LogNormalLengths.median must be > 0, got {self.median!r}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"LogNormalLengths.sigma must be >= 0, got {self.sigma!r}")
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"LogNormalLengths needs 1 <= minimum <= maximum, "
                             f"got {self.minimum}, {self.maximum}")

    def sample(self, rng: random.Random) -> int:
        value = round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))
        return min(self.maximum, max(self.minimum, value))


DEFAULT_INPUT_LENGTHS = UniformLengths(64, 512)
DEFAULT_OUTPUT_LENGTHS = LogNormalLengths()


def arrival_times(phases: Sequence[Phase], rng: random.Random) -> list[float]:
    """Seconds from the trace start: a Poisson process at each phase's rate, in order."""
    times: list[float] = []
    start = 0.0
    for phase in phases:
        end = start + phase.duration_s
        if phase.rate_rps > 0:
            t = start + rng.expovariate(phase.rate_rps)
            while t < end:
                times.append(t)
                t += rng.expovariate(phase.rate_rps)
        start = end
    return times


def write_trace(
    path: Path,
    phases: Sequence[Phase],
    *,
    seed: int,
    input_lengths: LengthDistribution = DEFAULT_INPUT_LENGTHS,
    output_lengths: LengthDistribution = DEFAULT_OUTPUT_LENGTHS,
    block_size: int = BLOCK_SIZE,
) -> list[dict[str, Any]]:
    """Writes a mooncake trace for ``phases`` to ``path`` and returns its records.

    Each record: ``timestamp`` (integer ms from the benchmark start, non-decreasing: aiperf's
    fixed schedule sends it then), ``input_length``, ``output_length`` (aiperf sends it as
    the request's ``max_tokens``), ``hash_ids`` (``ceil(input_length / block_size)`` ids,
    unique across the trace, so no two prompts share a block). The same arguments give the
    same file. Raises ValueError for no phases, a bad block size or a distribution that
    draws a length < 1; a Phase validates itself.
    """
    if not phases:
        raise ValueError("write_trace needs at least one Phase")
    if not all(isinstance(p, Phase) for p in phases):
        raise ValueError("phases must be Phase instances")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    next_hash = 0
    for t in arrival_times(phases, rng):
        isl = input_lengths.sample(rng)
        osl = output_lengths.sample(rng)
        for name, value in (("input", isl), ("output", osl)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}_lengths drew {value!r}; lengths must be ints >= 1")
        blocks = -(-isl // block_size)
        records.append({
            "timestamp": int(t * 1000),
            "input_length": isl,
            "output_length": osl,
            "hash_ids": list(range(next_hash, next_hash + blocks)),
        })
        next_hash += blocks
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    tmp.replace(path)
    return records


# --- running aiperf ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AiperfRun:
    """One ``aiperf profile`` run. ``returncode`` is None when it was killed on timeout (or
    cancelled); the export paths are where aiperf writes them, present or not."""

    command: tuple[str, ...]
    returncode: int | None
    timed_out: bool
    wall_s: float
    artifact_dir: Path
    log: Path

    @property
    def raw_export(self) -> Path:
        return self.artifact_dir / RAW_EXPORT

    @property
    def records_export(self) -> Path:
        return self.artifact_dir / RECORDS_EXPORT

    @property
    def summary_export(self) -> Path:
        return self.artifact_dir / SUMMARY_EXPORT

    @property
    def ok(self) -> bool:
        """aiperf exited 0 and wrote its raw export (says nothing about the requests)."""
        return self.returncode == 0 and self.raw_export.is_file()


def aiperf_command(
    url: str,
    model: str,
    trace: Path,
    artifact_dir: Path,
    *,
    failed_request_threshold: float | None = None,
    block_size: int = BLOCK_SIZE,
    request_timeout_s: float | None = None,
    extra_args: Sequence[str] = (),
    venv: Path = AIPERF_VENV,
) -> list[str]:
    """The ``aiperf profile`` command line for a trace (see the module docstring)."""
    if failed_request_threshold is not None and not 0 <= failed_request_threshold <= 1:
        raise ValueError(f"failed_request_threshold must be in [0, 1], "
                         f"got {failed_request_threshold!r}")
    command = [
        str(venv / "bin" / "aiperf"), "profile",
        "--model", model,
        "--url", url,
        "--endpoint-type", "completions",
        "--streaming",
        "--custom-dataset-type", "mooncake_trace",
        "--input-file", str(trace),
        "--fixed-schedule",
        "--tokenizer", TOKENIZER,
        "--isl-block-size", str(block_size),
        "--artifact-dir", str(artifact_dir),
        "--ui", "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--export-level", "raw",
        "--extra-inputs", '{"ignore_eos": true}',
        # Server token counts; also makes aiperf send stream_options.include_usage.
        "--use-server-token-count",
    ]
    if failed_request_threshold is not None:
        command += ["--failed-request-threshold", repr(float(failed_request_threshold))]
    if request_timeout_s is not None:
        command += ["--request-timeout-seconds", repr(float(request_timeout_s))]
    command += list(extra_args)
    return command


def aiperf_env(home: Path, *, hf_home: Path = AIPERF_HF_HOME) -> dict[str, str]:
    """The environment aiperf runs in: offline HF cache, a throw-away ``HOME``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "TRANSFORMERS_", "AIPERF_", "VIRTUAL_ENV", "PYTHON"))}
    env.update({
        "HOME": str(home),
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "MPLCONFIGDIR": str(home / "matplotlib"),
        "NO_COLOR": "1",
        "PYTHONUNBUFFERED": "1",
    })
    return env


def missing(venv: Path = AIPERF_VENV, hf_home: Path = AIPERF_HF_HOME) -> str | None:
    """Why aiperf cannot run here (the venv or the tokenizer is missing), or None."""
    try:
        check_installed(venv, hf_home)
    except AiperfNotInstalled as exc:
        return str(exc)
    return None


def check_installed(venv: Path = AIPERF_VENV, hf_home: Path = AIPERF_HF_HOME) -> None:
    """Raises :class:`AiperfNotInstalled` unless the venv and the tokenizer are in place."""
    if not (venv / "bin" / "aiperf").is_file():
        raise AiperfNotInstalled(f"aiperf is not installed at {venv}: run ci/setup_aiperf.sh")
    ref = hf_home / "hub" / ("models--" + TOKENIZER.replace("/", "--")) / "refs" / "main"
    if not ref.is_file():
        raise AiperfNotInstalled(f"the offline tokenizer {TOKENIZER} is not in {hf_home}: "
                                 f"run ci/setup_aiperf.sh")


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@contextlib.contextmanager
def _prepared(artifact_dir: Path, venv: Path, hf_home: Path) -> Iterator[tuple[Path, Path]]:
    check_installed(venv, hf_home)
    artifact_dir.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="aiperf-home-"))
    try:
        yield home, artifact_dir / LOG_NAME
    finally:
        shutil.rmtree(home, ignore_errors=True)


async def run_aiperf(
    url: str,
    model: str,
    trace: Path,
    artifact_dir: Path,
    *,
    failed_request_threshold: float | None,
    timeout_s: float,
    block_size: int = BLOCK_SIZE,
    request_timeout_s: float | None = None,
    extra_args: Sequence[str] = (),
    venv: Path = AIPERF_VENV,
    hf_home: Path = AIPERF_HF_HOME,
) -> AiperfRun:
    """Runs aiperf over ``trace`` against ``url`` and waits (at most ``timeout_s``; then its
    process group is killed and the run says ``timed_out``). Cancelling it kills aiperf's
    process group too (and re-raises CancelledError). Raises :class:`AiperfNotInstalled`
    before starting anything when the venv or the tokenizer is missing; a non-zero exit of
    aiperf is reported, not raised."""
    command = aiperf_command(url, model, trace, artifact_dir,
                             failed_request_threshold=failed_request_threshold,
                             block_size=block_size, request_timeout_s=request_timeout_s,
                             extra_args=extra_args, venv=venv)
    with _prepared(artifact_dir, venv, hf_home) as (home, log), log.open("wb") as out:
        start = time.monotonic()
        process = await asyncio.create_subprocess_exec(
            *command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            env=aiperf_env(home, hf_home=hf_home), cwd=home, start_new_session=True)
        timed_out = False
        returncode: int | None = None
        try:
            returncode = await asyncio.wait_for(process.wait(), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            if process.returncode is None:
                _kill_group(process.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(asyncio.shield(process.wait()), KILL_GRACE_S)
                except asyncio.TimeoutError:
                    _kill_group(process.pid, signal.SIGKILL)
                    await process.wait()
            _kill_group(process.pid, signal.SIGKILL)
        wall = time.monotonic() - start
    return AiperfRun(tuple(command), returncode, timed_out, wall, artifact_dir, log)


# --- aiperf's own numbers ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AiperfSummary:
    """aiperf's own counts (``profile_export_aiperf.json``). ``request_count``: requests
    aiperf took for successes; ``error_request_count``: the ones it saw fail (absent from
    the file when 0)."""

    request_count: int
    error_request_count: int
    was_cancelled: bool
    error_summary: tuple[tuple[str, int], ...]
    """(``code type: message``, count) for each kind of error aiperf saw."""

    @property
    def sent(self) -> int:
        return self.request_count + self.error_request_count


def _metric(data: Mapping[str, Any], key: str) -> int:
    value = data.get(key)
    if isinstance(value, Mapping):
        value = value.get("avg")
    if value is None:
        return 0
    return round(float(value))


def read_aiperf_summary(path: Path) -> AiperfSummary:
    """aiperf's counts from ``profile_export_aiperf.json`` (``path`` may be the artifact
    directory). Raises FileNotFoundError / ValueError (bad JSON) as ``json`` does."""
    if path.is_dir():
        path = path / SUMMARY_EXPORT
    data = json.loads(path.read_text())
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: not a JSON object")
    errors: list[tuple[str, int]] = []
    for entry in data.get("error_summary") or ():
        details = entry.get("error_details") or {}
        label = f"{details.get('code')} {details.get('type')}: {details.get('message')}"
        errors.append((label, int(entry.get("count") or 0)))
    return AiperfSummary(
        request_count=_metric(data, "request_count"),
        error_request_count=_metric(data, "error_request_count"),
        was_cancelled=bool(data.get("was_cancelled")),
        error_summary=tuple(errors),
    )


# --- our judgement ----------------------------------------------------------------------

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
