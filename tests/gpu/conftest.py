"""GPU suites: skipped, with the reason printed, where there is no GPU or no engine.

They run on an H200 machine through the scripts in ci/gpu/ (``bash ci/gpu/all.sh``).
Each module names the packages it needs in ``REQUIRES``; this conftest checks the GPU
once per session and skips every test with the reason when it cannot run.

Shared fixtures and helpers for every engine's GPU suite:

- :func:`gpu_reason` — why no NVIDIA GPU answers here (``nvidia-smi -L``), or ``None``.
- ``gpu`` (session) — the first NVML device of the expected class, read with ``pynvml``;
  skips with the reason when NVML or such a device is missing. The class is ``H200``
  unless ``QUIESCE_GPU_CLASS`` says otherwise (a substring of NVML's device name, e.g.
  ``H100``; ``any`` accepts every NVIDIA GPU).
- ``tiny_model`` (session) — the tiny random-weight Llama and tokenizer the CPU tests
  use (tests/integration/vllm/tiny_model.py), built once; skips when torch or
  transformers is missing in this environment.
- ``free_port`` / :func:`pick_free_ports` — TCP ports free on 127.0.0.1 right now.
- ``engine_process`` — starts subprocesses (an engine server, ``quiesce serve``) with
  stdout and stderr in a log file under the test's tmp dir, stops them at teardown
  (SIGTERM to the process, then SIGKILL to its whole process group after a bound) and
  prints each log's tail when the test failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

GPU_CLASS_ENV = "QUIESCE_GPU_CLASS"
DEFAULT_GPU_CLASS = "H200"
STOP_GRACE_S = 30.0
"""How long an engine process gets after SIGTERM before its process group is killed."""
LOG_TAIL_LINES = 80


def gpu_reason() -> str | None:
    """Why GPU tests cannot run here, or None when an NVIDIA GPU answers."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no GPU: nvidia-smi is not installed on this machine"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no GPU: nvidia-smi failed ({exc})"
    if out.returncode != 0 or "GPU" not in out.stdout:
        return f"no GPU: nvidia-smi -L answered {out.returncode}: {out.stderr.strip()[:200]}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's collection hook sees the whole session: skip only this directory's tests
    # (``pytest tests/unit tests/gpu`` must still run the unit tests).
    here = Path(__file__).resolve().parent
    ours = [item for item in items if here in Path(str(item.path)).resolve().parents]
    reason = gpu_reason() if ours else None
    for item in ours:
        module = getattr(item, "module", None)
        needed = getattr(module, "REQUIRES", ())
        missing = [m for m in needed if importlib.util.find_spec(m) is None]
        why = reason or (f"engine not installed: {', '.join(missing)}" if missing else None)
        if why:
            item.add_marker(pytest.mark.skip(reason=why))


# -- the GPU ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GpuDevice:
    """One NVML device: its NVML index (as nvidia-smi shows it), name, UUID and driver.

    Give a subprocess ``CUDA_VISIBLE_DEVICES=<uuid>`` to put it on this device: CUDA's
    own device order need not match NVML's indices."""

    index: int
    name: str
    uuid: str
    driver: str
    count: int  # devices NVML sees on this machine


def expected_gpu_class() -> str:
    """The device class the suites expect (``QUIESCE_GPU_CLASS``, default ``H200``)."""
    return os.environ.get(GPU_CLASS_ENV, DEFAULT_GPU_CLASS).strip() or DEFAULT_GPU_CLASS


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def find_gpu(gpu_class: str | None = None) -> tuple[GpuDevice | None, str]:
    """The first device whose NVML name contains ``gpu_class`` (``any``: the first device).

    Returns ``(device, "")`` or ``(None, reason)``; never raises for a missing driver.
    """
    wanted = gpu_class if gpu_class is not None else expected_gpu_class()
    try:
        import pynvml  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        return None, "pynvml is not installed here (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"no GPU: nvmlInit failed ({type(exc).__name__}: {exc})"
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        count = int(pynvml.nvmlDeviceGetCount())
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        names = [_text(pynvml.nvmlDeviceGetName(h)) for h in handles]
        uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
    except pynvml.NVMLError as exc:
        return None, f"no GPU: NVML failed listing devices ({type(exc).__name__}: {exc})"
    finally:
        pynvml.nvmlShutdown()
    for index, name in enumerate(names):
        if wanted.lower() == "any" or wanted.lower() in name.lower():
            return GpuDevice(index, name, uuids[index], driver, count), ""
    return None, (f"no {wanted} GPU here (NVML sees {names or 'no device'}); set "
                  f"{GPU_CLASS_ENV} to the class to test, or 'any'")


