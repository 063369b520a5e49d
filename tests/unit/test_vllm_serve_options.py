"""quiesce's settings for ``vllm serve`` and the plugin's claim (quiesce.serve.server_options,
quiesce.serve.vllm_plugin), without vLLM: the plugin is called as vLLM calls it, in a
fresh process whose command line names the middleware. The real ``vllm serve`` refusing
a bad setting is tests/integration/vllm/test_vllm_serve.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from quiesce.errors import ConfigError
from quiesce.probe import Role
from quiesce.serve.server_options import VLLM_ARGS_ENV as ARGS_ENV
from quiesce.serve.server_options import parse_server_options
from quiesce.serve.vllm_plugin import MIDDLEWARE, names_middleware
from quiesce.serve.vllm_serve import vllm_role


def test_defaults_need_no_setting() -> None:
    options = parse_server_options(ARGS_ENV, "")
    assert (options.admin_port, options.budget_s, options.router_grace_s) == (8001, 30.0, 2.0)
    assert options.shutdown_policy().cleanup_reserve_s == 5.0


def test_settings_are_read_like_a_command_line() -> None:
    options = parse_server_options(
        ARGS_ENV, "--admin-port 0 --budget 12 --reserve 2 --router-grace 0.5 --role prefill "
        "--publish-deletion-cost --name 'vllm a'")
    assert options.shutdown_policy().total_s == 12 and options.reserve_s == 2
    assert options.resolved_role(Role.DECODE) is Role.PREFILL
    assert options.publish_deletion_cost and options.name == "vllm a"


@pytest.mark.parametrize(("kv_role", "role"), [("kv_producer", Role.PREFILL),
                                               ("kv_consumer", Role.DECODE),
                                               ("kv_both", Role.AGGREGATED),
                                               (None, Role.AGGREGATED)])
def test_the_role_follows_vllms_kv_role(kv_role: str | None, role: Role) -> None:
    assert parse_server_options(ARGS_ENV, "").resolved_role(vllm_role(kv_role)) is role


@pytest.mark.parametrize(("text", "named"), [
    ("--budget -1", "--budget"), ("--budget 10 --reserve 10", "--reserve"),
    ("--router-grace nan", "--router-grace"), ("--budget soon", ARGS_ENV),
    ("--admin-port 70000", "--admin-port"), ("--role leader", "--role"),
    ("--no-such-option 1", ARGS_ENV), ("--name ''", "--name"), ("--budget '", ARGS_ENV),
])
def test_a_bad_setting_is_a_config_error_naming_it(text: str, named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_server_options(ARGS_ENV, text)
    assert caught.value.field == named


def test_the_environment_variable_is_read_by_default() -> None:
    options = parse_server_options(ARGS_ENV, environ={ARGS_ENV: "--budget 7"})
    assert options.budget_s == 7


@pytest.mark.parametrize(("argv", "named"), [
    (["vllm", "serve", "m", "--middleware", MIDDLEWARE], True),
    (["vllm", "serve", "m", f"--middleware={MIDDLEWARE}"], True),
    (["vllm", "serve", "m", "--middleware", "other.Middleware"], False),
    (["vllm", "serve", "m", "--middleware"], False),
    (["vllm", "serve", "m"], False),
])
def test_the_plugin_acts_only_when_the_middleware_is_named(argv: list[str], named: bool) -> None:
    assert names_middleware(argv) is named


PLUGIN = f"""
import json, os, sys
sys.argv = ["vllm", "serve", "model", "--middleware", {MIDDLEWARE!r}]
from quiesce.serve.vllm_plugin import current_claim, register
register()
register()  # idempotent, as vLLM may load plugins again
claim = current_claim()
print(json.dumps(None if claim is None else {{
    "owner": os.environ.get("QUIESCE_SIGNAL_OWNER", ""), "pid": os.getpid(),
    "permitted": claim.signals.permitted, "port": claim.admin_socket.getsockname()[1]}}))
"""


def run_plugin(settings: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, ARGS_ENV: settings}
    env.pop("QUIESCE_SIGNAL_OWNER", None)
    return subprocess.run([sys.executable, "-c", PLUGIN], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def test_the_plugin_claims_the_signals_permitted_and_binds_the_admin_port() -> None:
    done = run_plugin("--admin-port 0")
    assert done.returncode == 0, done.stderr
    claim = json.loads(done.stdout)
    assert claim["owner"].startswith(f"{claim['pid']}:")  # this process owns the signals
    assert claim["permitted"] is True and claim["port"] > 0


def test_a_bad_setting_exits_2_naming_it_before_anything_starts() -> None:
    done = run_plugin("--budget 5 --reserve 9")
    assert done.returncode == 2
    assert "quiesce refuses to start: --reserve" in done.stderr
    assert ARGS_ENV in done.stderr and done.stdout == ""


def test_an_admin_port_in_use_is_refused() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        done = run_plugin(f"--admin-port {taken.getsockname()[1]}")
    assert done.returncode == 2 and "--admin-port" in done.stderr


def test_an_unauthenticated_admin_api_beyond_loopback_is_refused() -> None:
    done = run_plugin("--admin-host 0.0.0.0 --admin-port 0")
    assert done.returncode == 2 and "token" in done.stderr
