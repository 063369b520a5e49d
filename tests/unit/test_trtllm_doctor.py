"""The TensorRT-LLM drift checker (``quiesce doctor trtllm``) against fixture sources.

These are FAKES: small source trees written for these tests from the facts in the
project's research notes (which class defines which name, per layout), generated into a
temporary directory. They are not TensorRT-LLM's code. The checker against the real
installed package is covered by ``test_drift_check_passes_on_the_installed_package`` in
tests/gpu/test_trtllm.py (run by ci/gpu/trtllm.sh inside NVIDIA's release container).
"""

from __future__ import annotations

import ast
import importlib
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from quiesce.adapters.trtllm import doctor
from quiesce.adapters.trtllm.layouts import CTX_IN_TRANSMISSION, TRANSFER_MANAGER
from quiesce.ops.cli import main


def cls(name: str, attrs: str = "", methods: tuple[str, ...] = (), body: str = "",
        live: bool = True) -> str:
    """A fixture class: ``attrs`` are lines of ``__init__``; ``methods`` empty defs.
    ``live``: a ``_loop`` method reads every attribute ``__init__`` assigns, as the
    executor loop reads what it uses."""
    lines = [f"class {name}:", f"    kind = {name!r}"]
    if attrs:
        lines.append("    def __init__(self):")
        lines.extend(f"        {line}" for line in attrs.strip().splitlines())
        names = re.findall(r"self\.(\w+)", attrs)
        if live and names:
            lines.append("    def _loop(self):")
            lines.append(f"        return ({', '.join(f'self.{n}' for n in names)},)")
    lines.extend(f"    def {m}(self):\n        return None" for m in methods)
    if body:
        lines.append(body)
    return "\n".join(lines) + "\n"


PY_EXECUTOR = "_torch/pyexecutor/py_executor.py"
REQUEST_QUEUE = "_torch/pyexecutor/executor_request_queue.py"
ATM = "_torch/disaggregation/orchestration/transfer_manager.py"

COMMON = {
    "__init__.py": "raise RuntimeError('the drift checker must never import tensorrt_llm')\n",
    "executor/base_worker.py": cls("BaseWorker", "self.engine = None\nself._results = {}"),
    "executor/worker.py": cls("GenerationExecutorWorker", "self.rank = 0"),
    "executor/ray/executor.py": cls("RayExecutor", "self.workers = []"),
    "executor/executor.py": cls("GenerationExecutor", methods=("abort_request",)),
    "executor/proxy.py": cls("GenerationExecutorProxy", "self._results: dict = {}"),
    "llmapi/llm.py": cls("BaseLLM", methods=("get_stats_async",))
    + cls("_TorchLLM", methods=("_collective_rpc",)),
    "_torch/pyexecutor/llm_request.py": cls("LlmRequest", "self.is_attention_dp_dummy = False"),
    "executor/ray/gpu_worker.py": cls("RayWorkerWrapper",
                                      methods=("_inject_worker_extension",)),
}
BUMP = "    def _executor_loop(self):\n        self.iter_counter += 1"
NEW_EXECUTOR = cls("PyExecutor", """
self.active_requests: list = []
self.waiting_queue = create_waiting_queue()
self.executor_request_queue, self.dist = make_queue(), None
self.async_transfer_manager = AsyncTransferManager(None)
self.control_requests: list = []
self.request_accumulated: list = []
self.iter_counter = 0
self.is_shutdown = False
""", methods=("control_action",), body=BUMP)
NEW_QUEUE = cls("ExecutorRequestQueue", "self.request_queue = queue.Queue()\nself.active = True",
                methods=("get_request_queue_size", "enqueue_control_request"))
TRANSFER_MANAGER_CLASS = cls("AsyncTransferManager", "self._requests_in_transfer = {}",
                             methods=("requests_in_transfer", "has_any_inflight_requests"))


def old_executor(tracker: str, waiting: str = "") -> str:
    return cls("PyExecutor", f"""
self.active_requests = []
self.executor_request_queue = make_queue()
self.ctx_in_transmission_requests = {tracker}
self.kv_connector_manager = None
self.iter_counter = 0
self.is_shutdown = False
{waiting}
""", body=BUMP)


