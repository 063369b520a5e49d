"""``quiesce dynamo vllm`` behind Dynamo's real frontend (ai-dynamo 1.6.1, vLLM 0.31 on the
CPU): the operator surface, and the points of a worker's life that test_vllm_worker.py
does not signal.

- SIGTERM during Dynamo's model registration, held at a known point (Dynamo published the
  model card, ``register_vllm_model`` has not returned; :func:`held_registration_worker`):
  exit 0 drained with nothing served, no card left behind, no process left, and the
  worker's own teardown never signals an engine process that it still guards.
- The admin API works against the wrapper as against ``quiesce serve``: status (state,
  signal guard, Dynamo), ``/health``, ``/metrics``, the bearer token, ``quiesce status``.
- ``POST /engine/drain`` takes the worker out of the frontend's routing (a second worker
  serves every request; the drained one neither admits nor refuses any, by its own
  counts) and ``POST /engine/resume`` brings it back (a request reaches it again).
- The kubelet's sequence with nothing in flight: ``quiesce prestop`` (exit 0, drained),
  then SIGTERM *after drained*: exit 0, drained, no process left.
- SIGTERM to every process of the worker (systemd's control-group kill, ``pkill``) under
  streaming load: every stream read to its end completes, exit 0, drained, nothing lost,
  no process left. (SIGTERM and SIGINT to the process group, SIGTERM during model load
  and at start, a second signal: test_vllm_worker.py; the kubelet under load:
  test_replay.py.)

One frontend per module; the two workers of the admin tests are shared by the tests that
use ``pair``, in file order: the last two stop one each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.integration.dynamo.processes import (
    exit_report,
    held_registration_worker,
    quiesce_worker,
    streams_then,
    vllm_args,
    wait_for_model,
)
from tests.integration.worker_process import (
    TOKEN,
    StreamResult,
    Worker,
    outliving,
    prestop_command,
    signal_every_process,
    stream_completion,
    tail,
    worker_env,
    worker_processes,
)

STREAMS = 3
TOKENS = 300  # about 6 s at the paced step: the drain has to wait for them
SHORT = 8  # tokens of the requests that only show where the frontend routes
EXIT_TIMEOUT_S = 90.0
AUTH = {"Authorization": f"Bearer {TOKEN}"}
IGNORED = "ignores SIGTERM"
"""What a guarded engine process prints when it holds a SIGTERM back (signal_engine)."""


def _args(tiny_model: Path, cluster_dir: Path, *extra: str) -> list[str]:
    return [*vllm_args(tiny_model, cluster_dir / "chat.jinja"), *extra]


def _get(worker: Worker, path: str, *, token: bool = True) -> httpx.Response:
    return httpx.get(f"{worker.admin_url}{path}", headers=AUTH if token else {}, timeout=30)


def _post(worker: Worker, path: str, body: dict[str, object] | None = None, *,
          token: bool = True) -> httpx.Response:
    return httpx.post(f"{worker.admin_url}{path}", json=body,
                      headers=AUTH if token else {}, timeout=90)


def _requests(worker: Worker) -> dict[str, int]:
    """The worker's own request counts: admitted, refused, and ended by outcome."""
    counts = worker.status()["requests"]
    assert isinstance(counts, dict), counts
    ended = counts["ended_total"]
    return {"admitted": counts["admitted_total"], "refused": counts["refused_total"],
            **ended}


def _metric(text: str, sample: str) -> float:
    """The value of one sample (``name{labels}`` as exposed) in a Prometheus exposition."""
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    raise AssertionError(f"{sample} not in /metrics:\n{text[:2000]}")


def _cards(store: Path, model: str) -> list[Path]:
    """The model cards (Dynamo's ``mdc`` bucket of the file discovery store) of ``model``."""
    found = []
    for path in (store / "v1" / "mdc").rglob("*"):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            if path.is_file() and f'"{model}"' in path.read_text():
                found.append(path)
    return found


