"""The board: pending-work counts that EngineCore publishes each step, read without a round trip.

A utility call to EngineCore is answered only between two engine steps, so a probe that
asks each time waits up to one step plus a trip through two processes. Instead, once a
probe subscribes, quiesce's plugin (:mod:`.plugin`) writes the scheduler's counts into a
small memory-mapped file after every engine step (and after every client
request), and the frontend reads them in microseconds. Nothing here imports vLLM or
quiesce's core; both sides use this module.

Layout (one file per EngineCore, :data:`RECORD_SIZE` bytes, little-endian)::

    0   magic b"QSCB", layout version (u32), DP rank (i32), writer pid (u32)
    16  sequence number (u64): odd while a write is in progress, +2 per publication
    24  waiting, running, kv_sends_held, kv_recvs_awaited, connector_push_work,
        unflushed_finished, flags (7 x u32)
    52  crc32 of bytes 16..52 as they are once the write is complete

Writer (EngineCore process), :class:`BoardWriter`:

- ``publish(counts)`` writes only when the counts changed since the last publication,
  so a steady decode costs one tuple comparison per call. After a change it writes one
  byte to the subscriber's FIFO. It never raises into the engine loop: a full FIFO
  (nobody waiting) is left full; a FIFO whose reader went away (EPIPE) marks the board
  ``abandoned``, and the plugin stops publishing to it.
- ``close()`` publishes the CLOSED flag (the engine is shutting down) and unmaps.

Reader (frontend process), :class:`BoardReader`:

- ``read()`` copies the record and accepts it only when the sequence number is even and
  the checksum matches, retrying a torn copy; it never blocks. ``None`` means no
  consistent copy was seen (the probe then answers UNKNOWN).

:class:`ChangeFifo` is the frontend's end of the notification FIFO, shared by all of its
EngineCores: ``wait(timeout)`` returns when any writer signalled, or at ``timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import mmap
import os
import struct
import weakref
import zlib
from enum import IntFlag

MAGIC = b"QSCB"
LAYOUT_VERSION = 1
HEADER = struct.Struct("<4sIiI")
SEQUENCE = struct.Struct("<Q")
COUNTS = struct.Struct("<7I")
CHECKSUM = struct.Struct("<I")
SEQ_AT = HEADER.size
COUNTS_AT = SEQ_AT + SEQUENCE.size
CHECKSUM_AT = COUNTS_AT + COUNTS.size
RECORD_END = CHECKSUM_AT + CHECKSUM.size
RECORD_SIZE = 64
READ_ATTEMPTS = 64
"""Copies tried before a read gives up; a write takes about a microsecond."""


class BoardFlags(IntFlag):
    HAS_WORK = 1
    """EngineCore's own ``has_work()`` was true."""
    ERROR = 2
    """Counting failed inside EngineCore (vLLM drift); the counts are not meaningful."""
    CLOSED = 4
    """EngineCore is shutting down: the board is no longer maintained."""


Counts = tuple[int, int, int, int, int, int, int]
"""waiting, running, kv_sends_held, kv_recvs_awaited, connector_push_work,
unflushed_finished, flags — the order of the record."""


@dataclasses.dataclass(frozen=True)
class BoardSnapshot:
    """One consistent copy of a board."""

    sequence: int
    waiting: int
    running: int
    kv_sends_held: int
    kv_recvs_awaited: int
    connector_push_work: int
    unflushed_finished: int
    flags: BoardFlags

    @property
    def has_work(self) -> bool:
        return BoardFlags.HAS_WORK in self.flags


class BoardError(RuntimeError):
    """A board file is missing, too small, or not in this layout."""


def _checksum(sequence: int, counts: Counts) -> int:
    return zlib.crc32(SEQUENCE.pack(sequence) + COUNTS.pack(*counts))


