"""Workers with vLLM's real NixlConnector on the CPU, for the disaggregated tests and the
``vllm serve`` benchmark: ``vllm serve`` (with or without quiesce's middleware) or
``quiesce serve --engine vllm``, each with a NIXL side channel of its own on the loopback.

The workers' NIXL agents run without their progress thread (``nixl_cpu/sitecustomize.py``:
it busy-polls a whole core per engine, which two engines on this two-core machine cannot
afford); NIXL then progresses in the calls vLLM's connector makes on each engine step.
Neither vLLM's NIXL connector (same ``sitecustomize.py``) nor its CPU backend
(:data:`NO_CPU_BINDING`) pins a worker's main thread to a core.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from tests.integration.vllm.serve_process import vllm_serve
from tests.integration.worker_process import Worker, start_worker

LOOPBACK = "127.0.0.1"
KV_LEASE_S = 120
"""The prefill worker's lease on held KV blocks (vLLM's own safety net; default 30 s):
far longer than any scenario here, so held KV is freed by the decoder's pull or not at
all (each test checks that no lease expired)."""
LEASE_EXPIRED = "Releasing expired KV blocks"
"""What vLLM's NIXL worker logs when a lease frees held KV (``nixl/base_worker.py``)."""
DECODE_TOKENS = 12
START_S = 300.0
LEFTOVER_GRACE_S = 15.0
POLL_S = 0.05
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
NIXL_CPU_SITE = Path(__file__).resolve().parent / "nixl_cpu"
"""Put first on the workers' PYTHONPATH: NIXL agents without their busy-polling progress
thread (see its ``sitecustomize.py``; two such threads take both cores of this machine)."""
NO_CPU_BINDING = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""vLLM's CPU backend binds each engine's OpenMP threads, the model worker's main thread
among them, as if the engine had the machine to itself (``auto``: core ids ``[0, 1]``
here, the main thread on CPU 0), so two engines put both main threads, which step the
engine and make every NIXL call, on one core (``taskset -pc``; the NIXL connector's own
pin, to CPU 1, is undone in ``nixl_cpu/sitecustomize.py``, which says what that sharing
did to the pulls). ``nobind`` leaves the placement to the kernel."""


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for what starts inside, then restore them."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def nixl_worker(model: Path, role: str, *quiesce_args: str, face: str = "vllm",
                vllm_args: tuple[str, ...] = ()) -> Iterator[Worker]:
    """A worker of ``role`` with a NixlConnector and a side channel of its own: ``vllm
    serve`` with quiesce's middleware (``face="vllm"``, ``quiesce_args`` in
    ``$QUIESCE_VLLM_ARGS``), plain ``vllm serve`` (``"vllm_own"``: ``vllm_args`` such as
    ``--shutdown-timeout``) or ``quiesce serve --engine vllm`` (``"quiesce"``); on the way
    out, whatever is left of its processes is killed."""
    from tests.integration.vllm.tiny_model import engine_kwargs

    kv_config = json.dumps({"kv_connector": "NixlConnector", "kv_role": KV_ROLES[role],
                            "kv_connector_extra_config": {"kv_lease_duration": KV_LEASE_S}})
    env = {**NO_CPU_BINDING, "VLLM_NIXL_SIDE_CHANNEL_HOST": LOOPBACK,
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_loopback_port()),
           "PYTHONPATH": os.pathsep.join(
               p for p in (str(NIXL_CPU_SITE), os.environ.get("PYTHONPATH", "")) if p)}
    with contextlib.ExitStack() as stack:
        with environ(env):  # the worker process (and its engine's) inherits it at start
            if face in ("vllm", "vllm_own"):
                own = face == "vllm_own"
                worker = stack.enter_context(vllm_serve(
                    model, "--kv-transfer-config", kv_config, *vllm_args, start_s=START_S,
                    middleware=not own, quiesce_args=None if own else " ".join(
                        ("--router-grace", "0.2", *quiesce_args))))
            else:
                kwargs = engine_kwargs()
                engine = ["--engine", "vllm", "--model", str(model), "--role", role,
                          "--max-model-len", str(kwargs["max_model_len"]), "--dtype",
                          kwargs["dtype"], "--kv-transfer-config", kv_config]
                if "gpu_memory_utilization" in kwargs:
                    engine += ["--gpu-memory-utilization", str(kwargs["gpu_memory_utilization"])]
                worker = stack.enter_context(start_worker(
                    "--router-grace", "0.2", *quiesce_args, engine=tuple(engine),
                    startup_timeout=START_S))
        try:
            yield worker
        finally:
            reap_group(worker)


def reap_group(worker: Worker) -> None:
    """Whatever is left of a worker's processes goes: at once while its main process
    still runs (a failed test), else after a grace for the ones that end by themselves
    (multiprocessing's resource tracker unlinks the engine's shared memory as it ends)."""
    group = worker.process.pid
    if worker.process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
        worker.process.wait(timeout=30)
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return  # the group is empty
        time.sleep(POLL_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


