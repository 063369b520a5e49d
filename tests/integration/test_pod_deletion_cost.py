"""Publishing the drain cost as ``pod-deletion-cost``, against a stand-in API server.

The API server here is a **stand-in**: a small HTTP server on loopback that records
each PATCH and answers as the Kubernetes API does (200 with the pod, or an error
``Status`` body). It checks what quiesce sends (path, content type, bearer token, the
merge patch) and how it reacts to answers. A real cluster adds what this cannot show:
RBAC (the Role in deploy/kubernetes/worker.yaml), admission webhooks, TLS with the
service account's CA, and the ReplicaSet controller actually choosing the victim by
the annotation.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from quiesce import AdmissionGate, InMemoryDiscovery, PendingWork, Role
from quiesce.admin.pod_deletion_cost import (
    ANNOTATION,
    DeletionCostPublisher,
    PodIdentity,
    PublishPolicy,
)
from quiesce.errors import ConfigError
from quiesce.eta import DrainEta
from quiesce.lifecycle import Lifecycle


class StandInApiServer:
    """Records PATCHes; answers with ``status`` (and a Kubernetes Status body if >= 300)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, object]] = []
        self.status = 200
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_PATCH(self) -> None:  # http.server's naming
                length = int(self.headers.get("Content-Length", "0"))
                outer.requests.append({
                    "path": self.path,
                    "content_type": self.headers.get("Content-Type"),
                    "authorization": self.headers.get("Authorization"),
                    "body": json.loads(self.rfile.read(length)),
                })
                body = ({"kind": "Pod"} if outer.status < 300 else
                        {"kind": "Status", "status": "Failure", "code": outer.status,
                         "message": 'pods "w-0" is forbidden: User "system:serviceaccount:'
                                    'llm:default" cannot patch resource "pods"'})
                data = json.dumps(body).encode()
                self.send_response(outer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def costs(self) -> list[str]:
        return [r["body"]["metadata"]["annotations"][ANNOTATION]  # type: ignore[index]
                for r in self.requests]


@pytest.fixture
def api() -> Iterator[StandInApiServer]:
    server = StandInApiServer()
    server.thread.start()
    try:
        yield server
    finally:
        server.server.shutdown()
        server.server.server_close()


class Work:
    """A probe whose running count the test sets; its ETA is a second per request, so
    the drain cost is ``running`` x 1000 ms."""

    role = Role.AGGREGATED
    source = "test"

    def __init__(self) -> None:
        self.running = 0

    async def pending_work(self) -> PendingWork:
        return PendingWork(Role.AGGREGATED, "test", waiting=0, running=self.running,
                           kv_sends_held=0, kv_recvs_awaited=0,
                           eta=DrainEta(float(self.running), float(self.running), "test"))

    async def is_quiescent(self) -> bool:
        return self.running == 0


def publisher(api: StandInApiServer, tmp_path: Path, work: Work,
              policy: PublishPolicy | None = None) -> DeletionCostPublisher:
    token = tmp_path / "token"
    token.write_text("token-1\n")
    pod = PodIdentity(api.url, "llm", "w-0", token, None)
    lifecycle = Lifecycle(gate=AdmissionGate(), probe=work, discovery=InMemoryDiscovery("w-0"))
    return DeletionCostPublisher(
        lifecycle, pod, policy,
        transport=lambda p: httpx.AsyncClient(base_url=p.api_url, timeout=2.0))


async def test_the_patch_is_a_merge_patch_of_the_annotation_with_the_token(
        api: StandInApiServer, tmp_path: Path) -> None:
    work = Work()
    work.running = 3
    pub = publisher(api, tmp_path, work)
    assert await pub.publish_once()
    (tmp_path / "token").write_text("token-2\n")  # projected tokens rotate: read each time
    work.running = 9
    assert await pub.publish_once()
    first, second = api.requests
    assert first == {"path": "/api/v1/namespaces/llm/pods/w-0",
                     "content_type": "application/merge-patch+json",
                     "authorization": "Bearer token-1",
                     "body": {"metadata": {"annotations": {ANNOTATION: "3000"}}}}
    assert second["authorization"] == "Bearer token-2"
    assert pub.status()["published"] == 9000 and pub.status()["patches"] == 2


async def test_small_moves_are_not_published_but_moves_to_and_from_zero_are(
        api: StandInApiServer, tmp_path: Path) -> None:
    work = Work()
    pub = publisher(api, tmp_path, work, PublishPolicy(min_change=2000, min_change_ratio=0.2))
    for running in (0, 1, 2, 5, 6, 20, 22, 0, 0):
        work.running = running
        await pub.publish_once()
    # (in seconds) 0 first; 0→1 (from zero); 2 (moved 1 s < 2 s) no; 5 yes; 6 no; 20 yes;
    # 22 (2 s < 20 % of 20 s) no; 0 (to zero) yes; 0 again no.
    assert api.costs() == ["0", "1000", "5000", "20000", "0"]
    assert pub.status()["cost"] == {"value": 0, "unit": "ms", "source": "eta", "reason": None}


async def test_a_refused_patch_is_shown_and_retried_never_raised(
        api: StandInApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    work = Work()
    work.running = 4
    pub = publisher(api, tmp_path, work, PublishPolicy(interval_s=1.0, max_backoff_s=8.0))
    api.status = 403
    assert not await pub.publish_once()
    assert not await pub.publish_once()
    status = pub.status()
    assert status["published"] is None and status["failures"] == 2
    error = str(status["last_error"])
    assert "answered 403" in error and "cannot patch resource" in error
    assert sum("not published" in r.getMessage() for r in caplog.records) == 1  # once per error
    assert pub.next_wait_s() == 4.0  # 1 s doubled per consecutive failure
    api.status = 200
    assert await pub.publish_once()  # the same cost is retried after a failure
    assert pub.status()["last_error"] is None and pub.next_wait_s() == 1.0
    assert api.costs() == ["4000", "4000", "4000"]


async def test_an_unreachable_api_server_or_a_missing_token_is_an_error_in_status(
        api: StandInApiServer, tmp_path: Path) -> None:
    work = Work()
    pub = publisher(api, tmp_path, work)
    api.server.shutdown()
    api.server.server_close()
    assert not await pub.publish_once()
    assert "ConnectError" in str(pub.status()["last_error"])
    (tmp_path / "token").unlink()
    assert not await pub.publish_once()
    assert "FileNotFoundError" in str(pub.status()["last_error"])
    assert pub.next_wait_s() == 20.0  # 5 s, doubled twice


async def test_run_stops_when_asked_and_patches_once_per_change(
        api: StandInApiServer, tmp_path: Path) -> None:
    work = Work()
    work.running = 2
    pub = publisher(api, tmp_path, work, PublishPolicy(interval_s=0.005, max_backoff_s=0.05))
    patched: asyncio.Queue[bool] = asyncio.Queue()
    once = pub.publish_once

    async def observed() -> bool:
        done = await once()
        patched.put_nowait(done)
        return done

    pub.publish_once = observed  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(pub.run(stop))
    while not await asyncio.wait_for(patched.get(), 5.0):
        pass
    work.running = 0
    while not await asyncio.wait_for(patched.get(), 5.0):
        pass
    stop.set()
    await asyncio.wait_for(task, 5.0)
    assert api.costs() == ["2000", "0"]


def test_identity_from_the_pod_environment(tmp_path: Path) -> None:
    for name, text in (("token", "t"), ("ca.crt", "ca"), ("namespace", "llm\n")):
        (tmp_path / name).write_text(text)
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443",
           "POD_NAME": "llm-worker-abc"}
    pod = PodIdentity.from_environment(env, tmp_path)
    assert (pod.api_url, pod.namespace, pod.pod_name) == ("https://10.0.0.1:443", "llm",
                                                         "llm-worker-abc")
    assert pod.ca_file == tmp_path / "ca.crt"
    v6 = PodIdentity.from_environment({**env, "KUBERNETES_SERVICE_HOST": "fd00::1"}, tmp_path)
    assert v6.api_url == "https://[fd00::1]:443"


@pytest.mark.parametrize("missing", ["KUBERNETES_SERVICE_HOST", "token", "ca.crt", "namespace"])
def test_identity_names_what_is_missing(tmp_path: Path, missing: str) -> None:
    for name in ("token", "ca.crt", "namespace"):
        if name != missing:
            (tmp_path / name).write_text("x")
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    env.pop(missing, None)
    with pytest.raises(ConfigError, match="publish_deletion_cost"):
        PodIdentity.from_environment(env, tmp_path)


@pytest.mark.parametrize("bad", [{"interval_s": 0}, {"min_change": 0}, {"min_change": True},
                                 {"min_change_ratio": 1.0}, {"max_backoff_s": 1.0}])
def test_bad_policies_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        PublishPolicy(**bad)  # type: ignore[arg-type]
