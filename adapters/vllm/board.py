"""The board: pending-work counts (and a drain ETA) that EngineCore publishes each step,
read without a round trip.

A utility call to EngineCore is answered only between two engine steps, so a probe that
asks each time waits up to one step plus a trip through two processes. Instead, once a
probe subscribes, quiesce's plugin (:mod:`.publisher`) writes the scheduler's counts into a
small memory-mapped file after every engine step (and after every client
request), and the frontend reads them in microseconds. Nothing here imports vLLM or
quiesce's core; both sides use this module.

Layout version 2 (one file per EngineCore, :data:`RECORD_SIZE` = 64 bytes, little-endian)::

    0   magic b"QSCB", layout version (u16), DP rank (i16), writer pid (u32)
    12  sequence number (u64): odd while a write is in progress, +2 per publication
    20  waiting, running, kv_sends_held, kv_recvs_awaited, connector_push_work,
        unflushed_finished, flags (7 x u32)
    48  drain ETA: expected ms, upper-bound ms (u32 each; 0xFFFFFFFF = unknown or
        unbounded), ETA flags (u32, :class:`EtaFlags`: why, and what the bound includes)
    60  crc32 of bytes 12..60 as they are once the write is complete

Version 1 (counts only, a 16-byte header) is refused by a version-2 reader and the
other way round; the probe then falls back to the snapshot utility and says why.

Writer (EngineCore process), :class:`BoardWriter`:

- ``publish(counts, eta)`` writes only when the counts or the ETA changed since the last
  publication, so an idle engine costs one tuple comparison per call; a busy one, whose
  ETA moves every step, one record write (~1 µs). Only a change of the COUNTS writes one
  byte to the subscriber's FIFO: a drain waiting for the work to change is not woken by
  the ETA ticking down every step. It never raises into the engine loop: a full FIFO
  (nobody waiting) is left full; a FIFO whose reader went away (EPIPE) marks the board
  ``abandoned``, and the plugin stops publishing to it.
- ``close()`` publishes the CLOSED flag (the engine is shutting down) and unmaps.

The ETA fields are what the plugin computed after the same step (:mod:`.eta`,
``estimate``): how long the engine still needs if nothing new arrives. They are
informational; a reader never derives a verdict from them.

Reader (frontend process), :class:`BoardReader`:

- ``read()`` copies the record and accepts it only when the sequence number is even and
  the checksum (over the counts AND the ETA) matches, retrying a torn copy; it never
  blocks. ``None`` means no consistent copy was seen (the probe then answers UNKNOWN).
- :func:`counts_key` of the copies read is what a waiting drain compares: the sequence
  number moves with every ETA rewrite, the key only when a count does.

:class:`ChangeFifo` is the frontend's end of the notification FIFO, shared by all of its
EngineCores: ``wait(timeout)`` returns when any writer signalled, or at ``timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import mmap
import os
import struct
import weakref
import zlib
from collections.abc import Sequence
from enum import IntFlag

MAGIC = b"QSCB"
LAYOUT_VERSION = 2
HEADER = struct.Struct("<4sHhI")
SEQUENCE = struct.Struct("<Q")
COUNTS = struct.Struct("<7I")
ETA = struct.Struct("<3I")
CHECKSUM = struct.Struct("<I")
SEQ_AT = HEADER.size
COUNTS_AT = SEQ_AT + SEQUENCE.size
ETA_AT = COUNTS_AT + COUNTS.size
CHECKSUM_AT = ETA_AT + ETA.size
RECORD_END = CHECKSUM_AT + CHECKSUM.size
RECORD_SIZE = 64
assert RECORD_END <= RECORD_SIZE
NO_VALUE = 0xFFFFFFFF
"""An ETA field that is unknown (expected) or unbounded (upper); the flags say why."""
MAX_MS = NO_VALUE - 1
"""The largest ETA a board can carry (about 49 days); larger values are clamped."""
READ_ATTEMPTS = 64
"""Copies tried before a read gives up; a write takes about a microsecond."""


class BoardFlags(IntFlag):
    HAS_WORK = 1
    """EngineCore's own ``has_work()`` was true."""
    ERROR = 2
    """Counting failed inside EngineCore (vLLM drift); the counts are not meaningful."""
    CLOSED = 4
    """EngineCore is shutting down: the board is no longer maintained."""