@pytest.fixture(scope="session")
def gpu() -> GpuDevice:
    """The GPU under test; skips with the reason when there is none of the expected class."""
    device, reason = find_gpu()
    if device is None:
        pytest.skip(reason)
    return device


# -- the tiny model ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CPU tests' tiny random-weight Llama and tokenizer (no hub is reachable)."""
    missing = [m for m in ("torch", "transformers", "tokenizers")
               if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the tiny model needs {', '.join(missing)}, not installed here")
    from tests.integration.vllm.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


# -- ports ------------------------------------------------------------------------------


def pick_free_ports(count: int = 1, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports free on ``host`` now (another process may take one
    before it is bound: start the server soon after)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


@pytest.fixture
def free_port() -> int:
    """One TCP port free on 127.0.0.1."""
    return pick_free_ports(1)[0]


# -- engine processes ---------------------------------------------------------------------


class EngineProcess:
    """A subprocess in its own process group, its output in ``log_path``.

    :meth:`stop` sends SIGTERM to the process (as the kubelet does), waits up to
    ``grace_s``, then SIGKILLs the whole group so that no engine child outlives the test.
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: Path,
                 env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True)
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the log (empty when it cannot be read)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, what: str,
                   interval_s: float = 0.2) -> None:
        """Poll ``ready`` until true; fail with the log's tail if the process exits or
        ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if not self.alive():
                pytest.fail(f"{self.name} exited ({self.popen.returncode}) before {what}:\n"
                            f"{self.tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name}: no {what} within {timeout_s:g}s:\n{self.tail()}")
            time.sleep(interval_s)

    def wait_for_port(self, port: int, timeout_s: float, host: str = "127.0.0.1") -> None:
        """Wait until ``host:port`` accepts a TCP connection (the server is listening)."""
        def listening() -> bool:
            try:
                with socket.create_connection((host, port), timeout=1):
                    return True
            except OSError:
                return False

        self.wait_until(listening, timeout_s, f"listener on {host}:{port}")

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL the group. Returns the exit code."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(grace_s)
        # Children (engine cores, schedulers) die with the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        try:
            return self.popen.wait(10)
        except subprocess.TimeoutExpired:
            return None


_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the item, so fixtures can tell whether the test failed."""
    report: pytest.TestReport = yield
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    return report


def failed(request: pytest.FixtureRequest) -> bool:
    """Whether the requesting test's setup or call failed (for teardown decisions)."""
    reports = request.node.stash.get(_REPORTS, {})
    return any(r.failed for r in reports.values())


StartEngine = Callable[..., EngineProcess]


@pytest.fixture
def engine_process(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StartEngine]:
    """``start(name, argv, env=None, cwd=None) -> EngineProcess``; every process started
    is stopped at teardown, and its log's tail is printed when the test failed."""
    started: list[EngineProcess] = []

    def start(name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              cwd: Path | None = None) -> EngineProcess:
        process = EngineProcess(name, argv, tmp_path / f"{name}.log", env=env, cwd=cwd)
        started.append(process)
        return process

    yield start
    for process in reversed(started):
        code = process.stop()
        if failed(request):
            _show(request, f"\n----- {process.name} (pid {process.pid}, exit {code}), last "
                           f"{LOG_TAIL_LINES} lines of {process.log_path} -----\n"
                           f"{process.tail()}\n")


def _show(request: pytest.FixtureRequest, text: str) -> None:
    """Print past pytest's capture (teardown output of a failed test is otherwise hidden)."""
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if capman is None:
        sys.stderr.write(text)
        return
    with capman.global_and_fixture_disabled():
        sys.stderr.write(text)
        sys.stderr.flush()
