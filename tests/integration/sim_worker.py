"""A minimal standalone worker process, used by ``test_sigterm.py``.

It exists to test real signal handling (SIGTERM, SIGINT, a second signal) in a real
process, without the HTTP face: standard library plus quiesce only. It wires the
same pieces a worker backend does: SimEngine + SimProbe + AdmissionGate +
InMemoryDiscovery + Lifecycle + Shutdown, with ``Shutdown.install_signal_handlers()``.

Protocol (JSON lines over TCP on 127.0.0.1, one request per connection):

- at startup the worker prints ``{"port": N}`` as one line on stdout;
- the client sends ``{"id": "...", "max_tokens": N, "remote_decode": bool,
  "never_pulled": bool}``;
- the worker admits it through ``lifecycle.gate.admit(id)`` and streams
  ``{"token": i}`` lines, then ``{"done": true}``; if admission is closed it answers
  ``{"error": "draining", "retryable": true}``; if the engine aborts the request it
  answers ``{"error": "aborted"}``;
- on the first signal it runs the budgeted shutdown, then closes the TCP server
  (streams that were admitted finish first), prints the ShutdownReport as one JSON
  line on stdout and exits with the report's exit code.

Usage: ``python sim_worker.py [--budget S] [--reserve S] [--grace S] [--decode-step S]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys

from quiesce import AdmissionGate, InMemoryDiscovery, WorkerDraining
from quiesce.adapters.sim import RequestAborted, SimConfig, SimEngine, SimProbe, SimRequest
from quiesce.admission import Outcome
from quiesce.drain import DrainConfig
from quiesce.lifecycle import Lifecycle
from quiesce.shutdown import Shutdown, ShutdownPolicy

HANDLER_GRACE_S = 2.0
"""After the shutdown, how long to wait for connection handlers to write their last line."""


async def _send(writer: asyncio.StreamWriter, message: dict[str, object]) -> None:
    writer.write(json.dumps(message).encode() + b"\n")
    await writer.drain()


async def _serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     lifecycle: Lifecycle, engine: SimEngine) -> None:
    line = await reader.readline()
    if not line:
        return
    message = json.loads(line)
    request = SimRequest(str(message["id"]), max_tokens=int(message.get("max_tokens", 16)),
                         remote_decode=bool(message.get("remote_decode", False)),
                         never_pulled=bool(message.get("never_pulled", False)))
    try:
        admission = lifecycle.gate.admit(request.request_id)
    except WorkerDraining as exc:
        await _send(writer, {"error": "draining", "retryable": exc.retryable})
        return
    # `done` is written while still admitted, so the drain waits for it.
    with admission:
        try:
            async for token in engine.generate(request):
                await _send(writer, {"token": token})
        except RequestAborted:
            admission.finish(Outcome.LOST)
            await _send(writer, {"error": "aborted"})
            return
        await _send(writer, {"done": True})
        admission.finish(Outcome.COMPLETED)


async def serve(args: argparse.Namespace) -> int:
    engine = SimEngine(SimConfig(decode_step_s=args.decode_step))
    lifecycle = Lifecycle(gate=AdmissionGate(accepting=False), probe=SimProbe(engine),
                          discovery=InMemoryDiscovery("sim-worker"),
                          config=DrainConfig(router_grace_s=args.grace))
    shutdown = Shutdown(lifecycle, engine,
                        ShutdownPolicy(total_s=args.budget, cleanup_reserve_s=args.reserve))
    shutdown.install_signal_handlers()
    handlers: set[asyncio.Task[None]] = set()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await _serve_one(reader, writer, lifecycle, engine)
        except (ConnectionError, ValueError, KeyError) as exc:  # client gone, or nonsense
            logging.getLogger("sim_worker").info("connection ended: %r", exc)
        finally:
            handlers.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    await engine.start()
    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    try:
        await lifecycle.start()
        port = server.sockets[0].getsockname()[1]
        print(json.dumps({"port": port}), flush=True)
        await shutdown.wait_requested()
        report = await shutdown.run()
    finally:
        server.close()
        if handlers:  # admitted streams write their last line before the process goes
            await asyncio.wait(set(handlers), timeout=HANDLER_GRACE_S)
        with contextlib.suppress(asyncio.TimeoutError):  # 3.12+ waits for open connections
            await asyncio.wait_for(server.wait_closed(), HANDLER_GRACE_S)
    print(json.dumps(report.to_dict()), flush=True)
    return report.exit_code


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--budget", type=float, default=10.0, help="shutdown total_s")
    parser.add_argument("--reserve", type=float, default=2.0, help="shutdown cleanup_reserve_s")
    parser.add_argument("--grace", type=float, default=0.2, help="drain router_grace_s")
    parser.add_argument("--decode-step", type=float, default=0.01, help="SimConfig.decode_step_s")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(asyncio.run(serve(args)))


if __name__ == "__main__":
    main()
