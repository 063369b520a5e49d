"""What the shutdown may ask of an engine besides reading it.

Probes are read-only; the few control calls live here, in a separate protocol, so
that a probe can never be used to change engine state by accident.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class EngineControl(Protocol):
    async def abort_all(self, reason: str) -> int:
        """Abort every request the engine holds, including KV held for a remote reader.

        Returns how many were aborted. Used only when the drain budget ran out.
        """

    async def shutdown(self) -> None:
        """Stop the engine and release its resources. Called after the probe was read."""
