"""What ``Scheduler.is_fully_idle`` does not cover, and noticing when it changes.

Real SGLang 0.5.23 schedulers (:mod:`.shells`) holding work only in places SGLang's own
``is_fully_idle()`` does not look at: each reads idle to SGLang and busy to quiesce.
Then the fingerprint of the installed ``is_fully_idle`` against the tested one, and a
changed body (a subclass that overrides it, as a new SGLang release would) → UNKNOWN.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.sglang import SKIP_REASON

pytest.importorskip("sglang", reason=SKIP_REASON)

from sglang.srt.disaggregation.decode_kvcache_offload_manager import (
    DecodeKVCacheOffloadManager,
)
from sglang.srt.disaggregation.encoder.receiver import MMReceiverHTTP
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.runtime_context import get_parallel

from quiesce.adapters.sglang.idle_fingerprint import (
    TESTED_IDLE_FINGERPRINTS,
    accepted_fingerprints,
    idle_fingerprint,
)
from quiesce.adapters.sglang.probe import installed_sglang_version
from quiesce.adapters.sglang.scheduler_rpc import states_work
from quiesce.adapters.sglang.scheduler_state import STATE_KEY, read_scheduler_state
from quiesce.probe import Role, Verdict
from tests.integration.sglang import shells


@pytest.fixture(autouse=True)
def one_pipeline_stage() -> Iterator[None]:
    with get_parallel().override(pp_size=1, pp_rank=0, tp_rank=0, dp_rank=None):
        yield


def work(s: Any, role: Role, **options: Any) -> Any:
    return states_work([{STATE_KEY: read_scheduler_state(s)}], role, expected_ranks=1,
                       **options)


def test_a_request_waiting_for_its_encoder_is_busy() -> None:
    s = shells.scheduler("null")
    s.mm_receiver = shells._bare(MMReceiverHTTP, waiting_list=[object()])  # EPD language side
    assert s.is_fully_idle() is True  # SGLang's expression does not look there
    result = work(s, Role.AGGREGATED)
    assert result.verdict is Verdict.BUSY and result.queues["mm_encoder_waiting"] == 1


def test_a_decode_offload_backup_to_l3_is_busy() -> None:
    s = shells.scheduler("decode")
    s.decode_offload_manager = shells._bare(DecodeKVCacheOffloadManager, ongoing_offload={},
                                            ongoing_backup={7: ("rid", None, 0.0, [])})
    assert s.is_fully_idle() is True  # it checks ongoing_offload only
    result = work(s, Role.DECODE)
    assert result.verdict is Verdict.BUSY and result.queues["decode_offload_backups"] == 1


def test_the_installed_is_fully_idle_is_the_tested_one() -> None:
    version = installed_sglang_version()
    assert version is not None
    assert idle_fingerprint(Scheduler) == TESTED_IDLE_FINGERPRINTS[version.split("+")[0]]
    assert work(shells.scheduler("null"), Role.AGGREGATED).verdict is Verdict.QUIESCENT


class NextScheduler(Scheduler):  # type: ignore[misc]
    """A release whose ``is_fully_idle`` checks one queue more (here: nothing more)."""

    def is_fully_idle(self, for_health_check: bool = False,
                      ignore_waiting: bool = False) -> bool:
        return super().is_fully_idle(for_health_check, ignore_waiting) and True


def test_a_changed_is_fully_idle_is_unknown_until_accepted() -> None:
    s = shells.scheduler("null")
    s.__class__ = NextScheduler
    assert s.is_fully_idle() is True
    result = work(s, Role.AGGREGATED)
    assert result.verdict is Verdict.UNKNOWN
    assert "is not one this adapter was tested against" in result.reasons[0]
    changed = idle_fingerprint(NextScheduler)
    assert changed in result.reasons[0]  # the operator can review and accept it
    accepted = work(s, Role.AGGREGATED, fingerprints=accepted_fingerprints((changed,)))
    assert accepted.verdict is Verdict.QUIESCENT
