"""quiesce's face for SGLang's own server without SGLang (quiesce.serve.sglang_plugin,
quiesce.serve.sglang_serve, SGLang's routes in quiesce.serve.asgi_admission): the plugin
called as SGLang calls it, in a fresh process; the layouts it refuses; admission with
SGLang's routes. The real ``python -m sglang.launch_server`` with quiesce (every stream
drained on each delivery, a bad setting refused) is
tests/integration/sglang/test_sglang_serve.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from quiesce.errors import ConfigError
from quiesce.serve.asgi_admission import SGLANG_ROUTES, VLLM_ROUTES, ended_by_engine
from quiesce.serve.server_options import SGLANG_ARGS_ENV
from quiesce.serve.sglang_plugin import layout_problem
from quiesce.serve.sglang_serve import uvicorn_server


@pytest.mark.parametrize(("argv", "refused"), [
    (["--model-path", "m"], None),
    (["--model-path", "m", "--tokenizer-worker-num", "1"], None),
    (["--model-path", "m", "--tokenizer-worker-num", "4"], "--tokenizer-worker-num 4"),
    (["--model-path", "m", "--tokenizer-worker-num=2"], "--tokenizer-worker-num 2"),
    (["--model-path", "m", "--enable-http2"], "--enable-http2"),
    (["--model-path", "m", "--grpc-mode"], "--grpc-mode"),
    (["--model-path", "m", "--use-ray"], "--use-ray"),
])
def test_the_layouts_quiesce_cannot_serve_are_refused(argv: list[str],
                                                     refused: str | None) -> None:
    problem = layout_problem(argv)
    assert (problem is None) if refused is None else (problem or "").startswith(refused)


PLUGIN = """
import json, os, sys
sys.argv = ["python -m sglang.launch_server", *json.loads(os.environ["ARGV"])]
from quiesce.serve.server_claim import current_claim
from quiesce.serve.sglang_plugin import register
register()
print(json.dumps(current_claim() is not None))
"""


def run_plugin(settings: str | None, argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ARGV": json.dumps(argv)}
    env.pop("QUIESCE_SIGNAL_OWNER", None)
    env.pop(SGLANG_ARGS_ENV, None)
    if settings is not None:
        env[SGLANG_ARGS_ENV] = settings
    return subprocess.run([sys.executable, "-c", PLUGIN], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def test_without_the_variable_the_plugin_does_nothing() -> None:
    done = run_plugin(None, ["--model-path", "m"])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) is False


@pytest.mark.parametrize(("settings", "argv", "named"), [
    ("--budget 5 --reserve 9", ["--model-path", "m"], "--reserve"),
    ("--no-such-option", ["--model-path", "m"], SGLANG_ARGS_ENV),
    ("", ["--model-path", "m", "--tokenizer-worker-num", "2"], "--tokenizer-worker-num"),
])
def test_a_bad_setting_or_layout_exits_2_naming_it(settings: str, argv: list[str],
                                                   named: str) -> None:
    done = run_plugin(settings, argv)
    assert done.returncode == 2, done.stderr
    assert "sglang: quiesce refuses to start:" in done.stderr and named in done.stderr
    assert done.stdout == ""


def test_sigterm_not_owned_by_uvicorn_is_a_refusal() -> None:
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with pytest.raises(ConfigError, match="uvicorn"):
            uvicorn_server()
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize(("path", "gated"), [
    ("/generate", True), ("/v1/completions", True), ("/v1/chat/completions", True),
    ("/invocations", True), ("/v1/some_new_route", True),
    ("/abort_request", False), ("/flush_cache", False), ("/update_weights_from_disk", False),
    ("/pause_generation", False), ("/v1/responses/abc/cancel", False),
])
def test_sglang_generation_routes_are_gated_and_control_routes_are_not(path: str,
                                                                       gated: bool) -> None:
    assert SGLANG_ROUTES.is_ungated(path) is not gated


def test_sglang_native_abort_is_an_ending_by_the_engine() -> None:
    native = b'data: {"text":"hi","meta_info":{"finish_reason":{"type":"abort","message":"x"}}}'
    assert ended_by_engine(native, SGLANG_ROUTES.ended_marks)
    assert not ended_by_engine(native, VLLM_ROUTES.ended_marks)
    finished = b'data: {"text":"hi","meta_info":{"finish_reason":{"type":"length","length":4}}}'
    assert not ended_by_engine(finished, SGLANG_ROUTES.ended_marks)
