"""The reference worker as a Dynamo backend (``quiesce serve --dynamo``), for the tests
and the benchmark: its simulated engine behind Dynamo's real frontend, discovered
through Dynamo's ``file`` backend on loopback (:func:`~.processes.dynamo_env`)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.integration.dynamo.processes import dynamo_env, free_port
from tests.integration.worker_process import Worker, running


@contextlib.contextmanager
def reference_worker(store: Path, model: Path, *, shutdown: str = "quiesce",
                     budget_s: float = 60.0, decode_step_s: float = 0.02,
                     options: Sequence[str] = (), env: dict[str, str] | None = None
                     ) -> Iterator[Worker]:
    """``quiesce serve --dynamo --model MODEL`` with ``--dynamo-shutdown SHUTDOWN``,
    ready once it printed its ready line (``admin_port`` set); killed with its group on
    the way out if still running. ``env``: instead of :func:`dynamo_env` (e.g. with
    :data:`GRACE_ENV`). The frontend lists the model as ``str(model)``."""
    port = free_port()
    command = [sys.executable, "-m", "quiesce", "serve", "--dynamo", "--model", str(model),
               "--dynamo-discovery-backend", "file", "--dynamo-shutdown", shutdown,
               "--admin-port", str(port), "--budget", str(budget_s),
               "--decode-step", str(decode_step_s), *options]
    with running(command, env or dynamo_env(store), '"event": "ready"', timeout_s=60,
                 name=f"quiesce serve --dynamo ({shutdown})") as worker:
        worker.admin_port = port
        yield worker
