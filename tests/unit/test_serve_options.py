"""`quiesce serve` options: parsed into WorkerOptions, bad values refused with the field."""

from __future__ import annotations

import argparse
import os

import pytest

from quiesce.errors import ConfigError
from quiesce.ops.cli import main
from quiesce.serve.options import WorkerOptions, add_serve_arguments, options_from_args
from quiesce.serve.worker import build_serving


def parse(*argv: str) -> WorkerOptions:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return options_from_args(parser.parse_args(list(argv)))


def test_vllm_engine_options_reach_the_worker_options() -> None:
    options = parse("--engine", "vllm", "--model", "/m", "--dtype", "float32",
                    "--gpu-memory-utilization", "0.25")
    assert (options.dtype, options.gpu_memory_utilization) == ("float32", 0.25)
    defaults = parse()
    assert (defaults.dtype, defaults.gpu_memory_utilization) == ("auto", None)


@pytest.mark.parametrize("field,value", [("gpu_memory_utilization", 0.0),
                                         ("gpu_memory_utilization", 1.5),
                                         ("dtype", "float8")])
def test_a_bad_engine_option_names_its_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as raised:
        WorkerOptions(**{field: value})  # type: ignore[arg-type]
    assert raised.value.field == field


def test_an_unknown_dtype_is_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        parse("--dtype", "float8")


def test_max_model_len_defaults_to_the_models_own() -> None:
    assert parse().max_model_len is None
    assert parse("--max-model-len", "512").max_model_len == 512
    with pytest.raises(ConfigError) as raised:
        parse("--max-model-len", "0")
    assert raised.value.field == "max_model_len"


def test_served_model_name_reaches_the_sim_engine() -> None:
    assert build_serving(parse()).model_names[0] == "quiesce"
    assert build_serving(parse("--served-model-name", "tiny")).model_names[0] == "tiny"
    with pytest.raises(ConfigError) as raised:
        parse("--served-model-name", " ")
    assert raised.value.field == "served_model_name"


def test_the_vllm_engine_serves_the_model_directory_name_by_default() -> None:
    from quiesce.adapters.vllm.serving import VllmServing

    assert VllmServing("/models/tiny-llama/").model_names == ("tiny-llama",
                                                               "/models/tiny-llama/")
    assert VllmServing("/m", served_model_name="x").model_names[0] == "x"


def test_kv_transfer_config_is_parsed_as_a_json_object() -> None:
    config = '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'
    options = parse("--engine", "vllm", "--model", "/m", "--kv-transfer-config", config)
    assert options.kv_transfer_config == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert parse("--engine", "vllm", "--model", "/m").kv_transfer_config is None


@pytest.mark.parametrize("text,says", [("{kv_connector: Nixl", "not valid JSON"),
                                       ('["NixlConnector"]', "must be a JSON object")])
def test_a_bad_kv_transfer_config_names_the_field(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse("--engine", "vllm", "--model", "/m", "--kv-transfer-config", text)
    assert raised.value.field == "kv_transfer_config"
    assert says in str(raised.value)


def test_a_bad_kv_transfer_config_exits_2_before_anything_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--engine", "vllm", "--model", "/nonexistent",
                 "--kv-transfer-config", "{oops", "--port", "0", "--admin-port", "0"])
    assert code == 2
    assert "kv_transfer_config" in capsys.readouterr().err


def test_kv_transfer_config_needs_the_vllm_engine() -> None:
    with pytest.raises(ConfigError) as raised:
        parse("--kv-transfer-config", "{}")
    assert raised.value.field == "kv_transfer_config"


GIB = 1 << 30


@pytest.mark.parametrize("environ,engine_args,available,expected", [
    ({}, {}, 64 * GIB, 4 * GIB),                 # plenty free: 4 GiB
    ({}, {}, 8 * GIB, 2 * GIB),                  # a quarter of what is available
    ({}, {}, None, 4 * GIB),                     # unknown: 4 GiB
    ({"VLLM_CPU_KVCACHE_SPACE": "1"}, {}, 64 * GIB, None),  # the operator's, read by vLLM
    ({"VLLM_CPU_KVCACHE_SPACE": ""}, {}, 64 * GIB, 4 * GIB),
    ({}, {"gpu_memory_utilization": 0.5}, 64 * GIB, None),
    ({}, {"kv_cache_memory_bytes": GIB}, 64 * GIB, None),
])
def test_the_cpu_kv_cache_default_applies_only_when_nothing_was_set(
        environ: dict[str, str], engine_args: dict[str, object], available: int | None,
        expected: int | None) -> None:
    from quiesce.adapters.vllm.serving import cpu_kv_cache_bytes

    assert cpu_kv_cache_bytes(environ, engine_args, available) == expected


def test_available_memory_is_read_or_unknown() -> None:
    from quiesce.adapters.vllm.serving import available_memory_bytes

    available = available_memory_bytes()
    assert available is None or available > 0


