"""The scale arm of the Dynamo benchmark, short (:meth:`bench.dynamo.scale.ScaleConfig.short`):
aiperf → Dynamo's real frontend → two ``quiesce serve --dynamo`` workers, one scaled down
as the kubelet does it. With Dynamo's own helper the victim's streams are cut; with
quiesce's drain (and ``quiesce prestop``) none is lost and the victim exits drained.
The full scale is ``run_scale(mode, workdir, model)`` with the default config."""

from __future__ import annotations

from pathlib import Path

from bench.dynamo.scale import ScaleConfig, ScaleRun, run_scale
from bench.replay import aiperf
from tests.integration.real_parts import skip_unless_present

skip_unless_present(aiperf.missing())


async def _run(mode: str, tiny_model: Path, tmp_path: Path) -> ScaleRun:
    run = await run_scale(mode, tmp_path / mode, tiny_model, ScaleConfig.short())
    assert run.complete, run.to_dict()
    return run


async def test_dynamo_default_loses_the_victims_streams(tiny_model: Path,
                                                        tmp_path: Path) -> None:
    run = await _run("dynamo_default", tiny_model, tmp_path)
    assert run.failed >= 1 and run.missed_by_aiperf >= 1, run.to_dict()
    assert run.victim_prestop_code is None and run.victim_exit_code == 5, run.to_dict()


async def test_quiesce_loses_nothing_and_the_victim_exits_drained(tiny_model: Path,
                                                                  tmp_path: Path) -> None:
    run = await _run("quiesce", tiny_model, tmp_path)
    assert run.failed == 0, run.to_dict()
    assert run.victim_prestop_code == 0 and run.victim_exit_code == 0, run.to_dict()
    assert run.victim_report is not None and run.victim_report["outcome"] == "drained"
