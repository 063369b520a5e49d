"""The GPU suites and their CI cannot rot unnoticed on a machine without a GPU.

- every ``tests/gpu/test_*.py`` (found at collection time: each engine adds its own) is
  collected without errors in a fresh pytest process, and every test in it is skipped
  here with a reason that is printed (``-rs``);
- every ``ci/gpu/*.sh`` passes ``bash -n``; ``ci/gpu/common.sh``'s helpers behave as its
  interface says (with a FAKE ``nvidia-smi`` and a FAKE ``python`` where a real one would
  need a GPU or take a minute);
- ``ci/gpu/summarize.py`` counts a sample JUnit XML correctly;
- the workflow ``.github/workflows/gpu.yml`` parses and runs each engine's script on H200
  runners, uploading the results.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.gpu.conftest import gpu_reason

ROOT = Path(__file__).resolve().parents[2]
GPU_MODULES = sorted((ROOT / "tests" / "gpu").glob("test_*.py"))
SCRIPTS = sorted((ROOT / "ci" / "gpu").glob("*.sh"))
SUMMARIZE = ROOT / "ci" / "gpu" / "summarize.py"
BASH = shutil.which("bash")


def test_there_are_gpu_suites_and_scripts_to_check() -> None:
    assert {p.name for p in GPU_MODULES} >= {"test_vllm.py", "test_nvml.py"}
    assert {p.name for p in SCRIPTS} >= {"common.sh", "all.sh", "vllm.sh"}


# -- the GPU suites collect and skip with a reason --------------------------------------


def test_the_gpu_skip_touches_only_the_gpu_suites() -> None:
    """A conftest's collection hook sees every item of the session: run together with a
    CPU test, the GPU conftest must leave that test alone."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
         "tests/unit/test_drain_cost.py", "tests/gpu/test_nvml.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"test_drain_cost\.py::\S+ PASSED", proc.stdout), proc.stdout


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[ET.Element, str]:
    """One pytest run over every GPU module: its JUnit XML root and its terminal output."""
    reason = gpu_reason()
    if reason is None:
        pytest.skip("a GPU answers here: the GPU suites would run for real (use ci/gpu/)")
    xml = tmp_path_factory.mktemp("gpu-suites") / "gpu.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider",
         "--continue-on-collection-errors", f"--junitxml={xml}",
         *(str(p.relative_to(ROOT)) for p in GPU_MODULES)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    output = proc.stdout + proc.stderr
    assert xml.is_file(), f"pytest wrote no JUnit XML (exit {proc.returncode}):\n{output}"
    return ET.parse(xml).getroot(), output


@pytest.mark.parametrize("module", GPU_MODULES, ids=lambda p: p.name)
def test_gpu_module_collects_and_every_test_skips_with_a_reason(
        module: Path, gpu_run: tuple[ET.Element, str]) -> None:
    root, output = gpu_run
    dotted = ".".join(module.relative_to(ROOT).with_suffix("").parts)
    cases = [c for c in root.iter("testcase")
             if (c.get("classname") or "") == dotted
             or (c.get("classname") or "").startswith(dotted + ".")
             or (not c.get("classname") and c.get("name") == dotted)]
    assert cases, f"{module.name}: nothing collected:\n{output[-3000:]}"
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        for bad in ("error", "failure"):
            element = case.find(bad)
            assert element is None, (f"{name}: {bad}: {element.get('message')}\n"
                                     f"{(element.text or '')[-2000:]}")
        skipped = case.find("skipped")
        assert skipped is not None, f"{name} ran instead of skipping on a machine without a GPU"
        assert (skipped.get("message") or "").strip(), f"{name} skipped without a reason"
    relative = str(module.relative_to(ROOT))
    assert any(line.startswith("SKIPPED") and relative in line
               for line in output.splitlines()), f"-rs printed no reason for {relative}"


