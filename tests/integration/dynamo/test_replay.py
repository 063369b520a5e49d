"""A short replay of the field report on Dynamo itself: aiperf → Dynamo's real frontend →
two real ``dynamo.vllm`` workers (vLLM 0.31 on the CPU), one scaled down as the kubelet
does it (preStop where the pod has one, then SIGTERM to the main process).

Arm (a), Dynamo as shipped, must lose the streams its worker held at the scale-down; arm
(c), the same worker under ``quiesce dynamo vllm``, must lose none and leave drained.
The full set of arms is ``python -m bench.dynamo`` (``make bench``)."""

from __future__ import annotations

from pathlib import Path

from bench.dynamo.result import ARMS
from bench.dynamo.run import ArmRun, DynamoReplayConfig, run_arm
from bench.replay.trace import UniformLengths

CONFIG = DynamoReplayConfig(rate_rps=1.0, load_s=8.0, scale_down_at_s=3.0,
                            output_lengths=UniformLengths(320, 400))
"""Every stream outlasts Dynamo's 5 s grace (at least 6.4 s at the paced step), and the
victim holds at least the requests sent in the first seconds (round robin)."""


async def _run(name: str, tiny_model: Path, tmp_path: Path) -> ArmRun:
    (arm,) = [arm for arm in ARMS if arm.name == name]
    run = await run_arm(arm, CONFIG, tmp_path / name, tiny_model)
    assert run.complete, run.to_dict()
    return run


async def test_dynamo_as_shipped_loses_the_victims_streams(tiny_model: Path,
                                                          tmp_path: Path) -> None:
    run = await _run("dynamo_default", tiny_model, tmp_path)
    assert run.failed >= 1, run.to_dict()
    assert run.migrated == 0  # migration is off by default


async def test_quiesce_in_dynamos_worker_loses_nothing(tiny_model: Path,
                                                      tmp_path: Path) -> None:
    run = await _run("quiesce", tiny_model, tmp_path)
    assert run.failed == 0, run.to_dict()
    assert run.victim_prestop_code == 0 and run.victim_exit_code == 0, run.to_dict()
    assert run.victim_report is not None and run.victim_report["outcome"] == "drained"
    assert run.migrated == 0 and run.recomputed_tokens == 0
