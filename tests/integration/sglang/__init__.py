"""Contract tests of the SGLang adapter (see conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

SKIP_REASON = ("needs the real sglang wheel: run `make test-sglang` "
               "(ci/setup_sglang_cpu.sh builds .venv-sglang)")


def wait_until_scheduled(status: Callable[[], Mapping[str, Any]], count: int,
                         timeout_s: float = 120.0) -> None:
    """Return once SGLang's scheduler itself holds ``count`` requests, running or waiting,
    as the worker's admin status (``status()``) reports the probe's view; raises after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        pending = status().get("pending_work") or {}
        held = sum(n for n in (pending.get("running"), pending.get("waiting"))
                   if isinstance(n, int))
        if held >= count:
            return
        assert time.monotonic() < deadline, f"never {count} requests in the scheduler at once"
        time.sleep(0.002)