OLD_QUEUE = cls("ExecutorRequestQueue", "self.waiting_queue = deque()\nself.active = True\n"
                "self.request_queue = queue.Queue()",
                methods=("get_waiting_queue_size", "get_request_queue_size"))
MID_QUEUE = cls("ExecutorRequestQueue", """
self.request_queue = queue.Queue()
self.active = True
self.control_requests = []
self.request_accumulated = []
""", methods=("get_request_queue_size", "enqueue_control_request"))

LAYOUTS: dict[str, dict[str, str]] = {
    # 2026 main: the transfer manager in its own module
    "transfer-manager-module": {**COMMON, "version.py": "__version__ = '1.3.0.fixture'\n",
                                PY_EXECUTOR: NEW_EXECUTOR, REQUEST_QUEUE: NEW_QUEUE,
                                ATM: TRANSFER_MANAGER_CLASS},
    # early 2026: the transfer manager defined inside py_executor.py
    "transfer-manager-inline": {**COMMON, PY_EXECUTOR: TRANSFER_MANAGER_CLASS + NEW_EXECUTOR,
                                REQUEST_QUEUE: NEW_QUEUE},
    # late 2025: ctx_in_transmission_requests as a dict with a counter
    "ctx-dict": {**COMMON, PY_EXECUTOR: old_executor("dict()", "self.waiting_queue = []"),
                 REQUEST_QUEUE: MID_QUEUE},
    # 2025: a list, the waiting queue on ExecutorRequestQueue, the older Ray module
    "ctx-list": {**{k: v for k, v in COMMON.items() if "ray/" not in k},
                 "version.py": "__version__ = '1.0.0.fixture'\n",
                 "executor/ray_gpu_worker.py": COMMON["executor/ray/gpu_worker.py"],
                 "executor/ray_executor.py": COMMON["executor/ray/executor.py"],
                 PY_EXECUTOR: old_executor("[]"), REQUEST_QUEUE: OLD_QUEUE},
    # drift: the transfer tracker renamed, so no known layout holds
    "drifted": {**COMMON, PY_EXECUTOR: NEW_EXECUTOR.replace("async_transfer_manager",
                                                            "transfers_pending"),
                REQUEST_QUEUE: NEW_QUEUE, ATM: TRANSFER_MANAGER_CLASS},
}


def write_tree(base: Path, layout: str) -> Path:
    """Write the fixture as a checkout or unpacked wheel would hold it; returns ``base``."""
    for relative, text in LAYOUTS[layout].items():
        path = base / "tensorrt_llm" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return base


def required_missing(report: doctor.DriftReport) -> list[str]:
    return [r.requirement.key for r in report.missing if r.requirement.required]


def statuses(report: doctor.DriftReport) -> dict[str, tuple[str, str | None]]:
    return {r.requirement.key: (r.status, r.layout) for r in report.results}


@pytest.mark.parametrize("layout,ctx,waiting", [
    ("transfer-manager-module", ("found", TRANSFER_MANAGER), "found"),
    ("transfer-manager-inline", ("found", TRANSFER_MANAGER), "found"),
    ("ctx-dict", ("alternative", f"{CTX_IN_TRANSMISSION} (dict)"), "found"),
    ("ctx-list", ("alternative", f"{CTX_IN_TRANSMISSION} (list)"), "alternative"),
])
def test_every_known_layout_passes_and_is_named(tmp_path: Path, layout: str,
                                                ctx: tuple[str, str], waiting: str) -> None:
    report = doctor.check(doctor.package_dir(write_tree(tmp_path, layout)))
    found = statuses(report)
    assert report.ok, report.format()
    assert found["ctx_in_transfer"] == ctx
    assert found["waiting_queue"][0] == waiting
    assert all(status != "missing" for status, _ in found.values()), found
    assert "tensorrt_llm" not in sys.modules