class EtaFlags(IntFlag):
    """Why an ETA field is unknown or unbounded, and what the bound includes."""

    NOT_COMPUTED = 1
    """No estimate: the writer gave none, or reading the requests failed (vLLM drift)."""
    NO_STEP_TIME = 2
    """Work is pending but no engine step has been timed yet: both fields unknown."""
    HELD_NO_LEASE = 4
    """KV held for a remote reader by a connector with no known lease: unbounded."""
    HELD_RENEWABLE_LEASE = 8
    """KV held under a lease the reader renews (NIXL heartbeats): unbounded."""
    HELD_LEASE = 16
    """KV held for a remote reader: the bound includes the connector's lease."""
    RECVS_AWAITED = 32
    """Requests wait for KV from a remote prefill worker, arriving when it sends: unbounded."""
    PUSH_WORK = 64
    """The connector still pushes KV to a remote reader: unbounded."""
    KV_LIMITED = 128
    """The KV cache cannot hold every pending request at full length: the bound assumes a
    smaller batch (and no preemption)."""


Counts = tuple[int, int, int, int, int, int, int]
"""waiting, running, kv_sends_held, kv_recvs_awaited, connector_push_work,
unflushed_finished, flags — the order of the record."""
Eta = tuple[int, int, int]
"""expected ms, upper-bound ms (:data:`NO_VALUE`: unknown / unbounded), :class:`EtaFlags`."""
NO_ETA: Eta = (NO_VALUE, NO_VALUE, int(EtaFlags.NOT_COMPUTED))


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
    eta_expected_ms: int | None = None
    """None: unknown (``eta_flags`` says why)."""
    eta_upper_ms: int | None = None
    """None: unbounded or unknown (``eta_flags`` says why)."""
    eta_flags: EtaFlags = EtaFlags.NOT_COMPUTED

    @property
    def has_work(self) -> bool:
        return BoardFlags.HAS_WORK in self.flags

    @property
    def counts(self) -> Counts:
        """The counts and flags in record order (what the FIFO signals a change of)."""
        return (self.waiting, self.running, self.kv_sends_held, self.kv_recvs_awaited,
                self.connector_push_work, self.unflushed_finished, int(self.flags))


def counts_key(snapshots: Sequence[BoardSnapshot | None]) -> int:
    """A number that changes when any board's counts change and not when only the ETA or
    the sequence does (crc32 of the counts, in board order); -1 if a copy is missing."""
    if any(s is None for s in snapshots):
        return -1
    return zlib.crc32(b"".join(COUNTS.pack(*s.counts) for s in snapshots if s is not None))


class BoardError(RuntimeError):
    """A board file is missing, too small, or not in this layout."""


def _checksum(sequence: int, counts: Counts, eta: Eta) -> int:
    return zlib.crc32(SEQUENCE.pack(sequence) + COUNTS.pack(*counts) + ETA.pack(*eta))


def eta_ms(seconds: float | None, *, upper: bool) -> int:
    """Seconds as a board field: :data:`NO_VALUE` for None, an upper bound rounded up."""
    if seconds is None:
        return NO_VALUE
    value = seconds * 1000.0
    ms = math.ceil(value) if upper else round(value)
    return min(max(ms, 0), MAX_MS)


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
        self._last_eta: Eta | None = None

    @property
    def abandoned(self) -> bool:
        """The frontend closed its end of the FIFO: nobody reads this board any more."""
        return self._fifo is None and not self._map.closed

    def publish(self, counts: Counts, eta: Eta = NO_ETA) -> None:
        """Write ``counts`` and ``eta`` if either changed; signal the FIFO only if the
        counts did. Never raises into the engine loop once constructed."""
        counts_changed = counts != self._last
        if (not counts_changed and eta == self._last_eta) or self._map.closed:
            return
        self._last, self._last_eta = counts, eta
        sequence = self._sequence + 2
        # odd sequence first: a reader that copies mid-write sees it, or a bad checksum
        self._map[SEQ_AT:COUNTS_AT] = SEQUENCE.pack(self._sequence + 1)
        self._map[COUNTS_AT:RECORD_END] = (COUNTS.pack(*counts) + ETA.pack(*eta)
                                           + CHECKSUM.pack(_checksum(sequence, counts, eta)))
        self._map[SEQ_AT:COUNTS_AT] = SEQUENCE.pack(sequence)
        self._sequence = sequence
        if counts_changed:
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
        self.publish((*last[:6], last[6] | BoardFlags.CLOSED), self._last_eta or NO_ETA)
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
            eta: Eta = ETA.unpack_from(record, SEQUENCE.size + COUNTS.size)
            (checksum,) = CHECKSUM.unpack_from(record, CHECKSUM_AT - SEQ_AT)
            if checksum == _checksum(sequence, counts, eta):
                expected, upper, eta_flags = eta
                return BoardSnapshot(sequence, *counts[:6], BoardFlags(counts[6]),
                                     None if expected == NO_VALUE else expected,
                                     None if upper == NO_VALUE else upper,
                                     EtaFlags(eta_flags))
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