class BoardWriter:
    """EngineCore's end: creates ``path`` (must not exist) and publishes into it."""

    def __init__(self, path: str, fifo_path: str, dp_rank: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # allocate now: a write into a sparse page of a full tmpfs would be SIGBUS
            os.posix_fallocate(fd, 0, RECORD_SIZE)
            self._map = mmap.mmap(fd, RECORD_SIZE)
        finally:
            os.close(fd)
        self._map[:HEADER.size] = HEADER.pack(MAGIC, LAYOUT_VERSION, dp_rank, os.getpid())
        # O_NONBLOCK: opening succeeds only while the frontend holds the read end, and a
        # full FIFO never blocks the engine loop.
        self._fifo: int | None = os.open(fifo_path, os.O_WRONLY | os.O_NONBLOCK)
        self._sequence = 0
        self._last: Counts | None = None

    @property
    def abandoned(self) -> bool:
        """The frontend closed its end of the FIFO: nobody reads this board any more."""
        return self._fifo is None and not self._map.closed

    def publish(self, counts: Counts) -> None:
        if counts == self._last or self._map.closed:
            return
        self._last = counts
        sequence = self._sequence + 2
        # odd sequence first: a reader that copies mid-write sees it, or a bad checksum
        self._map[SEQ_AT:COUNTS_AT] = SEQUENCE.pack(self._sequence + 1)
        self._map[COUNTS_AT:CHECKSUM_AT] = COUNTS.pack(*counts)
        self._map[CHECKSUM_AT:RECORD_END] = CHECKSUM.pack(_checksum(sequence, counts))
        self._map[SEQ_AT:COUNTS_AT] = SEQUENCE.pack(sequence)
        self._sequence = sequence
        self._notify()

    def _notify(self) -> None:
        if self._fifo is None:
            return
        try:
            os.write(self._fifo, b"!")
        except BlockingIOError:  # full: the reader has a wake-up pending already
            pass
        except OSError:  # EPIPE: the frontend closed its end; stop signalling
            os.close(self._fifo)
            self._fifo = None

    def close(self) -> None:
        """Publish CLOSED, then release the mapping and the FIFO. Idempotent."""
        if self._map.closed:
            return
        last = self._last or (0, 0, 0, 0, 0, 0, 0)
        self.publish((*last[:6], last[6] | BoardFlags.CLOSED))
        self._map.close()
        if self._fifo is not None:
            os.close(self._fifo)
            self._fifo = None


class BoardReader:
    """The frontend's end of one board."""

    def __init__(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise BoardError(f"cannot open the board {path}: {exc}") from exc
        try:
            if os.fstat(fd).st_size < RECORD_SIZE:
                raise BoardError(f"the board {path} is smaller than {RECORD_SIZE} bytes")
            self._map = mmap.mmap(fd, RECORD_SIZE, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        magic, layout, self.dp_rank, self.pid = HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or layout != LAYOUT_VERSION:
            self._map.close()
            raise BoardError(f"the board {path} has layout {magic!r}/{layout}, "
                             f"expected {MAGIC!r}/{LAYOUT_VERSION}")

    def read(self) -> BoardSnapshot | None:
        """A consistent copy, or None if every attempt caught a write in progress."""
        for _ in range(READ_ATTEMPTS):
            record = self._map[SEQ_AT:RECORD_END]
            (sequence,) = SEQUENCE.unpack_from(record, 0)
            if sequence == 0 or sequence % 2:
                if sequence == 0:
                    return None  # never published (the writer publishes before answering)
                continue
            counts: Counts = COUNTS.unpack_from(record, SEQUENCE.size)
            (checksum,) = CHECKSUM.unpack_from(record, SEQUENCE.size + COUNTS.size)
            if checksum == _checksum(sequence, counts):
                return BoardSnapshot(sequence, *counts[:6], BoardFlags(counts[6]))
        return None

    def close(self) -> None:
        self._map.close()


class ChangeFifo:
    """The frontend's end of the notification FIFO; one event loop waits on it.

    The FIFO is opened for reading and, by this process too, for writing, so that it
    never reads as end-of-file when no engine holds it open (an EOF would wake the loop
    over and over).
    """

    def __init__(self, path: str) -> None:
        os.mkfifo(path, 0o600)
        self._read = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self._keepalive = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        # closes both ends if this object is dropped without close()
        self._release = weakref.finalize(self, _close_all, self._read, self._keepalive)
        self._waiters: set[asyncio.Future[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def drain(self) -> None:
        """Consume pending signals (call before re-reading the boards) and wake every
        waiter if there were any, so that no waiter misses a signal another one read."""
        if self._closed:
            return
        signalled = False
        with contextlib.suppress(BlockingIOError):  # empty: done
            while os.read(self._read, 4096):
                signalled = True
        if signalled:
            self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Return once an engine signalled a change, or after ``timeout`` seconds."""
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        if not self._waiters:
            loop.add_reader(self._read, self.drain)
            self._loop = loop
        self._waiters.add(waiter)
        try:
            await asyncio.wait({waiter}, timeout=timeout)
        finally:
            self._waiters.discard(waiter)
            if not self._waiters and self._loop is not None:
                self._loop.remove_reader(self._read)
                self._loop = None

    def close(self) -> None:
        """Wake every waiter, stop watching the FIFO and close it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._read)
            self._loop = None
        self._wake()
        self._release()


def _close_all(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