def _listed(frontend_url: str) -> list[str]:
    data = httpx.get(f"{frontend_url}/v1/models", timeout=10).json().get("data", [])
    return [entry.get("id") for entry in data]


async def _streams_then(url: str, model: str, act: Callable[[], object]
                        ) -> list[StreamResult]:
    return await streams_then(url, model, act, streams=STREAMS, tokens=TOKENS)


async def _short(url: str, model: str) -> StreamResult:
    return await stream_completion(url, SHORT, model=model, ignore_eos=True,
                                   include_usage=True, timeout_s=120)


# -- SIGTERM during Dynamo's model registration ----------------------------------------------


def test_sigterm_during_model_registration_stops_without_serving(
        tiny_model: Path, cluster_dir: Path, frontend_url: str) -> None:
    """The worker is held inside Dynamo's ``register_vllm_model`` (the engine is loaded,
    the model card published, the endpoints not served): a SIGTERM to the main process
    stops it there. It never serves (no ``ready``, the frontend never lists it), reports
    drained with nothing admitted, exits 0, leaves no model card and no process; and
    while stopping it never sends its engine a SIGTERM that its own guard holds back
    (it did: Dynamo's cleanup stopped a still-guarded EngineCore, which vLLM then killed)."""
    store = cluster_dir / "store"
    name = "held-in-registration"
    with held_registration_worker(store, _args(tiny_model, cluster_dir,
                                               "--served-model-name", name)) as worker:
        pids = worker_processes(worker.process.pid)
        assert len(pids) >= 3, "the engine's processes were started"  # EngineCore, runner
        assert _cards(store, name), list(store.rglob("*"))  # where it is held
        signalled_at = len(worker.lines)
        worker.signal(signal.SIGTERM)
        code, _ = worker.finish(EXIT_TIMEOUT_S)
        pids += [pid for pid in worker_processes(worker.process.pid) if pid not in pids]
    report = exit_report(worker)
    assert code == 0 and report is not None, tail(worker.lines)
    assert report["outcome"] == "drained" and report["drained"] is True, report
    assert report["requests"] == {"completed": 0, "lost": 0, "client_gone": 0,
                                  "rejected": 0}, report
    assert not any('"event": "ready"' in line for line in worker.lines), tail(worker.lines)
    assert not outliving(pids), "processes outlived the worker"
    deadline = time.monotonic() + 30
    while _cards(store, name) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _cards(store, name), "the model card outlived the worker"
    assert name not in _listed(frontend_url)
    held_back = [line for line in worker.lines[signalled_at:] if IGNORED in line]
    assert not held_back, f"the worker's teardown signalled a guarded engine:\n{held_back}"


# -- the admin API, drain and resume, prestop: two workers behind one frontend -------------


@dataclass
class Pair:
    a: Worker
    """The worker the admin tests drive; stopped by the prestop test."""
    b: Worker
    """The other one: serves while ``a`` is drained; stopped by the delivery test."""
    model: str


@pytest.fixture(scope="module")
def pair(tiny_model: Path, cluster_dir: Path, frontend_url: str) -> Iterator[Pair]:
    """Two ``quiesce dynamo vllm`` workers of the same model (started one after the other:
    two cores), listed by the frontend."""
    args = _args(tiny_model, cluster_dir)
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(quiesce_worker(cluster_dir / "store", args))
        b = stack.enter_context(quiesce_worker(cluster_dir / "store", args))
        wait_for_model(frontend_url, str(tiny_model))
        yield Pair(a, b, str(tiny_model))


