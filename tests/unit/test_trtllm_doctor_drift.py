"""``quiesce doctor trtllm`` against drift that names alone do not show (issue 19 item 6).

FAKES: fixture source trees (tests/unit/test_trtllm_doctor.py's, written for the tests
from the research notes and the public source, not TensorRT-LLM's code), each changed
the way a drift would change it: a method turned into a property, an attribute into a
method, a shadow attribute of the right name while the live one moved, a renamed
preferred name beside a stale fallback, an iteration counter nobody bumps, a request
queue that is no stdlib queue, control lists that moved, and files missing from a
partial install. Every test here failed on the doctor before it checked kinds and
liveness. The real package is checked by
tests/gpu/test_trtllm.py::test_drift_check_passes_on_the_installed_package.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from quiesce.adapters.trtllm import doctor
from quiesce.ops.cli import main
from tests.unit.test_trtllm_doctor import (
    ATM,
    PY_EXECUTOR,
    REQUEST_QUEUE,
    statuses,
    write_tree,
)


def tree(tmp_path: Path, layout: str = "transfer-manager-module") -> Path:
    return write_tree(tmp_path, layout) / "tensorrt_llm"


def edit(root: Path, relative: str, old: str, new: str) -> None:
    path = root / relative
    text = path.read_text()
    assert old in text, f"{old!r} not in {relative}"
    path.write_text(text.replace(old, new))


def drift_in(report: doctor.DriftReport, key: str) -> tuple[str, str]:
    """(status, note) of ``key``, asserting that the whole report is drift."""
    assert not report.ok, report.format()  # the doctor before this check said OK
    assert report.status == "drift" and report.exit_code == 1, report.format()
    result = next(r for r in report.results if r.requirement.key == key)
    return result.status, result.note


def test_a_method_turned_into_a_property_is_drift(tmp_path: Path) -> None:
    """The probe calls ``get_request_queue_size()``: as a property its call raises."""
    root = tree(tmp_path)
    edit(root, REQUEST_QUEUE, "    def get_request_queue_size(self):",
         "    @property\n    def get_request_queue_size(self):")
    status, note = drift_in(doctor.check(root), "request_queue")
    assert status == "wrong-kind" and "property" in note and "as a method" in note


def test_requests_in_transfer_as_a_property_is_drift(tmp_path: Path) -> None:
    root = tree(tmp_path)
    edit(root, ATM, "    def requests_in_transfer(self):",
         "    @functools.cached_property\n    def requests_in_transfer(self):")
    assert drift_in(doctor.check(root), "ctx_in_transfer")[0] == "wrong-kind"


def test_an_attribute_turned_into_a_method_is_drift(tmp_path: Path) -> None:
    root = tree(tmp_path)
    edit(root, PY_EXECUTOR, "self.active_requests: list = []", "self.dist2 = None")
    (root / PY_EXECUTOR).write_text((root / PY_EXECUTOR).read_text().replace(
        "self.active_requests,", "self.dist2,") + "    def active_requests(self):\n"
        "        return []\n")
    status, note = drift_in(doctor.check(root), "active_requests")
    assert status == "wrong-kind" and "reads it as an attribute" in note


def test_a_shadow_attribute_while_the_live_one_moved_is_drift(tmp_path: Path) -> None:
    """``PyExecutor.waiting_queue`` still assigned, never read: the loop moved to the
    request queue's own (``get_waiting_queue_size``). The probe would read the shadow."""
    root = tree(tmp_path, "ctx-list")
    assert statuses(doctor.check(root))["waiting_queue"][0] == "alternative"
    edit(root, PY_EXECUTOR, "        self.kv_connector_manager = None\n",
         "        self.kv_connector_manager = None\n        self.waiting_queue = deque()\n")
    status, note = drift_in(doctor.check(root), "waiting_queue")
    assert status == "stale" and "PyExecutor.waiting_queue" in note and "never reads" in note


def test_a_renamed_preferred_name_beside_a_stale_fallback_is_drift(tmp_path: Path) -> None:
    """``async_transfer_manager`` renamed; ``ctx_in_transmission_requests`` left assigned
    and unused: the probe would silently fall back to it and count zero for ever."""
    root = tree(tmp_path)
    edit(root, PY_EXECUTOR, "self.async_transfer_manager = AsyncTransferManager(None)",
         "self.transfer_manager = AsyncTransferManager(None)\n"
         "        self.ctx_in_transmission_requests = []")
    edit(root, PY_EXECUTOR, "self.async_transfer_manager,", "self.transfer_manager,")
    status, note = drift_in(doctor.check(root), "ctx_in_transfer")
    assert status == "stale" and "ctx_in_transmission_requests" in note


