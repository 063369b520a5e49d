"""The router's side of etcd discovery: :class:`EtcdWatcher` follows the workers' prefix."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from quiesce.budget import Deadline, check_seconds
from quiesce.discovery import BACKOFF_FIRST_S, Watcher, describe_failure, retry_within
from quiesce.errors import ConfigError

from .client import CLEANUP_BACKOFF_MAX_S, GRPC_OPTIONS, grpc_host, load_aetcd, retryable

log = logging.getLogger("quiesce.adapters.etcd")


class EtcdWatcher:
    """Follows ``<prefix>/`` the way a router does: a name → value map and change callbacks.

    ``start()`` reads the prefix once and watches from the next revision; a watch that
    breaks (etcd down) is re-established with the doubling backoff (at most 1 s), and the
    map re-read, calling the callbacks for what changed meanwhile. ``wait_for`` blocks,
    woken by events, until a name is (or is not) listed, or its timeout passes.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 2379,
                 prefix: str = "/quiesce/instances") -> None:
        if not isinstance(prefix, str) or not prefix.startswith("/") or prefix.endswith("/"):
            raise ConfigError("prefix", f"must start and not end with '/', got {prefix!r}")
        self._aetcd = load_aetcd()
        self._client = self._aetcd.Client(grpc_host(host), port, options=dict(GRPC_OPTIONS))
        self._prefix = (prefix + "/").encode()
        self.instances: dict[str, dict[str, Any]] = {}
        self._watchers: list[Watcher] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self.reconnects = 0

    def watch(self, watcher: Watcher) -> None:
        """Call ``watcher(name, registered)`` on every change (on the event loop)."""
        self._watchers.append(watcher)

    def _set(self, name: str, value: dict[str, Any] | None) -> None:
        was = name in self.instances
        if value is None:
            self.instances.pop(name, None)
        else:
            self.instances[name] = value
        if was != (value is not None):
            for watcher in list(self._watchers):
                watcher(name, value is not None)
        self._changed.set()

    def _name(self, key: bytes) -> str:
        return key[len(self._prefix):].decode()

    async def _snapshot(self) -> int:
        got = await self._client.get_prefix(self._prefix)
        seen: dict[str, dict[str, Any]] = {}
        for kv in got:
            try:
                seen[self._name(kv.key)] = json.loads(kv.value)
            except ValueError:
                seen[self._name(kv.key)] = {"invalid": kv.value.decode(errors="replace")}
        for name in set(self.instances) - set(seen):
            self._set(name, None)
        for name, value in seen.items():
            self._set(name, value)
        return int(got.header.revision)

    async def start(self, timeout_s: float = 5.0) -> None:
        """Read the prefix and start watching; raises DiscoveryUnavailable after
        ``timeout_s`` if etcd cannot be read."""
        check_seconds("timeout_s", timeout_s, allow_zero=False)
        revision = await retry_within("etcd", "watch", self._snapshot,
                                      Deadline.after(timeout_s), timeout_s,
                                      retryable=retryable)
        watch = await self._client.watch_prefix(self._prefix, start_revision=revision + 1)
        self._task = asyncio.get_running_loop().create_task(self._follow(watch, revision))
        self._ready.set()

    async def _follow(self, watch: Any, revision: int) -> None:
        kinds = self._aetcd.EventKind
        delay = BACKOFF_FIRST_S
        while True:
            try:
                async for event in watch:
                    name = self._name(event.kv.key)
                    revision = max(revision, int(event.kv.mod_revision))
                    if event.kind == kinds.DELETE:
                        self._set(name, None)
                    else:
                        try:
                            self._set(name, json.loads(event.kv.value))
                        except ValueError:
                            self._set(name, {"invalid": event.kv.value.decode(
                                errors="replace")})
                    delay = BACKOFF_FIRST_S
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("etcd watch broke: %s", describe_failure(exc))
            # re-establish: re-read the map, then watch from the revision read
            while True:
                await asyncio.sleep(delay)
                delay = min(delay * 2, CLEANUP_BACKOFF_MAX_S)
                try:
                    revision = await asyncio.wait_for(self._snapshot(), 1.0)
                    watch = await asyncio.wait_for(
                        self._client.watch_prefix(self._prefix, start_revision=revision + 1),
                        1.0)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.debug("etcd re-watch failed: %s", describe_failure(exc))
                    continue
                self.reconnects += 1
                break

    async def wait_for(self, name: str, registered: bool, timeout_s: float) -> bool:
        """Until ``name`` is listed (``registered``) or not; False after ``timeout_s``."""
        check_seconds("timeout_s", timeout_s)
        deadline = Deadline.after(timeout_s)
        while (name in self.instances) != registered:
            left = deadline.remaining()
            if left <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except (TimeoutError, asyncio.TimeoutError):
                return (name in self.instances) == registered
        return True

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task})
        await self._client.close()
