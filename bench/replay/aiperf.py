"""Running NVIDIA's aiperf (0.13.0) offline over a trace (:mod:`bench.replay.trace`), and
reading aiperf's own counts; every request is judged by :mod:`bench.replay.judge`.

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
  *every* request failed (:func:`bench.replay.judge.raw_export_files` then reads the
  unmerged records).
- :func:`read_aiperf_summary`: aiperf's own counts from ``profile_export_aiperf.json``,
  to show next to ours. aiperf 0.13 counts a 200 stream that ended in an ``error``
  event (the worker's way of reporting a lost request once the stream started) as a
  success; :func:`bench.replay.judge.read_outcomes` does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.replay.trace import BLOCK_SIZE

REPO = Path(__file__).resolve().parents[2]
AIPERF_VENV = REPO / ".venv-aiperf"
"""Where ``ci/setup_aiperf.sh`` installs aiperf 0.13.0."""
AIPERF_HF_HOME = REPO / ".cache" / "aiperf-hf"
"""The HF cache ``ci/setup_aiperf.sh`` lays the offline tokenizer out in."""
TOKENIZER = "local/quiesce-bpe"
KILL_GRACE_S = 5.0

RAW_EXPORT = "profile_export_raw.jsonl"
RAW_RECORDS_DIR = "raw_records"
RECORDS_EXPORT = "profile_export.jsonl"
SUMMARY_EXPORT = "profile_export_aiperf.json"
LOG_NAME = "aiperf.log"


class AiperfNotInstalled(RuntimeError):
    """``.venv-aiperf`` (or the offline tokenizer) is missing: run ``ci/setup_aiperf.sh``."""


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