def test_control_lists_that_moved_are_drift(tmp_path: Path) -> None:
    """The build enqueues control sentinels but the parked-request list was renamed."""
    root = tree(tmp_path)
    edit(root, PY_EXECUTOR, "self.request_accumulated: list = []",
         "self.parked_requests: list = []")
    edit(root, PY_EXECUTOR, "self.request_accumulated,", "self.parked_requests,")
    assert drift_in(doctor.check(root), "control_requests")[0] == "missing"


def test_control_lists_never_read_are_drift(tmp_path: Path) -> None:
    root = tree(tmp_path)
    edit(root, PY_EXECUTOR, "self.control_requests, self.request_accumulated,", "")
    assert drift_in(doctor.check(root), "control_requests")[0] == "stale"


@pytest.mark.parametrize("change,key,status", [
    (("    def _executor_loop(self):\n        self.iter_counter += 1", ""),
     "iteration_counter", "stale"),
    (("iter_counter", "iteration"), "iteration_counter", "missing"),
    (("self.is_shutdown = False", "self.stopped = False"), "is_shutdown", "missing"),
], ids=["counter-not-bumped", "counter-renamed", "is-shutdown-renamed"])
def test_the_confirmation_and_shutdown_names_are_checked(tmp_path: Path,
                                                         change: tuple[str, str], key: str,
                                                         status: str) -> None:
    """Optional (the probe stays on the safe side without them) but reported."""
    root = tree(tmp_path)
    assert statuses(doctor.check(root))[key][0] == "found"
    edit(root, PY_EXECUTOR, *change)
    report = doctor.check(root)
    assert report.ok and statuses(report)[key][0] == status
    assert key in report.summary()


def test_a_request_queue_that_is_no_stdlib_queue_is_reported(tmp_path: Path) -> None:
    """The parked-loop detection reads ``request_queue.not_empty._waiters``."""
    root = tree(tmp_path)
    assert statuses(doctor.check(root))["parked_loop"][0] == "found"
    edit(root, REQUEST_QUEUE, "self.request_queue = queue.Queue()",
         "self.request_queue = RingBuffer()")
    report = doctor.check(root)
    assert report.ok and statuses(report)["parked_loop"][0] == "stale"


def test_the_connector_flag_of_the_older_layout_is_required(tmp_path: Path) -> None:
    root = tree(tmp_path, "ctx-list")
    edit(root, PY_EXECUTOR, "self.kv_connector_manager = None", "self.kv_connector = None")
    edit(root, PY_EXECUTOR, "self.kv_connector_manager,", "self.kv_connector,")
    assert drift_in(doctor.check(root), "kv_connector")[0] == "missing"


# -- an incomplete install is told apart from drift ---------------------------------------

def test_a_missing_file_is_an_incomplete_install(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    root = tree(tmp_path)
    (root / REQUEST_QUEUE).unlink()
    report = doctor.check(root)
    assert "INCOMPLETE INSTALL" in report.summary(), report.summary()  # was: DRIFT
    assert report.status == "incomplete" and report.exit_code == doctor.EXIT_INCOMPLETE
    assert not report.ok
    assert statuses(report)["request_queue"][0] == "incomplete"
    assert main(["doctor", "trtllm", "--source", str(tmp_path)]) == doctor.EXIT_INCOMPLETE
    assert "incomplete install" in capsys.readouterr().out


def test_the_file_list_tells_a_partial_install_from_a_moved_file(tmp_path: Path) -> None:
    root = tree(tmp_path)
    (root / REQUEST_QUEUE).unlink()
    listed = doctor.check(root, manifest={REQUEST_QUEUE, PY_EXECUTOR})
    assert listed.status == "incomplete" and "file list" in listed.summary()
    moved = doctor.check(root, manifest={PY_EXECUTOR})  # not shipped: moved upstream
    assert moved.status == "drift" and statuses(moved)["request_queue"][0] == "missing"
