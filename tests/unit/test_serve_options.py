"""`quiesce serve` options: parsed into WorkerOptions, bad values refused with the field."""

from __future__ import annotations

import argparse

import pytest

from quiesce.errors import ConfigError
from quiesce.serve_options import WorkerOptions, add_serve_arguments, options_from_args


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