def test_a_renamed_worker_class_is_drift(tmp_path: Path) -> None:
    # The probe picks the in-process layout by this class name.
    root = write_tree(tmp_path, "transfer-manager-module") / "tensorrt_llm"
    (root / "executor/worker.py").write_text(cls("SingleProcessWorker", "self.rank = 0"))
    report = doctor.check(root)
    assert not report.ok and report.status == "drift" and report.exit_code == 1
    assert required_missing(report) == ["in_process_worker"]


def test_drifted_layout_fails_naming_what_is_missing(tmp_path: Path) -> None:
    report = doctor.check(doctor.package_dir(write_tree(tmp_path, "drifted")))
    assert not report.ok
    # the renamed tracker also hides what tells a connector's saves (kv_connector)
    assert required_missing(report) == ["ctx_in_transfer", "kv_connector"]
    missing = report.missing[0]
    assert TRANSFER_MANAGER in missing.note and CTX_IN_TRANSMISSION in missing.note
    assert "UNKNOWN" in report.summary()


def test_optional_names_missing_still_pass_but_are_reported(tmp_path: Path) -> None:
    root = write_tree(tmp_path, "transfer-manager-module") / "tensorrt_llm"
    (root / "_torch/pyexecutor/llm_request.py").unlink()
    report = doctor.check(root)
    assert report.ok
    assert statuses(report)["attention_dp_dummy"] == ("incomplete", None)
    assert "optional missing: attention_dp_dummy (incomplete)" in report.summary()


def test_a_file_that_does_not_parse_counts_as_missing(tmp_path: Path) -> None:
    root = write_tree(tmp_path, "transfer-manager-module") / "tensorrt_llm"
    (root / PY_EXECUTOR).write_text("class PyExecutor(:\n")
    report = doctor.check(root)
    assert not report.ok
    assert "does not parse" in next(r.note for r in report.missing
                                    if r.requirement.key == "active_requests")


def test_a_file_with_nul_bytes_is_unparseable_not_a_crash(tmp_path: Path) -> None:
    """ast.parse raises ValueError, not SyntaxError, for NUL bytes on Python 3.11."""
    root = write_tree(tmp_path, "transfer-manager-module") / "tensorrt_llm"
    (root / PY_EXECUTOR).write_text("class PyExecutor:\n    x = 1\x00\n")
    (root / "version.py").write_text("__version__ = '1'\x00\n")
    report = doctor.check(root)
    assert not report.ok and report.version is None
    assert "does not parse" in next(r.note for r in report.missing
                                    if r.requirement.key == "active_requests")


