"""GPU suites: skipped, with the reason printed, where there is no GPU or no engine.

They run on an H200 machine through the scripts in ci/gpu/. Each module names the
engine it needs in ``REQUIRES``; this conftest checks the GPU once per session.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess

import pytest


def gpu_reason() -> str | None:
    """Why GPU tests cannot run here, or None when an NVIDIA GPU answers."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no GPU: nvidia-smi is not installed on this machine"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no GPU: nvidia-smi failed ({exc})"
    if out.returncode != 0 or "GPU" not in out.stdout:
        return f"no GPU: nvidia-smi -L answered {out.returncode}: {out.stderr.strip()[:200]}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = gpu_reason()
    for item in items:
        module = getattr(item, "module", None)
        needed = getattr(module, "REQUIRES", ())
        missing = [m for m in needed if importlib.util.find_spec(m) is None]
        why = reason or (f"engine not installed: {', '.join(missing)}" if missing else None)
        if why:
            item.add_marker(pytest.mark.skip(reason=why))