# -- the scripts -------------------------------------------------------------------------


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script: Path) -> None:
    proc = subprocess.run([str(BASH), "-n", str(script)], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr


def run_bash(code: str, tmp_path: Path, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    """Run ``code`` after sourcing ci/gpu/common.sh, results in ``tmp_path/results``."""
    assert BASH is not None
    return subprocess.run(
        [BASH, "-c", f"source ci/gpu/common.sh\n{code}"], cwd=ROOT, capture_output=True,
        text=True, timeout=300, check=False,
        env={**os.environ, "QUIESCE_GPU_RESULTS": str(tmp_path / "results"), **(env or {})})


def fake_tool(directory: Path, name: str, body: str) -> Path:
    """A FAKE executable ``name`` in ``directory`` running the shell ``body``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_common_sets_an_absolute_results_dir_and_strict_mode(tmp_path: Path) -> None:
    proc = run_bash('echo "dir=$RESULTS_DIR"; echo "opts=$-"; set -o | grep pipefail', tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"dir={tmp_path / 'results'}" in proc.stdout
    assert (tmp_path / "results").is_dir()
    opts = proc.stdout.split("opts=")[1].split()[0]
    assert "e" in opts and "u" in opts
    assert "pipefail" in proc.stdout and "on" in proc.stdout.split("pipefail")[1]


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
@pytest.mark.parametrize("smi,code,expected", [
    (None, 2, "nvidia-smi is not installed"),
    ("echo 'No devices were found'; exit 6", 2, "no GPU: nvidia-smi -L answered"),
    ("echo 'GPU 0: NVIDIA H200 (UUID: GPU-1)'", 0, "GPU 0: NVIDIA H200"),
], ids=["absent", "no-device", "h200"])
def test_require_gpu(tmp_path: Path, smi: str | None, code: int, expected: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if smi is not None:
        fake_tool(bin_dir, "nvidia-smi", smi)
    # Only the fake (or no) nvidia-smi: a PATH of the tools common.sh needs, via links.
    for tool in ("mkdir", "dirname"):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    proc = run_bash("require_gpu; echo after", tmp_path, env={"PATH": str(bin_dir)})
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert expected in proc.stdout + proc.stderr
    assert ("after" in proc.stdout) is (code == 0)


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_make_venv_creates_only_when_missing(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    python = fake_tool(tmp_path / "bin", "fakepython",
                       f'echo "$@" >> {log}; mkdir -p "$3/bin"; touch "$3/bin/python"; '
                       f'chmod +x "$3/bin/python"')
    venv = tmp_path / "venv"
    proc = run_bash(f"make_venv {venv} {python}; make_venv {venv} {python}", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().splitlines() == [f"-m venv {venv}"]


SAMPLE_TESTS = '''
import time
import pytest

def test_passes():
    assert True

def test_fails():
    assert 1 == 2

@pytest.mark.skip(reason="needs an H200")
def test_skips():
    pass

@pytest.fixture
def broken():
    raise RuntimeError("setup failed")

def test_errors(broken):
    pass
'''


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_run_suite_writes_junit_and_summary_and_returns_pytests_code(tmp_path: Path) -> None:
    sample = tmp_path / "suite" / "test_sample.py"
    sample.parent.mkdir()
    sample.write_text(SAMPLE_TESTS)
    proc = run_bash(f'rc=0; run_suite sample 120 {sys.executable} -p no:cacheprovider '
                    f'--rootdir {sample.parent} {sample} || rc=$?; echo "rc=$rc"', tmp_path)
    assert "rc=1" in proc.stdout, proc.stdout + proc.stderr
    results = tmp_path / "results"
    assert (results / "sample.xml").is_file()
    summary = json.loads((results / "sample.json").read_text())
    assert summary["engine"] == "sample"
    assert (summary["passed"], summary["failed"], summary["skipped"], summary["errors"]) \
        == (1, 1, 1, 1)
    assert summary["exit_code"] == 1 and summary["timed_out"] is False
    assert summary["skip_reasons"] == {"needs an H200": 1}
    assert summary["duration_s"] >= 0


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_run_suite_reports_a_timeout(tmp_path: Path) -> None:
    sample = tmp_path / "suite" / "test_hang.py"
    sample.parent.mkdir()
    sample.write_text("import time\n\ndef test_hangs():\n    time.sleep(120)\n")
    proc = run_bash(f'rc=0; run_suite hang 2 {sys.executable} -p no:cacheprovider '
                    f'--rootdir {sample.parent} {sample} || rc=$?; echo "rc=$rc"', tmp_path)
    assert "rc=124" in proc.stdout, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "results" / "hang.json").read_text())
    assert summary["timed_out"] is True and summary["exit_code"] == 124
    assert summary["passed"] == 0



@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_all_runs_every_present_engine_continues_after_a_failure_and_fails(
        tmp_path: Path) -> None:
    """all.sh over FAKE engine scripts (one passing suite, one failing script, one absent)
    and a FAKE nvidia-smi: both present scripts run, the table shows the suite, exit 1."""
    assert BASH is not None
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_ok.py").write_text("def test_ok():\n    assert True\n")
    scripts = tmp_path / "scripts"
    fake_tool(scripts, "alpha.sh", f'set -e\nsource ci/gpu/common.sh\nrun_suite alpha 120 '
              f'{sys.executable} -p no:cacheprovider --rootdir {suite} {suite / "test_ok.py"}')
    fake_tool(scripts, "beta.sh", 'echo "beta: engine failed to start" >&2\nexit 3')
    fake_tool(scripts, "delta.sh", 'echo "delta: ENGINE ABSENT: no delta here" >&2\n'
                                   'exit "$ENGINE_ABSENT"')
    bin_dir = tmp_path / "bin"
    fake_tool(bin_dir, "nvidia-smi", "echo 'GPU 0: NVIDIA H200 (UUID: GPU-1)'")
    results = tmp_path / "results"
    results.mkdir()
    (results / "stale.json").write_text(json.dumps({"engine": "stale", "exit_code": 0}))
    proc = subprocess.run(
        [BASH, str(ROOT / "ci" / "gpu" / "all.sh")], cwd=tmp_path, capture_output=True,
        text=True, timeout=300, check=False,
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
             "QUIESCE_GPU_RESULTS": str(results), "QUIESCE_GPU_SCRIPTS_DIR": str(scripts),
             "QUIESCE_GPU_ENGINES": "alpha beta gamma delta"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert json.loads((results / "alpha.json").read_text())["passed"] == 1
    assert not (results / "stale.json").exists()
    table_rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("alpha")]
    assert table_rows and table_rows[0][1:4] == ["ok", "0", "1"]
    assert "engines run: alpha beta; failed: beta; no script: gamma" in proc.stdout
    assert "skipped: delta (delta: ENGINE ABSENT: no delta here)" in proc.stdout
    assert "beta: engine failed to start" in (results / "beta.log").read_text()


# -- summarize.py --------------------------------------------------------------------------


SAMPLE_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="1" failures="1" skipped="3"
 tests="7" time="12.5">
 <testcase classname="tests.gpu.test_vllm" name="test_idle" time="1.0" />
 <testcase classname="tests.gpu.test_vllm" name="test_busy" time="2.0" />
 <testcase classname="tests.gpu.test_vllm" name="test_drain" time="3.0">
  <failure message="assert 1 == 0">trace</failure></testcase>
 <testcase classname="tests.gpu.test_vllm" name="test_pair" time="0.1">
  <error message="failed on setup with RuntimeError">trace</error></testcase>
 <testcase classname="tests.gpu.test_nvml" name="test_a" time="0">
  <skipped type="pytest.skip" message="no GPU: nvidia-smi is not installed">x</skipped>
 </testcase>
 <testcase classname="tests.gpu.test_nvml" name="test_b" time="0">
  <skipped type="pytest.skip" message="no GPU: nvidia-smi is not installed">x</skipped>
 </testcase>
 <testcase classname="tests.gpu.test_vllm" name="test_known_bug" time="0">
  <skipped type="pytest.xfail" message="">x</skipped></testcase>
 <testcase time="0.000" />
</testsuite></testsuites>
"""


def summarize(tmp_path: Path, junit: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, str(SUMMARIZE), "suite", "--name", "vllm", "--junit",
                    str(junit), "--exit-code", "1", "--duration", "12.5", *extra, "--out",
                    str(out)], check=True, capture_output=True, text=True)
    summary: dict[str, Any] = json.loads(out.read_text())
    return summary


def test_summarize_counts_a_sample_junit(tmp_path: Path) -> None:
    junit = tmp_path / "vllm.xml"
    junit.write_text(SAMPLE_JUNIT)
    summary = summarize(tmp_path, junit)
    assert summary["engine"] == "vllm"
    assert {k: summary[k] for k in ("passed", "failed", "skipped", "errors", "interrupted",
                                    "tests")} == {"passed": 2, "failed": 1, "skipped": 3,
                                                  "errors": 1, "interrupted": 1, "tests": 7}
    assert summary["skip_reasons"] == {"no GPU: nvidia-smi is not installed": 2,
                                       "(no reason given)": 1}
    assert summary["not_passed"] == ["failed: tests.gpu.test_vllm::test_drain",
                                     "errors: tests.gpu.test_vllm::test_pair"]
    assert summary["duration_s"] == 12.5 and summary["exit_code"] == 1
    assert summary["timed_out"] is False and summary["junit_found"] is True


def test_summarize_without_junit_says_so(tmp_path: Path) -> None:
    summary = summarize(tmp_path, tmp_path / "missing.xml", "--timed-out")
    assert summary["junit_found"] is False and "missing.xml" in summary["junit_error"]
    assert summary["timed_out"] is True
    assert (summary["passed"], summary["failed"], summary["tests"]) == (0, 0, 0)


def test_summarize_table(tmp_path: Path) -> None:
    junit = tmp_path / "vllm.xml"
    junit.write_text(SAMPLE_JUNIT)
    summarize(tmp_path, junit)
    ok = tmp_path / "sglang.json"
    ok.write_text(json.dumps({"engine": "sglang", "exit_code": 0, "passed": 9, "failed": 0,
                              "skipped": 0, "errors": 0, "duration_s": 61.2,
                              "timed_out": False}))
    other = tmp_path / "trtllm-doctor.json"
    other.write_text(json.dumps({"verdict": "ok"}))
    proc = subprocess.run([sys.executable, str(SUMMARIZE), "table", str(tmp_path / "out.json"),
                           str(ok), str(other)], check=True, capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[2:-1]}
    assert set(rows) == {"vllm", "sglang"}
    assert rows["vllm"][1:7] == ["FAILED", "1", "2", "1", "3", "1"]
    assert rows["sglang"][1:4] == ["ok", "0", "9"]
    assert lines[-1] == "(not suite summaries, not shown: trtllm-doctor.json)"


# -- the workflow -------------------------------------------------------------------------


def test_gpu_workflow_runs_every_engine_script_on_h200_runners() -> None:
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "gpu.yml").read_text())
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads `on` as True
    assert "workflow_dispatch" in triggers and "pull_request" not in triggers
    engines: dict[str, dict[str, Any]] = {}
    for job in workflow["jobs"].values():
        labels = job["runs-on"]
        assert {"self-hosted", "gpu", "h200"} <= set(labels), labels
        steps = job["steps"]
        runs = " ".join(s.get("run", "") for s in steps)
        names = job.get("strategy", {}).get("matrix", {}).get("engine") or ["trtllm"]
        for engine in names:
            script = "ci/gpu/${{ matrix.engine }}.sh" if "matrix" in job.get("strategy", {}) \
                else f"ci/gpu/{engine}.sh"
            assert f"bash {script}" in runs
            engines[engine] = job
        uploads = [s for s in steps if str(s.get("uses", "")).startswith(
            "actions/upload-artifact@")]
        assert uploads and uploads[0]["with"]["path"] == "ci/gpu/results/"
        assert uploads[0].get("if") == "always()"
    assert set(engines) == {"vllm", "sglang", "trtllm"}
    image = engines["trtllm"]["container"]["image"]
    assert image.startswith("nvcr.io/nvidia/tensorrt-llm/release:") and not image.endswith(
        ":latest")
    assert "--gpus all" in engines["trtllm"]["container"]["options"]


