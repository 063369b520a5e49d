"""What the shutdown may ask of a vLLM ``AsyncLLM`` besides reading it.

``abort_all`` aborts every request the frontend still tracks (the forced path when the
drain budget ran out) and counts them. KV blocks held for a remote decoder after a
request finished are not requests any more: vLLM frees them when the decoder reads
them, when their NIXL lease expires, or when the engine shuts down; the count does not
include them.
"""

from __future__ import annotations

import asyncio
from typing import Any


class VllmEngineControl:
    """:class:`~quiesce.engine.EngineControl` for a vLLM V1 ``AsyncLLM``."""

    def __init__(self, engine: Any, shutdown_timeout_s: float | None = None) -> None:
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s

    async def abort_all(self, reason: str) -> int:
        ids = list(self.engine.output_processor.request_states)
        if ids:
            await self.engine.abort(ids, internal=True)
        return len(ids)

    async def shutdown(self) -> None:
        # AsyncLLM.shutdown joins child processes synchronously: keep the loop free.
        await asyncio.to_thread(self.engine.shutdown, self.shutdown_timeout_s)
