"""The field report's scale on NVIDIA Dynamo: the reference worker as a Dynamo backend.

aiperf (its own environment) plays a seeded mooncake trace with ``--fixed-schedule``
(streaming completions, ``ignore_eos``) against Dynamo's real frontend (ai-dynamo 1.6.1,
round robin), in front of ``workers`` reference workers registered as Dynamo backends
(``quiesce serve --dynamo``: the simulated engine, one decode step a token, its model
card and ``dynamo.backend.generate`` endpoint in Dynamo's ``file`` discovery on
loopback). At full scale (:class:`ScaleConfig` defaults) that is the field report's
8 req/s phase: 187.5 s of Poisson arrivals, about 1,500 requests, with reasoning-length
streams (median 5 s, tail 30 s). During the load one worker (the first started) is
scaled down as the kubelet does it: the pod's preStop hook where it has one, then
SIGTERM to the main process, SIGKILL at the grace period.

Modes (:data:`MODES`), the same workers and trace, only the shutdown differs:

- ``dynamo_default``: ``--dynamo-shutdown dynamo``, Dynamo 1.6.1's own graceful-shutdown
  helper as its workers ship it (unregister the instance, sleep 5 s, abort what is
  left), no preStop hook;
- ``quiesce``: quiesce's drain (unregister the model card and the instance, router grace
  and quiet, close admission, wait for every admitted stream), preStop ``quiesce prestop``.

Every request is judged from aiperf's raw export by reading its stream to the end
(:func:`bench.replay.judge.read_outcomes`): an error event inside a 200 is a loss.

Failure behaviour: an unknown mode or a bad config raises ValueError before anything
starts; a process that cannot start, or aiperf that writes no raw export, raises
RuntimeError (the run is void, never counted); every process is stopped on the way out.
A run that did not judge every planned request once is ``complete`` False.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from bench.replay.run import OUTPUT_LENGTHS
from bench.replay.trace import LengthDistribution, Phase, UniformLengths, write_trace
from tests.integration.dynamo.processes import frontend, wait_for_model
from tests.integration.dynamo.reference import reference_worker
from tests.integration.worker_process import Worker, prestop_command

MODES = {"dynamo_default": "dynamo", "quiesce": "quiesce"}
"""Mode → the workers' ``--dynamo-shutdown``."""
INPUT_LENGTHS = UniformLengths(8, 24)
"""Short prompts: the frontend tokenizes every one of them on two shared cores."""
LOAD_START_TIMEOUT_S = 300.0
"""How long aiperf may take to send its first request (it synthesizes prompts first)."""


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
    """One run's trace, workers and scale-down. The defaults are the field report's
    scale; :meth:`short` is a version for a test (tens of seconds). Invalid values raise
    ValueError naming the field."""

    rate_rps: float = 8.0
    load_s: float = 187.5
    scale_down_at_s: float = 60.0
    """Seconds after the frontend saw aiperf's first request."""
    workers: int = 4
    decode_step_s: float = 0.1
    input_lengths: LengthDistribution = INPUT_LENGTHS
    output_lengths: LengthDistribution = OUTPUT_LENGTHS
    """Median 50 tokens (5 s at 0.1 s a step), tail up to 300 (30 s): about half the
    streams outlive a fixed 5 s grace, as in the field report (bench.replay)."""
    grace_s: float = 120.0
    """terminationGracePeriodSeconds of the victim's pod."""
    budget_s: float = 50.0
    """The workers' ``--budget`` (quiesce's shutdown; Dynamo's helper has none)."""
    prestop_margin_s: float = 55.0
    """``quiesce prestop --margin``: above the budget, as deploy/kubernetes says."""
    seed: int = 1

    def __post_init__(self) -> None:
        for name in ("rate_rps", "load_s", "decode_step_s", "grace_s", "budget_s",
                     "prestop_margin_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ScaleConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.scale_down_at_s < self.load_s:
            raise ValueError(f"ScaleConfig.scale_down_at_s must be in [0, load_s), got "
                             f"{self.scale_down_at_s!r}")
        if self.workers < 2:
            raise ValueError(f"ScaleConfig.workers must be >= 2 (one is scaled down), got "
                             f"{self.workers!r}")
        if not self.grace_s > self.prestop_margin_s > self.budget_s:
            raise ValueError("ScaleConfig: need grace_s > prestop_margin_s > budget_s (a "
                             "SIGTERM at the end of the preStop hook still leaves the worker "
                             "its whole budget before the SIGKILL)")

    @classmethod
    def short(cls) -> ScaleConfig:
        """A short run: 2 workers, 4 req/s for 10 s, streams of 6-8 s (every stream the
        victim holds outlives Dynamo's 5 s grace)."""
        return cls(rate_rps=4.0, load_s=10.0, scale_down_at_s=3.0, workers=2,
                   decode_step_s=0.02, output_lengths=UniformLengths(300, 400))

    def phases(self) -> tuple[Phase, ...]:
        return (Phase(self.rate_rps, self.load_s),)


@dataclasses.dataclass
class ScaleRun:
    """What one run found. ``failed``/``failures``: requests lost, by primary reason
    (:func:`bench.replay.judge.summarize`); ``victim_*``: the scaled-down worker
    (``exit_code`` None: SIGKILLed at the grace period; ``prestop_code`` None: no hook)."""

    mode: str
    planned: int
    sent: int
    failed: int
    failures: dict[str, int]
    complete: bool
    """Every planned request was sent and judged once, and aiperf did not time out."""
    missed_by_aiperf: int
    """Lost requests aiperf itself counted as successes (an error event inside a 200)."""
    victim_exit_code: int | None
    victim_prestop_code: int | None
    victim_signal_to_exit_s: float
    """From the start of the deletion (preStop, else SIGTERM) to the victim's exit."""
    victim_report: dict[str, Any] | None
    aiperf_rc: int | None
    wall_s: float

    def to_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "planned": self.planned, "sent": self.sent,
                "failed": self.failed, "failures": self.failures, "complete": self.complete,
                "missed_by_aiperf": self.missed_by_aiperf,
                "victim": victim_dict(self.victim_exit_code, self.victim_prestop_code,
                                      self.victim_signal_to_exit_s, self.victim_report),
                "aiperf_rc": self.aiperf_rc, "wall_s": round(self.wall_s, 1)}


