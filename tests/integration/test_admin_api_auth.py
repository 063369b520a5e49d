"""The admin HTTP API (:mod:`quiesce.admin.server`): bearer auth and the bind and token
configuration.

Admin routes refuse missing, wrong and non-bearer credentials and accept the right token;
health and metrics are open; without a token the admin routes are open; ``check_bind``
refuses a non-loopback host without a token; ``load_token`` reads a file or the
environment.

The worker under test and helpers: :mod:`tests.integration.admin_api_harness`.
"""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import pytest

from quiesce.admin.server import TOKEN_ENV, check_bind, load_token
from quiesce.errors import ConfigError
from quiesce.lifecycle import State
from tests.integration.admin_api_harness import (
    AUTH,
    TOKEN,
    Worker,
    asgi_client,
    assert_error,
    running_worker,
)

ADMIN_ROUTES = [("POST", "/engine/drain"), ("POST", "/engine/resume"),
                ("GET", "/engine/status")]


# -- 1. auth and configuration -----------------------------------------------------------

BAD_CREDENTIALS = {
    "missing": {},
    "wrong token": {"Authorization": "Bearer not-the-token"},
    "token prefix": {"Authorization": f"Bearer {TOKEN[:-1]}"},
    "token with suffix": {"Authorization": f"Bearer {TOKEN}x"},
    "empty bearer": {"Authorization": "Bearer "},
    "basic scheme": {"Authorization": "Basic "
                     + base64.b64encode(f"admin:{TOKEN}".encode()).decode()},
    "token scheme": {"Authorization": f"Token {TOKEN}"},
    "no scheme": {"Authorization": TOKEN},
}


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
@pytest.mark.parametrize("credentials", list(BAD_CREDENTIALS))
async def test_admin_routes_refuse_missing_wrong_or_non_bearer_credentials(
        worker: Worker, client: httpx.AsyncClient, method: str, path: str,
        credentials: str) -> None:
    before = worker.snapshot()
    response = await client.request(method, path, headers=BAD_CREDENTIALS[credentials],
                                    json={"wait": True} if method == "POST" else None)
    assert_error(response, 401, "unauthorized")
    assert response.headers["www-authenticate"] == "Bearer"
    assert worker.snapshot() == before


async def test_admin_routes_accept_the_right_bearer_token(
        worker: Worker, client: httpx.AsyncClient) -> None:
    status = await client.get("/engine/status", headers=AUTH)
    assert status.status_code == 200 and status.json()["state"] == "serving"
    # the scheme is case-insensitive (RFC 9110); surrounding blanks are ignored
    lower = await client.get("/engine/status", headers={"Authorization": f"bearer  {TOKEN} "})
    assert lower.status_code == 200
    drain = await client.post("/engine/drain", headers=AUTH)
    assert drain.status_code in (200, 202) and drain.json()["state"] in ("draining", "drained")
    resume = await client.post("/engine/resume", headers=AUTH)
    assert resume.status_code == 200 and resume.json()["state"] == "serving"
    assert worker.lifecycle.state is State.SERVING


async def test_health_and_metrics_are_open(worker: Worker, client: httpx.AsyncClient) -> None:
    live = await client.get("/health/live")
    assert live.status_code == 200 and live.json() == {"status": "live"}
    ready = await client.get("/health/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "serving"}
    metrics = await client.get("/metrics", headers={"Authorization": "Bearer wrong"})
    assert metrics.status_code == 200 and "quiesce_state" in metrics.text


async def test_without_a_token_admin_routes_are_open() -> None:
    async with running_worker(token=None) as open_worker, \
            asgi_client(open_worker.app) as client:
        status = await client.get("/engine/status")
        assert status.status_code == 200 and status.json()["state"] == "serving"
        drain = await client.post("/engine/drain", json={"wait": True})
        assert drain.status_code == 200 and drain.json()["state"] == "drained"
        # an Authorization header is simply not looked at
        resume = await client.post("/engine/resume", headers={"Authorization": "Bearer x"})
        assert resume.status_code == 200 and resume.json()["state"] == "serving"
        assert open_worker.lifecycle.state is State.SERVING


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "worker.example.com"])
def test_check_bind_refuses_a_non_loopback_host_without_a_token(host: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_bind(host, None)
    assert raised.value.field == "admin_host"
    assert "admin_host" in str(raised.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_check_bind_allows_loopback_without_a_token(host: str) -> None:
    check_bind(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "127.0.0.1", "worker.example.com"])
def test_check_bind_allows_any_host_with_a_token(host: str) -> None:
    check_bind(host, TOKEN)


def test_load_token_from_a_file_is_stripped(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, "from-the-environment")
    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n\n")
    assert load_token(str(token_file)) == TOKEN  # the file wins over the environment


@pytest.mark.parametrize("content", ["", "   \n\t\n"])
def test_load_token_refuses_an_empty_file(tmp_path: Path, content: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(content)
    with pytest.raises(ConfigError) as raised:
        load_token(str(token_file))
    assert raised.value.field == "admin_token_file"


def test_load_token_refuses_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        load_token(str(tmp_path / "does-not-exist"))
    assert raised.value.field == "admin_token_file"


def test_load_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, f" {TOKEN}\n")
    assert load_token() == TOKEN
    monkeypatch.setenv(TOKEN_ENV, "  ")
    assert load_token() is None
    monkeypatch.delenv(TOKEN_ENV)
    assert load_token() is None
    assert load_token(None) is None