def test_results_are_ignored_by_git() -> None:
    assert "ci/gpu/results/" in (ROOT / ".gitignore").read_text().splitlines()



@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_all_counts_an_absent_engine_as_skipped_not_failed(tmp_path: Path) -> None:
    """FAKE scripts: one suite passes, one engine is absent on this host; exit 0."""
    assert BASH is not None
    scripts = tmp_path / "scripts"
    fake_tool(scripts, "alpha.sh", "echo alpha ran")
    fake_tool(scripts, "trtllm.sh", 'echo "trtllm.sh: ENGINE ABSENT: no tensorrt_llm" >&2\n'
                                    'exit "$ENGINE_ABSENT"')
    bin_dir = tmp_path / "bin"
    fake_tool(bin_dir, "nvidia-smi", "echo 'GPU 0: NVIDIA H200 (UUID: GPU-1)'")
    proc = subprocess.run(
        [BASH, str(ROOT / "ci" / "gpu" / "all.sh")], cwd=tmp_path, capture_output=True,
        text=True, timeout=300, check=False,
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
             "QUIESCE_GPU_RESULTS": str(tmp_path / "results"),
             "QUIESCE_GPU_SCRIPTS_DIR": str(scripts), "QUIESCE_GPU_ENGINES": "alpha trtllm"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "engines run: alpha; failed: none" in proc.stdout
    assert "skipped: trtllm (trtllm.sh: ENGINE ABSENT: no tensorrt_llm)" in proc.stdout


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_trtllm_outside_its_container_exits_engine_absent(tmp_path: Path) -> None:
    """The real ci/gpu/trtllm.sh with a FAKE nvidia-smi and this Python (no tensorrt_llm)."""
    assert BASH is not None
    bin_dir = tmp_path / "bin"
    fake_tool(bin_dir, "nvidia-smi", "echo 'GPU 0: NVIDIA H200 (UUID: GPU-1)'")
    proc = subprocess.run(
        [BASH, str(ROOT / "ci" / "gpu" / "trtllm.sh")], cwd=ROOT, capture_output=True,
        text=True, timeout=120, check=False,
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
             "QUIESCE_GPU_RESULTS": str(tmp_path / "results"), "PYTHON": sys.executable})
    code = run_bash('echo "$ENGINE_ABSENT"', tmp_path).stdout.strip()
    assert code not in {"0", "1", "2", "3", "4", "5", "124", "137"}
    assert proc.returncode == int(code), proc.stdout + proc.stderr
    assert "ENGINE ABSENT" in proc.stderr
