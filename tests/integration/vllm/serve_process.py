"""Start vLLM's own server (``vllm serve``) on the tiny model, with or without quiesce's
middleware, and signal it the ways a worker is really stopped. Shared by
tests/integration/vllm/test_vllm_serve*.py and bench/vllm_serve.

The server is vLLM's real CLI (:mod:`tests.integration.vllm.vllm_cli`: the CPU wheel's
one packaging lookup answered), started in a session of its own so that "the process
group" is the server's. Engine steps are paced (:mod:`.paced_connector`) so that a
stream lasts long enough for a signal to land in the middle of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from tests.integration.worker_process import (
    TOKEN,
    Worker,
    running,
    signal_every_process,
    worker_processes,
)

REPO = Path(__file__).resolve().parents[3]
CLI = Path(__file__).resolve().parent / "vllm_cli.py"
MIDDLEWARE = "quiesce.serve.vllm_serve.QuiesceMiddleware"
QUIESCE_READY = '"event": "ready"'
VLLM_READY = "Application startup complete"
START_S = 300.0
DELIVERIES = ("main", "group", "every", "int")
"""main: SIGTERM to the API server only (the kubelet); group: SIGTERM to the process group
(init shims such as dumb-init, tini -g); every: SIGTERM to every process (systemd's
control-group kill, pkill); int: SIGINT to the group (a terminal's Ctrl-C)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def paced(step_s: float, **extra: object) -> str:
    """``--kv-transfer-config`` of an engine whose every step takes at least ``step_s``."""
    return json.dumps({"kv_connector": "PacedConnector",
                       "kv_connector_module_path": "tests.integration.vllm.paced_connector",
                       "kv_role": "kv_both", "kv_connector_extra_config": {"step_s": step_s,
                                                                           **extra}})


def serve_env(quiesce_args: str | None, changes: Mapping[str, str] | None = None
              ) -> dict[str, str]:
    env = {**os.environ, "QUIESCE_ADMIN_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", ""))
                                         if p)}
    env.pop("QUIESCE_SIGNAL_OWNER", None)
    if quiesce_args is None:
        env.pop("QUIESCE_VLLM_ARGS", None)
    else:
        env["QUIESCE_VLLM_ARGS"] = quiesce_args
    env.update(changes or {})
    return env


def serve_command(model: Path, port: int, *args: str, middleware: bool = True) -> list[str]:
    from tests.integration.vllm.tiny_model import engine_kwargs

    kwargs = engine_kwargs()
    command = [sys.executable, str(CLI), "serve", str(model), "--port", str(port),
               "--host", "127.0.0.1", "--max-model-len", str(kwargs["max_model_len"]),
               "--dtype", str(kwargs["dtype"]), "--enforce-eager", "--disable-log-stats",
               "--disable-uvicorn-access-log", *args]
    if "gpu_memory_utilization" in kwargs:
        command += ["--gpu-memory-utilization", str(kwargs["gpu_memory_utilization"])]
    if middleware:
        command += ["--middleware", MIDDLEWARE]
    return command


@contextlib.contextmanager
def vllm_serve(model: Path, *args: str, quiesce_args: str | None = "", middleware: bool = True,
               env: Mapping[str, str] | None = None, start_s: float = START_S
               ) -> Iterator[Worker]:
    """``vllm serve MODEL ARGS`` on free loopback ports, ready to serve; with the
    middleware, quiesce's admin API on a free port too (``quiesce_args`` are put in
    ``$QUIESCE_VLLM_ARGS`` after ``--admin-port``). Whatever is left of its processes is
    killed on the way out."""
    port = free_port()
    admin_port = free_port() if middleware else 0
    settings = None if quiesce_args is None else f"--admin-port {admin_port} {quiesce_args}"
    with running(serve_command(model, port, *args, middleware=middleware),
                 serve_env(settings, env), QUIESCE_READY if middleware else VLLM_READY,
                 timeout_s=start_s, name="vllm serve") as worker:
        worker.port, worker.admin_port = port, admin_port
        yield worker


def deliver(pid: int, how: str) -> list[int]:
    """Signal the server whose API server is ``pid`` the way ``how`` (:data:`DELIVERIES`)
    names; returns the pids signalled."""
    if how == "main":
        os.kill(pid, signal.SIGTERM)
        return [pid]
    sig = signal.SIGINT if how == "int" else signal.SIGTERM
    if how in ("group", "int"):
        members = [p for p in worker_processes(pid) if _group(p) == pid]
        os.killpg(pid, sig)
        return members
    assert how == "every", how
    return signal_every_process(pid, sig)


def _group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def engine_core_pids(pid: int) -> list[int]:
    """The EngineCore processes of the server whose API server is ``pid``."""
    found = []
    for child in worker_processes(pid)[1:]:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/comm").read_text().startswith("VLLM::EngineCor"):
                found.append(child)
    return found


def exit_events(lines: Sequence[str]) -> list[dict[str, object]]:
    """quiesce's exit lines among what the server printed."""
    from tests.integration.worker_process import json_events

    return [e for e in json_events(list(lines)) if e.get("event") == "exit"]
