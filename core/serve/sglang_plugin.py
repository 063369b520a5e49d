"""quiesce's claim in SGLang's own server process (``python -m sglang.launch_server``),
made before the engine starts.

Registered as the ``quiesce_serve`` entry of ``sglang.srt.plugins``: SGLang calls
:func:`register` first thing in every process it starts (0.5.23); in the server's main
process that is ``launch_server``'s ``load_plugins()``, before it parses its arguments,
starts the scheduler and detokenizer processes or imports its HTTP server. SGLang's
server has no ``--middleware`` option: quiesce serves it when ``$QUIESCE_SGLANG_ARGS`` is
set (empty for every default), and only in the main process; everywhere else
:func:`register` returns at once.

What it does there, in order, so that a bad setting refuses the start before the engine:

1. refuses the server layouts quiesce cannot serve truthfully (from the command line):
   several tokenizer workers (``--tokenizer-worker-num`` > 1: each HTTP worker is a
   process that loads no plugin), the HTTP/2 server (``--enable-http2``: not uvicorn), and
   the servers that are not SGLang's HTTP app (``--grpc-mode``, ``--smg-grpc-mode``,
   ``--use-ray``, ``--encoder-only``);
2. reads quiesce's settings from ``$QUIESCE_SGLANG_ARGS``
   (:mod:`quiesce.serve.server_options`) and makes the process's claim
   (:func:`quiesce.serve.server_claim.make_claim`: admin token and port, logs on stderr,
   signal ownership claimed *permitted*, inherited by the engine's processes, which
   quiesce's SGLang plugin guards);
3. adds :class:`quiesce.serve.sglang_serve.QuiesceMiddleware` to SGLang's app
   (``sglang.srt.entrypoints.http_server.app``, built at import, served later).

Any problem: one line on stderr naming the setting, and the server exits with code 2.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Sequence

from quiesce.errors import ConfigError
from quiesce.serve.server_claim import EXIT_CONFIG, current_claim, make_claim
from quiesce.serve.server_options import SGLANG_ARGS_ENV, parse_server_options
from quiesce.signal_guard import OWNER_ENV

REFUSED_FLAGS = {
    "--enable-http2": "SGLang's HTTP/2 server is Granian, not uvicorn",
    "--grpc-mode": "a gRPC server", "--smg-grpc-mode": "a gRPC server",
    "--use-ray": "the Ray server", "--encoder-only": "an encoder-disaggregation server",
}
"""``launch_server`` flags that select a server quiesce's middleware is not part of."""


def layout_problem(argv: Sequence[str]) -> str | None:
    """Why quiesce cannot serve the server ``argv`` asks for (step 1), or None."""
    for index, arg in enumerate(argv):
        name, _, inline = arg.partition("=")
        if name in REFUSED_FLAGS:
            return f"{name}: {REFUSED_FLAGS[name]}; quiesce serves SGLang's uvicorn HTTP app"
        if name == "--tokenizer-worker-num":
            value = inline or (argv[index + 1] if index + 1 < len(argv) else "")
            if value.strip() not in ("", "1"):
                return (f"--tokenizer-worker-num {value}: each HTTP worker is a process of "
                        "its own that loads no plugin; run one (the default)")
    return None


def register() -> None:
    """Entry point of ``sglang.srt.plugins`` (module docstring). Idempotent; a no-op in
    the engine's processes and without ``$QUIESCE_SGLANG_ARGS``; exits the process with
    code 2 on a bad setting or layout."""
    if current_claim() is not None or multiprocessing.parent_process() is not None:
        return
    if SGLANG_ARGS_ENV not in os.environ or OWNER_ENV in os.environ:
        return  # not asked for, or started by another quiesce worker
    try:
        problem = layout_problem(sys.argv[1:])
        if problem is not None:
            raise ConfigError("launch_server", problem)
        make_claim(parse_server_options(SGLANG_ARGS_ENV, name="sglang-serve"), "sglang")
    except (ConfigError, OSError) as exc:
        print(f"sglang: quiesce refuses to start: {exc} (settings: ${SGLANG_ARGS_ENV})",
              file=sys.stderr, flush=True)
        raise SystemExit(EXIT_CONFIG) from None
    from quiesce.adapters.sglang.server import http_app  # noqa: PLC0415 (SGLang's server)
    from quiesce.serve.sglang_serve import QuiesceMiddleware  # noqa: PLC0415

    http_app().add_middleware(QuiesceMiddleware)
