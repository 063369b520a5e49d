"""Which SGLang releases the adapter accepts, from the releases' own source (no SGLang,
no network).

``tests/unit/data/sglang_<version>_is_fully_idle.txt`` hold ``Scheduler.is_fully_idle``
as each wheel ships it (where it came from: each file's first lines). The fingerprints
pinned here were computed with quiesce's ``idle_fingerprint`` from the installed 0.5.23
wheel and the 0.5.21 wheel, on Python 3.10 to 3.13. That the installed scheduler still
runs the tested body is tests/integration/sglang/test_coverage.py (SGLang's own venv).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from quiesce.adapters.sglang import (
    TESTED_VERSIONS,
    UNSUPPORTED_VERSIONS,
    SglangProbe,
    accept_untested,
    untested_fingerprints,
)
from quiesce.adapters.sglang import probe as sglang_probe
from quiesce.adapters.sglang.idle_fingerprint import (
    REFUSED_IDLE_FINGERPRINTS,
    TESTED_IDLE_FINGERPRINTS,
    accepted_fingerprints,
    idle_fingerprint,
    source_fingerprint,
)
from quiesce.adapters.sglang.probe import version_problem
from quiesce.errors import ConfigError
from quiesce.probe import Role, Verdict

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


# -- the version tables and the operator's acceptance --------------------------------------

def test_the_version_tables_are_what_the_source_check_found() -> None:
    """0.5.23 tested; 0.5.21 (ai-dynamo 1.6.1's pin) read from its wheel and refused, with
    the attributes the adapter reads and 0.5.21 lacks, and its is_fully_idle fingerprint."""
    assert TESTED_VERSIONS == ("0.5.23",)
    assert set(UNSUPPORTED_VERSIONS) == {"0.5.21"}
    assert REFUSED_IDLE_FINGERPRINTS == {"0.5.21": FINGERPRINT_0_5_21}
    why = UNSUPPORTED_VERSIONS["0.5.21"]
    for missing in ("_deferred_input_requests", "defer_decode_allocation",
                    "_deferred_ack_poisoned_rooms", "num_pending_deferred_releases",
                    FINGERPRINT_0_5_21, "deferred KV releases"):
        assert missing in why
    assert not set(REFUSED_IDLE_FINGERPRINTS.values()) & accepted_fingerprints()
    assert not set(UNSUPPORTED_VERSIONS) & set(TESTED_VERSIONS)


def test_an_unsupported_release_is_unknown_even_when_untested_releases_are_allowed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert "0.5.21+cu129 does not fit this adapter" in str(version_problem("0.5.21+cu129"))
    manager = SimpleNamespace(server_args=SimpleNamespace(dp_size=1, pp_size=1,
                                                          tokenizer_worker_num=1),
                              rid_to_state={}, load_snapshot_reader=None)
    for version, refused in (("0.5.21", True), ("0.5.24", False), (None, False)):
        monkeypatch.setattr(sglang_probe, "installed_sglang_version", lambda v=version: v)
        probe = SglangProbe(manager, Role.AGGREGATED, scheduler=False,
                            allow_untested_version=True)
        work = asyncio.run(probe.pending_work())
        assert work.verdict is Verdict.UNKNOWN  # rid_to_state alone never proves idle
        assert any("does not fit" in reason for reason in work.reasons) is refused


@pytest.mark.parametrize("accepted,installed,message", [
    ("0.5.24", None, "SGLang is not installed"),
    ("0.5.24", "0.5.25", "names SGLang '0.5.24', but SGLang 0.5.25 is installed"),
    ("0.5.2", "0.5.24", "is installed"),
    ("0.5.23", "0.5.23", "SGLang 0.5.23 is a tested release: drop the option"),
    ("0.5.21", "0.5.21", "SGLang 0.5.21 cannot be accepted: checked against its source"),
    ("0.5.21+cu129", "0.5.21+cu129", "cannot be accepted"),
])
def test_acceptance_names_exactly_the_installed_untested_release(
        accepted: str, installed: str | None, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        accept_untested(accepted, installed)
    assert info.value.field == "accept_untested_engine" and message in str(info.value)


def test_an_accepted_release_says_so_loudly() -> None:
    for accepted in ("0.5.24", "0.5.24+cu129"):
        warning = accept_untested(accepted, "0.5.24+cu129")
        assert warning.startswith("UNTESTED ENGINE: SGLang 0.5.24+cu129")
        assert f"--accept-untested-engine {accepted}" in warning


def test_the_running_releases_fingerprint_is_accepted_unless_refused_or_unreadable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_probe, "installed_idle_fingerprint", lambda: "ab" * 8)
    fingerprints, said = untested_fingerprints()
    assert fingerprints == ("ab" * 8,) and said.startswith("UNTESTED ENGINE") and "ab" * 8 in said
    monkeypatch.setattr(sglang_probe, "installed_idle_fingerprint", lambda: FINGERPRINT_0_5_21)
    fingerprints, said = untested_fingerprints()
    assert fingerprints == () and "one quiesce refuses" in said
    monkeypatch.undo()
    fingerprints, said = untested_fingerprints()  # no SGLang here: it cannot be read
    assert fingerprints == () and "cannot be fingerprinted (ModuleNotFoundError" in said