def test_the_admin_api_answers_for_the_dynamo_worker(pair: Pair) -> None:
    """Status, health, metrics, the bearer token and ``quiesce status``, as on ``quiesce
    serve``."""
    a = pair.a
    status = a.status()
    assert status["state"] == "serving" and status["accepting"] is True, status
    assert status["discovery_registered"] is True and status["inflight_requests"] == 0
    dynamo = status["dynamo"]
    assert isinstance(dynamo, dict) and dynamo["serving"] is True, dynamo
    assert dynamo["component"] == "vllm" and dynamo["endpoints"] >= 1, dynamo
    guard = status["signal_guard"]
    assert isinstance(guard, dict) and guard["protected"] is True, guard
    pending = status["pending_work"]
    assert isinstance(pending, dict) and pending["verdict"] == "quiescent", pending
    assert str(pending["source"]).startswith("vllm."), pending  # the engine's own counts

    assert _get(a, "/health/live").status_code == 200
    ready = _get(a, "/health/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "serving"}
    metrics = _get(a, "/metrics").text
    assert _metric(metrics, 'quiesce_state{state="serving"}') == 1.0
    assert _metric(metrics, 'quiesce_state{state="drained"}') == 0.0
    assert _metric(metrics, "quiesce_accepting") == 1.0
    assert _metric(metrics, "quiesce_discovery_registered") == 1.0

    # the token guards the admin routes: without it, nothing is read or changed
    assert _get(a, "/engine/status", token=False).status_code == 401
    assert _post(a, "/engine/drain", token=False).status_code == 401
    assert a.status()["state"] == "serving"

    cli = subprocess.run([sys.executable, "-m", "quiesce", "status", "--url", a.admin_url,
                          "--json"], env=worker_env(), capture_output=True, text=True,
                         timeout=60, check=False)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["state"] == "serving", cli.stdout


async def test_a_drained_worker_leaves_the_frontend_and_resume_brings_it_back(
        pair: Pair, frontend_url: str) -> None:
    """After ``POST /engine/drain`` the frontend sends every request to the other worker
    (the drained one neither admits nor refuses any); after ``POST /engine/resume`` a
    request reaches it again and completes."""
    a, b = pair.a, pair.b
    drain = _post(a, "/engine/drain", {"wait": True, "wait_timeout_s": 60})
    assert drain.status_code == 200, drain.text
    assert drain.json()["state"] == "drained", drain.json()
    status = a.status()
    assert status["accepting"] is False and status["discovery_registered"] is False, status
    assert _get(a, "/health/ready").status_code == 503
    metrics = _get(a, "/metrics").text
    assert _metric(metrics, 'quiesce_state{state="drained"}') == 1.0
    assert _metric(metrics, "quiesce_discovery_registered") == 0.0

    a_before, b_before = _requests(a), _requests(b)
    results = [await _short(frontend_url, pair.model) for _ in range(4)]
    assert all(r.complete for r in results), results
    assert _requests(a) == a_before, "the frontend still sent requests to the drained worker"
    assert _requests(b)["completed"] == b_before["completed"] + 4

    resume = _post(a, "/engine/resume")
    assert resume.status_code == 200, resume.text
    resumed = resume.json()
    assert resumed["state"] == "serving" and resumed["accepting"] is True, resumed
    assert resumed["discovery_registered"] is True, resumed
    assert _get(a, "/health/ready").status_code == 200
    # round robin over both again, once the frontend saw the card: a request reaches ``a``
    sent: list[StreamResult] = []
    while _requests(a)["admitted"] == a_before["admitted"] and len(sent) < 20:
        sent.append(await _short(frontend_url, pair.model))
    assert all(r.complete for r in sent), sent
    after = _requests(a)
    assert after["admitted"] > a_before["admitted"], f"no request reached it after {sent}"
    assert after["completed"] == after["admitted"] and after["lost"] == 0, after
    metrics = _get(a, "/metrics").text
    assert _metric(metrics, 'quiesce_state{state="serving"}') == 1.0
    assert _metric(metrics, 'quiesce_requests_ended_total{outcome="completed"}') >= 1.0


async def test_prestop_then_sigterm_after_drained_exits_clean(
        pair: Pair, frontend_url: str) -> None:
    """The kubelet's sequence on an idle worker: ``quiesce prestop`` drains it (exit 0),
    then SIGTERM to the main process after drained: exit 0, drained, nothing lost, no
    process left; the other worker still serves the model."""
    a = pair.a
    pids = worker_processes(a.process.pid)
    hook = await asyncio.to_thread(
        subprocess.run, prestop_command(a, grace_s=60, margin_s=20), env=worker_env(),
        capture_output=True, text=True, timeout=60, check=False)
    assert hook.returncode == 0, hook.stderr
    status = a.status()
    assert status["state"] == "drained" and status["inflight_requests"] == 0, status
    assert status["discovery_registered"] is False, status

    a.signal(signal.SIGTERM)
    code, report = await asyncio.to_thread(a.finish, 30)
    assert code == 0 and report is not None, tail(a.lines)
    assert report["outcome"] == "drained" and report["drained"] is True, report
    assert report["signal"] == "SIGTERM" and report["lost_requests"] == 0, report
    assert not outliving(pids), "processes outlived the worker"
    result = await _short(frontend_url, pair.model)
    assert result.complete, result


async def test_sigterm_to_every_process_under_load_completes_every_stream(
        pair: Pair, frontend_url: str) -> None:
    """systemd (``KillMode=control-group``) and ``pkill`` signal every process: the main
    one and each of vLLM's. Every stream still completes and the worker exits 0 drained,
    its engine processes gone with it."""
    b = pair.b
    guard = b.status()["signal_guard"]
    assert isinstance(guard, dict) and guard["protected"] is True, guard
    pids = worker_processes(b.process.pid)
    inflight: list[object] = []
    signalled: list[int] = []

    def deliver() -> None:
        inflight.append(b.status()["inflight_requests"])
        signalled.extend(signal_every_process(b.process.pid))

    results = await _streams_then(frontend_url, pair.model, deliver)
    code, report = await asyncio.to_thread(b.finish, EXIT_TIMEOUT_S)
    assert all(r.complete for r in results), f"{results}\n{tail(b.lines)}"
    assert len(signalled) >= 3, signalled  # the main process and vLLM's, each one
    assert code == 0 and report is not None, tail(b.lines)
    assert report["outcome"] == "drained" and report["drained"] is True, report
    requests = report["requests"]
    assert isinstance(requests, dict), report
    # every stream it held at the signal completed (the other worker is gone by now: all)
    assert isinstance(inflight[0], int) and inflight[0] >= 1, inflight
    assert requests["completed"] == inflight[0] and requests["lost"] == 0, report
    assert not outliving(pids), "processes outlived the worker"


async def test_sigterm_while_an_admin_drain_runs_completes_every_stream(
        tiny_model: Path, cluster_dir: Path, frontend_url: str) -> None:
    """An operator's ``POST /engine/drain`` is still waiting for the streams when the pod is
    deleted (SIGTERM to the main process): the shutdown takes the drain over, every stream
    completes, and the worker exits 0 drained with each of them counted completed."""
    model = str(tiny_model)
    with quiesce_worker(cluster_dir / "store", _args(tiny_model, cluster_dir)) as worker:
        wait_for_model(frontend_url, model)
        pids = worker_processes(worker.process.pid)
        seen: list[dict[str, object]] = []

        def drain_then_sigterm() -> None:
            drain = _post(worker, "/engine/drain")
            seen.append(drain.json())
            worker.signal(signal.SIGTERM)

        results = await _streams_then(frontend_url, model, drain_then_sigterm)
        code, report = await asyncio.to_thread(worker.finish, EXIT_TIMEOUT_S)
    assert all(r.complete for r in results), f"{results}\n{tail(worker.lines)}"
    (drain,) = seen
    assert drain["state"] == "draining", drain  # the streams were still running
    inflight = drain["inflight_requests"]
    assert isinstance(inflight, int) and inflight >= 1, drain
    assert code == 0 and report is not None, tail(worker.lines)
    assert report["outcome"] == "drained" and report["drained"] is True, report
    requests = report["requests"]
    assert isinstance(requests, dict), report
    assert requests["completed"] == inflight and requests["lost"] == 0, report
    assert not outliving(pids), "processes outlived the worker"
