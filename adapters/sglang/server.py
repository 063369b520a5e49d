"""SGLang's own HTTP server (``python -m sglang.launch_server``), as quiesce's face reaches it
(checked on 0.5.23; quiesce.serve.sglang_serve).

Runs in: the server's main process.

- :func:`http_app`: the server's app, ``sglang.srt.entrypoints.http_server.app`` (a
  module-level ``FastAPI``, built at import and served later: middleware added before the
  serve is part of it). Imports SGLang's HTTP server (seconds).
- :func:`tokenizer_manager`: the server's ``TokenizerManager``
  (``http_server.get_global_state()``), or None before the server set it (it does before
  it serves).
- :class:`ServerEngine`: the engine as :class:`.control.SglangEngineControl` needs it,
  with the shutdown of ``Engine.shutdown()``: SGLang's subprocess watchdog stopped first
  (so that the children leaving is not taken for a crash, which would SIGQUIT the whole
  tree, this process included), then every child SIGKILLed and reaped (up to 60 s).
  SGLang's own server shutdown sends ``ShutdownReq`` to the schedulers first; this one
  runs only after the drain proved them idle, or after ``abort_all``.
"""

from __future__ import annotations

import os
from typing import Any


def http_app() -> Any:
    """SGLang's HTTP app (module docstring)."""
    from sglang.srt.entrypoints.http_server import app  # noqa: PLC0415 (optional engine)

    return app


def tokenizer_manager() -> Any:
    """The server's ``TokenizerManager``, or None (module docstring)."""
    from sglang.srt.entrypoints.http_server import (  # noqa: PLC0415 (optional engine)
        get_global_state,
    )

    return getattr(get_global_state(), "tokenizer_manager", None)


class ServerEngine:
    """The engine of SGLang's own HTTP server (module docstring). ``shutdown`` blocks."""

    def __init__(self, tokenizer_manager: Any) -> None:
        self.tokenizer_manager = tokenizer_manager

    def shutdown(self) -> None:
        from sglang.srt.utils import kill_process_tree  # noqa: PLC0415 (optional engine)

        watchdog = getattr(self.tokenizer_manager, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        kill_process_tree(os.getpid(), include_parent=False, wait_timeout=60)