def test_a_parser_that_raises_value_error_is_unparseable(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Python 3.11 releases whose ast.parse raises ValueError for NUL bytes (3.11.7 here
    raises SyntaxError): FAKE parser raising it, as those do."""
    root = write_tree(tmp_path, "transfer-manager-module") / "tensorrt_llm"
    (root / PY_EXECUTOR).write_text("class PyExecutor:\n    x = 1\x00\n")
    (root / "version.py").write_text("__version__ = '1'\x00\n")
    real = ast.parse

    def parse(source: Any, *args: Any, **kwargs: Any) -> Any:
        if "\x00" in str(source):
            raise ValueError("source code string cannot contain null bytes")
        return real(source, *args, **kwargs)

    monkeypatch.setattr(ast, "parse", parse)
    report = doctor.check(root)
    assert not report.ok and report.version is None
    assert "null bytes" in next(r.note for r in report.missing
                                if r.requirement.key == "active_requests")


def test_version_is_read_without_importing(tmp_path: Path) -> None:
    root = write_tree(tmp_path, "transfer-manager-module")
    assert doctor.check(doctor.package_dir(root)).version == "1.3.0.fixture"
    assert doctor.check(doctor.package_dir(write_tree(tmp_path / "b", "ctx-dict"))
                        ).version is None


def test_package_dir_accepts_a_checkout_or_the_package_itself(tmp_path: Path) -> None:
    write_tree(tmp_path, "ctx-list")
    assert doctor.package_dir(tmp_path) == tmp_path / "tensorrt_llm"
    assert doctor.package_dir(tmp_path / "tensorrt_llm") == tmp_path / "tensorrt_llm"


def test_nothing_to_check_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(doctor.SourceNotFound, match="does not exist"):
        doctor.package_dir(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    with pytest.raises(doctor.SourceNotFound, match="not a directory"):
        doctor.package_dir(tmp_path / "file")
    with pytest.raises(doctor.SourceNotFound, match="no TensorRT-LLM package"):
        doctor.package_dir(tmp_path)


def test_a_source_file_that_cannot_be_read_is_a_typed_error(tmp_path: Path) -> None:
    root = write_tree(tmp_path, "transfer-manager-module") / "tensorrt_llm"
    (root / PY_EXECUTOR).unlink()
    (root / PY_EXECUTOR).mkdir()  # reading it fails (IsADirectoryError), as root too
    with pytest.raises(doctor.SourceUnreadable, match=r"py_executor\.py"):
        doctor.check(root)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_sources_are_a_typed_error(tmp_path: Path) -> None:
    root = write_tree(tmp_path, "transfer-manager-module") / "tensorrt_llm"
    target = root / PY_EXECUTOR
    target.chmod(0)
    try:
        with pytest.raises(doctor.SourceUnreadable, match=r"py_executor\.py"):
            doctor.check(root)
    finally:
        target.chmod(0o644)
    root.chmod(0)
    try:
        with pytest.raises(doctor.SourceUnreadable):
            doctor.package_dir(root)
    finally:
        root.chmod(0o755)


def test_not_installed_here() -> None:
    # TensorRT-LLM cannot be installed on this machine (no wheel reachable, no CUDA).
    with pytest.raises(doctor.SourceNotFound, match="not installed"):
        doctor.check_installed()


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fixture package on sys.path whose ``__init__`` raises if anything imports it."""
    write_tree(tmp_path, "transfer-manager-module")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return tmp_path / "tensorrt_llm"


def test_installed_package_is_found_without_importing_it(installed: Path) -> None:
    report = doctor.check_installed()
    assert report.root == installed
    assert report.ok
    assert "tensorrt_llm" not in sys.modules


def test_startup_check_logs_and_never_raises(installed: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=doctor.log.name)
    report = doctor.startup_check()
    assert report is not None and report.ok
    assert "AsyncTransferManager" in caplog.text
    (installed / PY_EXECUTOR).write_text("class PyExecutor:\n    pass\n")
    report = doctor.startup_check()
    assert report is not None and not report.ok
    assert "DRIFT" in caplog.records[-1].getMessage()
    assert caplog.records[-1].levelno == logging.WARNING


def test_startup_check_without_the_package_returns_none(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    assert doctor.startup_check() is None
    assert "did not run" in caplog.text


# -- the command line ------------------------------------------------------------------

def test_cli_json_lists_each_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", "trtllm", "--source", str(write_tree(tmp_path, "ctx-list")),
                 "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ok"] is True
    by_key = {r["key"]: r for r in out["requirements"]}
    assert by_key["ctx_in_transfer"]["status"] == "alternative"
    assert by_key["active_requests"]["status"] == "found"
    assert by_key["active_requests"]["members"] == [
        {"name": "PyExecutor.active_requests", "file": PY_EXECUTOR, "found": True}]


def test_cli_drift_exits_1_with_a_table(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", "trtllm", "--source", str(write_tree(tmp_path, "drifted"))])
    out = capsys.readouterr().out
    assert code == 1
    assert "missing" in out and "ctx_in_transfer" in out and out.splitlines()[-1].startswith(
        "drift:")


def test_cli_without_sources_exits_6(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "trtllm", "--source", str(tmp_path / "absent")]) == 6
    assert "does not exist" in capsys.readouterr().err
    assert main(["doctor", "trtllm"]) == 6  # nothing installed here
    assert "not installed" in capsys.readouterr().err


def test_cli_needs_an_engine_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor"])
    assert exit_info.value.code == 2
