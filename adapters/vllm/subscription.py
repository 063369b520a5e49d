"""The frontend's subscription to the boards of every EngineCore an ``AsyncLLM`` manages.

:func:`subscribe` asks each EngineCore (a utility call, once) to publish its counts to a
board (:mod:`.board`) in a fresh private directory, maps every board, then removes the
directory: the mappings and the FIFO stay valid, and once that is done nothing is left
behind if either side dies. One subscription serves every probe of the same engine
client in this process (EngineCore keeps at most a few boards).

A subscription fails with :class:`BoardError` and its reason when the plugin is not
installed, when an engine cannot open the directory (a DP engine on another host), or
when fewer engines answer than the frontend manages; the probe then reads EngineCore
with a utility call per read instead, and says so in its details.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from .board import BoardError, BoardReader, BoardSnapshot, ChangeFifo, counts_key
from .utilities import SUBSCRIBE_METHOD

FIFO_NAME = "changes.fifo"
SHARED_MEMORY_DIR = "/dev/shm"
"""Where boards are created when it is writable (tmpfs); the temp directory otherwise."""

CallEveryEngine = Callable[..., Awaitable[list[Any]]]


class BoardSubscription:
    """Mapped boards, one per EngineCore in DP-rank order, and the shared change FIFO."""

    def __init__(self, readers: list[BoardReader], fifo: ChangeFifo) -> None:
        self.readers = readers
        self.fifo = fifo
        self.closed = False

    def read(self) -> list[BoardSnapshot | None]:
        return [reader.read() for reader in self.readers]

    def sequence(self) -> int:
        """The sum of the boards' sequence numbers: it grows with every publication
        (-1 while a board has no consistent copy)."""
        snapshots = self.read()
        if any(s is None for s in snapshots):
            return -1
        return sum(s.sequence for s in snapshots if s is not None)

    def counts_key(self) -> int:
        """:func:`.board.counts_key` of every board: it changes with the counts, not with
        the ETA that a busy engine rewrites every step."""
        return counts_key(self.read())

    async def wait_for_change(self, after: int, timeout: float) -> None:
        """Return when :meth:`counts_key` differs from ``after`` (a count changed), or at
        ``timeout``. An ETA-only publication neither signals the FIFO nor ends the wait."""
        self.fifo.drain()  # before the check: a publication after it leaves a byte behind
        if self.counts_key() != after:
            return
        await self.fifo.wait(timeout)

    def close(self) -> None:
        """Unmap the boards and close the FIFO; each EngineCore drops its board at its next
        change (EPIPE). Idempotent."""
        if self.closed:
            return
        self.closed = True
        for reader in self.readers:
            reader.close()
        self.fifo.close()


def _board_directory() -> str:
    parent = SHARED_MEMORY_DIR if os.access(SHARED_MEMORY_DIR, os.W_OK) else None
    return tempfile.mkdtemp(prefix="quiesce-vllm-", dir=parent)


async def subscribe(call_every_engine: CallEveryEngine, engines: int) -> BoardSubscription:
    """Ask every EngineCore for a board; raises :class:`BoardError` with the reason."""
    directory = _board_directory()
    fifo = ChangeFifo(os.path.join(directory, FIFO_NAME))
    readers: list[BoardReader] = []
    try:
        try:
            answers = await call_every_engine(SUBSCRIBE_METHOD, directory, FIFO_NAME)
        except Exception as exc:
            raise BoardError(f"EngineCore did not answer {SUBSCRIBE_METHOD} "
                             f"({type(exc).__name__}: {exc})") from exc
        if len(answers) < engines:
            raise BoardError(f"only {len(answers)} of {engines} DP engines answered")
        for rank, answer in enumerate(answers):
            if not isinstance(answer, dict) or "board" not in answer:
                problem = answer.get("error") if isinstance(answer, dict) else repr(answer)
                raise BoardError(f"DP engine {rank} cannot publish a board: {problem}")
            readers.append(BoardReader(os.path.join(directory, str(answer["board"]))))
    except BaseException:
        for reader in readers:
            reader.close()
        fifo.close()
        raise
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # mapped files live on, unnamed
    return BoardSubscription(readers, fifo)


_shared: weakref.WeakKeyDictionary[Any, asyncio.Task[BoardSubscription]] = (
    weakref.WeakKeyDictionary())


async def shared_subscription(client: Any, call_every_engine: CallEveryEngine,
                              engines: int) -> BoardSubscription:
    """The subscription of ``client`` (an engine-core client), made on first use.

    The subscribing call runs as its own task, so a probe read that is cancelled (a probe
    timeout) does not leave boards half set up; the next read awaits the same task.
    A failed subscription is not retried: its cause (no plugin, engines on other hosts)
    does not go away while the engine runs.
    """
    try:
        task = _shared.get(client)
    except TypeError:  # a client that cannot be weakly referenced: not shared
        return await subscribe(call_every_engine, engines)
    if task is None:
        task = asyncio.ensure_future(subscribe(call_every_engine, engines))
        _shared[client] = task
    if task.done():  # a finished task's result can be read from any event loop
        subscription = task.result()
        if not subscription.closed:
            return subscription
        del _shared[client]
        return await shared_subscription(client, call_every_engine, engines)
    return await asyncio.shield(task)


def unsubscribe(client: Any) -> None:
    """Close ``client``'s subscription, if any, once it is made; a later read subscribes
    afresh."""
    try:
        task = _shared.pop(client, None)
    except TypeError:  # not weakly referenceable: never shared, nothing to close here
        return
    if task is None:
        return
    if task.done():
        _close_result(task)
    else:  # still subscribing: close what it makes
        task.add_done_callback(_close_result)


def _close_result(task: asyncio.Task[BoardSubscription]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()
