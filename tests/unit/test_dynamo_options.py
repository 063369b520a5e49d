"""``quiesce dynamo COMPONENT [options] -- ARGS``: the split at ``--``, the budget and
drain settings, and bad input refused with exit 2 before anything starts. The worker
itself runs against the real Dynamo in tests/integration/dynamo/."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from quiesce.errors import ConfigError
from quiesce.ops import cli
from quiesce.serve.options import dynamo_policy


def _parsed(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    seen: list[argparse.Namespace] = []

    def record(args: argparse.Namespace) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(cli, "_dynamo", record)
    assert cli.main(argv) == 0
    (args,) = seen
    return args


def test_everything_after_the_double_dash_goes_to_dynamo_unparsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    args = _parsed(["dynamo", "vllm", "--admin-port", "9100", "--budget", "50", "--",
                    "--model", "m", "--budget", "3", "--"], monkeypatch)
    assert args.component == "vllm" and args.admin_port == 9100 and args.budget == 50.0
    assert args.args == ["--model", "m", "--budget", "3", "--"]


def test_without_a_double_dash_dynamo_gets_no_arguments(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parsed(["dynamo", "vllm"], monkeypatch).args == []


def test_an_unknown_option_before_the_double_dash_is_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["dynamo", "vllm", "--model", "m"])  # Dynamo's option, but before --
    assert exited.value.code == 2
    assert "--model" in capsys.readouterr().err


def test_an_unknown_component_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["dynamo", "mocker", "--", "--model", "m"])
    assert exited.value.code == 2
    assert "vllm" in capsys.readouterr().err


def _namespace(**changes: Any) -> argparse.Namespace:
    values = {"budget": 30.0, "reserve": None, "router_grace": 1.0, **changes}
    return argparse.Namespace(**values)


def test_the_router_grace_defaults_to_dynamos_own_grace_period() -> None:
    """By default quiesce keeps admitting 1 s after the unregister, then until 2 s pass
    without a request; Dynamo's own variable sets the first part, as it sets its helper's
    sleep (after which quiesce drains instead of aborting)."""
    _, drain = dynamo_policy(_namespace(router_grace=None), environ={})
    assert drain.router_grace_s == 1.0 and drain.router_quiet_s == 2.0
    _, drain = dynamo_policy(_namespace(router_grace=None),
                             environ={"DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "2.5"})
    assert drain.router_grace_s == 2.5
    with pytest.raises(ConfigError) as info:
        dynamo_policy(_namespace(router_grace=None),
                      environ={"DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "soon"})
    assert info.value.field == "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS"


def test_the_policy_keeps_a_fifth_of_the_budget_for_dynamos_teardown() -> None:
    policy, drain = dynamo_policy(_namespace(budget=100.0))
    assert policy.total_s == 100.0 and policy.cleanup_reserve_s == 5.0
    assert drain.router_grace_s == 1.0
    policy, _ = dynamo_policy(_namespace(budget=10.0))
    assert policy.cleanup_reserve_s == 2.0


@pytest.mark.parametrize("changes,field", [
    ({"budget": 0.0}, "total_s"), ({"budget": 10.0, "reserve": 10.0}, "cleanup_reserve_s"),
    ({"router_grace": -1.0}, "router_grace_s"), ({"router_quiet": -1.0}, "router_quiet_s"),
])
def test_bad_settings_are_a_config_error_naming_the_field(changes: dict[str, Any],
                                                          field: str) -> None:
    with pytest.raises(ConfigError) as info:
        dynamo_policy(_namespace(**changes))
    assert info.value.field == field


def test_bad_settings_exit_2_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["dynamo", "vllm", "--budget", "0", "--", "--model", "m"]) == 2
    assert "total_s" in capsys.readouterr().err
