"""The Dynamo replay's bookkeeping (bench/dynamo): what it reads from Dynamo's frontend log
and how arms map to the metric names issue 17 asks for. The runs themselves need
Dynamo's environment (tests/integration/dynamo/test_replay.py, test_scale.py)."""

from __future__ import annotations

from bench.dynamo.result import ARMS, HEADLINE, RESULT_NAMES, SCALE_ARMS
from bench.dynamo.run import migrations

RETRY = ("\x1b[2m2026-12-04T02:55:23.600644Z\x1b[0m \x1b[32m INFO\x1b[0m http-request: "
         "request_span: migration retry scheduled request.attempt={attempt} "
         "migration.is_retry=true migration.reason=\"engine_shutdown\" "
         "migration.from_worker_id=9813975482455150150 migration.tokens_completed={tokens} "
         "method=POST uri=/v1/completions version=HTTP/1.1 "
         "x_request_id=\"{rid}\" request_id=6ef230dd-7eb8-4d42-8dc4-95653ea7f326\n")
"""A line of ai-dynamo 1.6.1's frontend log, colours included (captured in bench/dynamo)."""


def test_migrations_are_read_per_request_with_every_attempt() -> None:
    lines = [RETRY.format(attempt=1, tokens=101, rid="7ce3ea13-8828"),
             "unrelated line\n",
             RETRY.format(attempt=1, tokens=40, rid="4d3a5d78-35aa"),
             RETRY.format(attempt=2, tokens=172, rid="4d3a5d78-35aa")]
    assert migrations(lines) == {"7ce3ea13-8828": (1, 101), "4d3a5d78-35aa": (2, 212)}


def test_no_migration_line_means_no_migration() -> None:
    assert migrations(["request received\n", "migration retries exhausted\n"]) == {}


def test_every_metric_issue_17_names_has_an_arm() -> None:
    prefixes = {RESULT_NAMES.get(arm.name, arm.name) for arm in ARMS} | set(SCALE_ARMS)
    for metric in HEADLINE:
        if metric in ("sent", "scale_sent"):
            continue
        stem = metric.removesuffix("_failed").removesuffix("_recomputed_tokens")
        assert stem in prefixes, metric


def test_no_two_arms_give_the_same_metric() -> None:
    """Every arm's metric names, with every suffix _metrics writes, are distinct (the
    prefill arms once wrote prefill_dynamo_migration_failed twice)."""
    suffixes = ("sent", "failed", "migrated", "migrated_then_failed", "recomputed_tokens",
                "victim_signal_to_exit_s", "p99_e2e_s_in_flight")
    names = [f"{RESULT_NAMES.get(arm.name, arm.name)}_{suffix}"
             for arm in ARMS for suffix in suffixes]
    names += [f"{name}_{suffix}" for name in SCALE_ARMS
              for suffix in ("failed", "missed_by_aiperf", "victim_signal_to_exit_s")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
