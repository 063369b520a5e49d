"""``quiesce serve --dynamo`` options: defaults from Dynamo's own environment, bad
combinations refused with the field (exit 2) before anything starts."""

from __future__ import annotations

import argparse
import importlib.util
import json
import socket
from pathlib import Path

import pytest

from quiesce.errors import ConfigError
from quiesce.ops.cli import main
from quiesce.serve.options import (
    DYNAMO_QUIET_S,
    WorkerOptions,
    add_serve_arguments,
    options_from_args,
)

DYNAMO_ENV = ("DYN_NAMESPACE", "DYN_DISCOVERY_BACKEND", "DYN_REQUEST_PLANE")


@pytest.fixture(autouse=True)
def no_dynamo_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in DYNAMO_ENV:
        monkeypatch.delenv(name, raising=False)


def parse(*argv: str) -> WorkerOptions:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return options_from_args(parser.parse_args(list(argv)))


def test_dynamos_defaults_and_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    options = parse("--dynamo", "--model", "/m")
    assert (options.dynamo, options.dynamo_endpoint, options.dynamo_discovery_backend,
            options.dynamo_request_plane, options.dynamo_shutdown) == (
        True, "dynamo.backend.generate", "etcd", "tcp", "quiesce")
    assert options.router_quiet_s == DYNAMO_QUIET_S
    config = options.dynamo_config()
    assert (config.model_path, config.served_model_name) == ("/m", "/m")  # as dynamo.vllm
    monkeypatch.setenv("DYN_NAMESPACE", "ns")
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", "file")
    monkeypatch.setenv("DYN_REQUEST_PLANE", "nats")
    options = parse("--dynamo", "--model", "/m", "--served-model-name", "tiny",
                    "--dynamo-shutdown", "dynamo", "--router-quiet", "0")
    assert (options.dynamo_endpoint, options.dynamo_discovery_backend,
            options.dynamo_request_plane, options.dynamo_shutdown, options.router_quiet_s) \
        == ("ns.backend.generate", "file", "nats", "dynamo", 0.0)
    assert options.dynamo_config().served_model_name == "tiny"
    explicit = parse("--dynamo", "--model", "/m", "--dynamo-endpoint", "dyn://a.b.c",
                     "--dynamo-discovery-backend", "mem")
    assert explicit.dynamo_config().endpoint == "a.b.c"
    assert explicit.dynamo_discovery_backend == "mem"


def test_without_dynamo_nothing_changes() -> None:
    options = parse()
    assert not options.dynamo and options.router_quiet_s == 0.0
    assert options.drain_config().router_quiet_s == 0.0


@pytest.mark.parametrize("argv,field", [
    (("--dynamo",), "model"),
    (("--dynamo", "--model", "/m", "--engine", "vllm"), "engine"),
    (("--dynamo", "--model", "/m", "--etcd", "127.0.0.1:2379"), "etcd"),
    (("--dynamo", "--model", "/m", "--advertise-url", "http://10.0.0.1:8000"),
     "advertise_url"),
    (("--dynamo", "--model", "/m", "--role", "prefill"), "role"),
    (("--dynamo", "--model", "/m", "--dynamo-endpoint", "a.b"), "dynamo_endpoint"),
    (("--dynamo", "--model", "/m", "--router-quiet", "-1"), "router_quiet_s"),
    (("--dynamo-shutdown", "dynamo"), "dynamo_shutdown"),
    (("--dynamo-endpoint", "a.b.c"), "dynamo_endpoint"),
    (("--dynamo-discovery-backend", "file"), "dynamo_discovery_backend"),
    (("--dynamo-request-plane", "tcp"), "dynamo_request_plane"),
])
def test_a_bad_combination_names_its_field(argv: tuple[str, ...], field: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse(*argv)
    assert raised.value.field == field


def test_a_bad_value_in_dynamos_environment_names_the_option(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", "zookeeper")
    with pytest.raises(ConfigError) as raised:
        parse("--dynamo", "--model", "/m")
    assert raised.value.field == "dynamo_discovery_backend"
    assert not parse().dynamo  # ignored without --dynamo


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _still_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_bad_combination_exits_2_before_anything_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()
    code = main(["serve", "--dynamo", "--engine", "vllm", "--model", "/m",
                 "--admin-port", str(port)])
    assert code == 2
    assert "engine" in capsys.readouterr().err
    assert _still_free(port)


def test_a_model_without_a_tokenizer_exits_2_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--dynamo", "--model", str(tmp_path), "--admin-port", "0",
                 "--dynamo-discovery-backend", "mem"])
    assert code == 2
    err = capsys.readouterr().err
    assert "model" in err and "tokenizer.json" in err


@pytest.mark.skipif(importlib.util.find_spec("dynamo") is not None,
                    reason="ai-dynamo-runtime is installed in this environment")
def test_without_dynamo_the_worker_exits_2_naming_the_package(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    code = main(["serve", "--dynamo", "--model", str(tmp_path), "--admin-port", "0",
                 "--dynamo-discovery-backend", "mem"])
    assert code == 2
    assert "ai-dynamo-runtime" in capsys.readouterr().err
