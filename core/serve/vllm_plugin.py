"""quiesce's claim in ``vllm serve``'s API server process, made before the engine starts.

Registered as the ``quiesce_serve`` entry of ``vllm.general_plugins``: vLLM calls
:func:`register` in every process it starts, and in the API server process that is while
it builds its argument parser (``AsyncEngineArgs.add_cli_args``), before it parses the
command line, starts the engine or installs a signal handler. Only there, and only when
the command line names quiesce's middleware (``--middleware`` :data:`MIDDLEWARE`), does
it act; everywhere else it returns at once (cost: one ``sys.argv`` scan).

What it does: read quiesce's settings from ``$QUIESCE_VLLM_ARGS``
(:mod:`quiesce.serve.server_options`) and make the process's claim
(:func:`quiesce.serve.server_claim.make_claim`: the admin token and port, quiesce's logs on
stderr, signal ownership claimed *permitted*, so that vLLM acts on signals while it
starts, and the engine's processes inherit the claim). Any problem: one line on stderr
naming the setting, and ``vllm serve`` exits with code 2, before the engine.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Sequence

from quiesce.errors import ConfigError
from quiesce.serve.server_claim import EXIT_CONFIG, current_claim, make_claim
from quiesce.serve.server_options import VLLM_ARGS_ENV, parse_server_options
from quiesce.signal_guard import OWNER_ENV

MIDDLEWARE = "quiesce.serve.vllm_serve.QuiesceMiddleware"
"""What ``vllm serve --middleware`` is given (``app.add_middleware`` of this class)."""


def names_middleware(argv: Sequence[str]) -> bool:
    """Whether ``argv`` passes quiesce's middleware to ``--middleware``."""
    for index, arg in enumerate(argv):
        if arg == f"--middleware={MIDDLEWARE}":
            return True
        if arg == "--middleware" and index + 1 < len(argv) and argv[index + 1] == MIDDLEWARE:
            return True
    return False


def register() -> None:
    """Entry point of ``vllm.general_plugins`` (module docstring). Idempotent; a no-op in
    the engine's processes and in any process whose command line does not name
    :data:`MIDDLEWARE`; exits the process with code 2 on a bad setting."""
    if current_claim() is not None or multiprocessing.parent_process() is not None:
        return
    if not names_middleware(sys.argv) or OWNER_ENV in os.environ:
        return  # not vllm serve with quiesce, or started by another quiesce worker
    try:
        make_claim(parse_server_options(VLLM_ARGS_ENV, name="vllm-serve"), "vllm serve")
    except (ConfigError, OSError) as exc:
        print(f"vllm serve: quiesce refuses to start: {exc} (settings: ${VLLM_ARGS_ENV})",
              file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG) from None