@contextlib.contextmanager
def _workers(mode: str, store: Path, model: Path, config: ScaleConfig) -> Iterator[list[Worker]]:
    """The workers, started one after the other, the victim first; stopped on the way out."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(reference_worker(
            store, model, shutdown=MODES[mode], budget_s=config.budget_s,
            decode_step_s=config.decode_step_s)) for _ in range(config.workers)]


async def run_scale(mode: str, workdir: Path, model: Path,
                    config: ScaleConfig | None = None) -> ScaleRun:
    """Run ``mode`` (:data:`MODES`) once at ``config``'s scale (default: the field
    report's) and judge every request.

    ``model``: a model directory with ``config.json`` and ``tokenizer.json`` (the tiny
    test model of ``tests.integration.vllm.tiny_model``): the workers' model card, which
    the frontend tokenizes with; the frontend lists it, and aiperf asks for it, as
    ``str(model)``. ``workdir`` (created) receives the trace, aiperf's artifacts
    (``aiperf/``), the discovery store and every process's log. Needs the Dynamo
    environment (run it with ``.venv-dynamo/bin/python``) and ``.venv-aiperf``
    (``ci/setup_aiperf.sh``). Raises as the module docstring says. Takes about the
    load's length plus a minute (aiperf's start-up, the workers', the victim's exit).

    Issue 17's figures from two runs of the same config: ``scale_sent`` = ``sent``,
    ``scale_dynamo_default_failed`` / ``scale_quiesce_failed`` = ``failed`` of each mode.
    """
    if mode not in MODES:
        raise ValueError(f"mode: one of {sorted(MODES)}, got {mode!r}")
    config = config or ScaleConfig()
    aiperf.check_installed()
    started = time.monotonic()
    store = workdir / "store"
    store.mkdir(parents=True, exist_ok=True)
    trace = workdir / "trace.jsonl"
    records = write_trace(trace, config.phases(), seed=config.seed,
                          input_lengths=config.input_lengths,
                          output_lengths=config.output_lengths)
    with frontend(store) as front, _workers(mode, store, model, config) as workers:
        await asyncio.to_thread(wait_for_model, front.url, str(model))
        await warm_up(front.url, str(model), LOAD_START_TIMEOUT_S)
        warmed_up = len(front.process.lines)
        load = asyncio.create_task(aiperf.run_aiperf(
            front.url, str(model), trace, workdir / "aiperf", failed_request_threshold=None,
            timeout_s=LOAD_START_TIMEOUT_S + config.load_s * 3 + config.grace_s))
        try:
            await first_request(front, load, LOAD_START_TIMEOUT_S, after=warmed_up)
            await asyncio.sleep(config.scale_down_at_s)
        except BaseException:
            await stop_load(load)
            raise
        victim = workers[0]
        hook = (prestop_command(victim, config.grace_s, config.prestop_margin_s)
                if mode == "quiesce" else None)
        deletion, removal_s, run = await delete_during_load(load, victim, config.grace_s, hook)
        keep_logs(workdir, front, workers)
    outcomes = judged(run)
    summary = summarize(outcomes)
    ids = [o.request_id for o in outcomes]
    return ScaleRun(mode=mode, planned=len(records), sent=summary["sent"],
                    failed=summary["failed"], failures=summary["failures"],
                    complete=(summary["sent"] == len(records) and len(set(ids)) == len(ids)
                              and not run.timed_out),
                    missed_by_aiperf=summary["missed_by_aiperf"],
                    victim_exit_code=deletion.exit_code,
                    victim_prestop_code=deletion.prestop_code,
                    victim_signal_to_exit_s=round(removal_s, 3),
                    victim_report=deletion.report, aiperf_rc=run.returncode,
                    wall_s=time.monotonic() - started)