def test_publishing_the_deletion_cost_outside_a_pod_exits_2_naming_why(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert parse("--publish-deletion-cost").publish_deletion_cost
    assert not parse().publish_deletion_cost
    code = main(["serve", "--engine", "sim", "--publish-deletion-cost", "--port", "0",
                 "--admin-port", "0"])
    assert code == 2
    err = capsys.readouterr().err
    assert "publish_deletion_cost" in err and "KUBERNETES_SERVICE_HOST" in err


def test_trtllm_options_reach_the_worker_options() -> None:
    options = parse("--engine", "trtllm", "--model", "/models/tiny", "--role", "prefill",
                    "--cache-transceiver-config", '{"backend": "NIXL"}')
    assert (options.engine, options.model) == ("trtllm", "/models/tiny")
    assert options.cache_transceiver_config == {"backend": "NIXL"}
    with pytest.raises(ConfigError) as raised:
        parse("--engine", "trtllm")
    assert raised.value.field == "model"
    with pytest.raises(ConfigError) as raised:
        parse("--engine", "vllm", "--model", "/m", "--cache-transceiver-config", "{}")
    assert raised.value.field == "cache_transceiver_config"
    with pytest.raises(ConfigError) as raised:
        parse("--engine", "trtllm", "--model", "/m", "--kv-transfer-config", "{}")
    assert raised.value.field == "kv_transfer_config"


def test_trtllm_without_tensorrt_llm_exits_2_naming_the_package(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["serve", "--engine", "trtllm", "--model", "/nonexistent", "--port", "0",
                 "--admin-port", "0"])
    assert code == 2
    assert "tensorrt_llm" in capsys.readouterr().err


def test_sglang_needs_a_model_and_its_package(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as raised:
        parse("--engine", "sglang")
    assert raised.value.field == "model"
    assert parse("--engine", "sglang", "--model", "/m").engine == "sglang"
    code = main(["serve", "--engine", "sglang", "--model", "/nonexistent", "--port", "0",
                 "--admin-port", "0"])
    assert code == 2  # the core environment has no sglang: named, nothing started
    assert "'sglang'" in capsys.readouterr().err


def test_etcd_discovery_options_reach_the_worker_options(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "decode-7f9c")
    options = parse("--etcd", "etcd.svc:2379", "--etcd-prefix", "/llm/workers",
                    "--etcd-ttl", "6", "--role", "decode", "--port", "8100")
    assert (options.etcd, options.name) == (("etcd.svc", 2379), "decode-7f9c")
    config = options.etcd_config(8100)
    assert (config.worker, config.address, config.role, config.prefix, config.ttl_s) == (
        "decode-7f9c", "http://127.0.0.1:8100", "decode", "/llm/workers", 6)
    assert (config.host, config.port) == ("etcd.svc", 2379)  # etcd's, not the worker's
    advertised = parse("--etcd", "127.0.0.1:2379", "--name", "w1",
                       "--advertise-url", "http://10.0.0.7:8000")
    assert advertised.etcd_config(0).address == "http://10.0.0.7:8000"
    assert parse().etcd is None  # no --etcd: registered nowhere outside the process


@pytest.mark.parametrize(("argv", "field"), [
    (("--etcd", "etcd.svc"), "etcd"),
    (("--etcd", "etcd.svc:0"), "etcd"),
    (("--etcd", ":2379"), "etcd"),
    (("--etcd", "h:2379", "--name", "a/b"), "name"),
    (("--etcd", "h:2379", "--etcd-prefix", "no-slash"), "etcd_prefix"),
    (("--etcd", "h:2379", "--etcd-ttl", "0"), "etcd_ttl"),
    (("--advertise-url", "10.0.0.7:8000"), "advertise_url"),
    (("--advertise-url", "http://"), "advertise_url"),
    (("--advertise-url", "http://h:notaport"), "advertise_url"),
    (("--etcd", "h:\u00b2"), "etcd"),
    (("--etcd", "::1"), "etcd"),
    (("--etcd", "http://h:2379"), "etcd"),
    (("--etcd", "h:2379", "--host", "0.0.0.0"), "advertise_url"),
])
def test_bad_discovery_options_name_their_field(argv: tuple[str, ...], field: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse(*argv)
    assert raised.value.field == field


def test_the_worker_name_defaults_to_host_and_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAME", raising=False)
    name = parse().name
    assert name.endswith(f"-{os.getpid()}") and len(name) > len(str(os.getpid())) + 1


def test_an_ipv6_etcd_endpoint_and_listen_address_are_bracketed() -> None:
    options = parse("--etcd", "[fd00::5]:2379", "--host", "::1", "--name", "w")
    assert options.etcd == ("fd00::5", 2379)
    config = options.etcd_config(8000)
    assert (config.address, config.host) == ("http://[::1]:8000", "fd00::5")
    wildcard = parse("--etcd", "h:2379", "--host", "0.0.0.0",
                     "--advertise-url", "http://10.0.0.7:8000")
    assert wildcard.etcd_config(8000).address == "http://10.0.0.7:8000"
