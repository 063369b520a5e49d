"""Which SGLang releases the adapter accepts, from the releases' own source (no SGLang,
no network).

``tests/unit/data/sglang_<version>_is_fully_idle.txt`` hold ``Scheduler.is_fully_idle``
as each wheel ships it (where it came from: each file's first lines). The fingerprints
pinned here were computed with quiesce's ``idle_fingerprint`` from the installed 0.5.23
wheel and the 0.5.21 wheel, on Python 3.10 to 3.13. That the installed scheduler still
runs the tested body is tests/integration/sglang/test_coverage.py (SGLang's own venv).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from quiesce.adapters.sglang.idle_fingerprint import (
    TESTED_IDLE_FINGERPRINTS,
    accepted_fingerprints,
    idle_fingerprint,
    source_fingerprint,
)

DATA = Path(__file__).parent / "data"
FINGERPRINT_0_5_23 = "6f3f9183c255378e"
FINGERPRINT_0_5_21 = "3b00b244f84bc11a"
ADDED_IN_0_5_23 = (
    # ignore_waiting=True (pause/flush; never used by quiesce): a waiting request that
    # holds transferred KV is not idle
    "        else:\n"
    "            # A PD-decode request waiting with its transferred KV still owns\n"
    "            # its request row; a flush would free it.\n"
    "            idle &= not any(r.kv.holds_kv for r in self.waiting_queue)\n",
    # decode: aborted transfers whose KV release waits for prefill's ABORT_ACK
    "                idle &= not self.disagg_decode_transfer_queue"
    ".has_pending_deferred_releases()\n",
)


def source_of(version: str) -> str:
    return (DATA / f"sglang_{version}_is_fully_idle.txt").read_text()


def test_the_tested_fingerprint_is_that_of_0_5_23s_is_fully_idle() -> None:
    assert TESTED_IDLE_FINGERPRINTS == {"0.5.23": FINGERPRINT_0_5_23}
    assert source_fingerprint(source_of("0.5.23")) == FINGERPRINT_0_5_23


def test_idle_fingerprint_reads_a_method_as_the_scheduler_does(tmp_path: Path) -> None:
    """Through ``inspect.getsource`` of a class's method, as in the scheduler process."""
    path = tmp_path / "stand_in_scheduler.py"
    path.write_text("class Scheduler:\n" + source_of("0.5.23"))
    spec = importlib.util.spec_from_file_location("stand_in_scheduler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        assert idle_fingerprint(module.Scheduler) == FINGERPRINT_0_5_23
    finally:
        del sys.modules[spec.name]


def test_0_5_21s_is_fully_idle_is_0_5_23s_without_two_checks_and_is_not_accepted() -> None:
    """The source check: 0.5.21's body is 0.5.23's minus the two checks 0.5.23 added
    (comments do not count, code does), so its fingerprint differs and is refused."""
    newer = source_of("0.5.23")
    assert all(added in newer for added in ADDED_IN_0_5_23)
    without = newer
    for added in ADDED_IN_0_5_23:
        without = without.replace(added, "")
    assert source_fingerprint(without) == FINGERPRINT_0_5_21
    assert source_fingerprint(source_of("0.5.21")) == FINGERPRINT_0_5_21
    assert FINGERPRINT_0_5_21 not in accepted_fingerprints()


@pytest.mark.parametrize("change,same", [
    (lambda s: s.replace("    ", "\t"), True),  # indentation style
    (lambda s: s.replace("# Health check", "# A health check"), True),  # a comment
    (lambda s: s.replace("idle &= len(self.waiting_queue) == 0",
                         "idle &= len(self.waiting_queue) <= 0"), False),
    (lambda s: s.replace("for_health_check=False", "for_health_check=True"), False),
])
def test_formatting_does_not_count_and_code_does(change: Callable[[str], str],
                                                  same: bool) -> None:
    source = source_of("0.5.23")
    changed = change(source)
    assert changed != source
    assert (source_fingerprint(changed) == FINGERPRINT_0_5_23) is same
