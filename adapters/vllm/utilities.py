"""EngineCore's two utility methods, which :func:`.plugin.register` attaches to
``EngineCore``; the frontend calls them with
``engine.engine_core.call_utility_all_async(name, *args)``. Both run on EngineCore's
busy-loop thread between two steps, so what they count is consistent, and neither ever
raises into EngineCore.

- ``quiesce_snapshot()`` returns the counts as a dict: waiting, running, finished but
  held for a KV send, waiting for remote KV, connector push work, unflushed finished
  ids, EngineCore's own ``has_work()``, and the drain ETA with its inputs (``eta``).
  Read-only: it never calls a connector method that reaps transfers. The first call
  starts the step timer (:mod:`.eta`) if no subscription did, so its ETA is unknown until
  a step has been timed.
- ``quiesce_subscribe(directory, fifo_name)`` starts the board (:mod:`.board`): it
  creates this engine's board file in ``directory`` (made by the frontend), publishes the
  counts and the ETA at once, and from then on after every engine step and after every
  client request EngineCore handles (:mod:`.publisher` wraps EngineCore's methods for
  that). It answers ``{"board": file name, "pid", "dp_rank"}``. Each later subscriber
  (another frontend process) gets a board of its own.
"""

from __future__ import annotations

import os
from typing import Any

from .board import BoardFlags, BoardWriter, EtaFlags
from .publisher import count_pending, engine_publisher

SNAPSHOT_METHOD = "quiesce_snapshot"
SUBSCRIBE_METHOD = "quiesce_subscribe"
SNAPSHOT_VERSION = 3
FIELDS = ("waiting", "running", "kv_sends_held", "kv_recvs_awaited", "connector_push_work",
          "unflushed_finished")


def quiesce_snapshot(engine_core: Any) -> dict[str, Any]:
    """Utility: the counts and the ETA as a dict, or ``{"error": reason}``; never raises.

    Starts the step timer on first use (an ETA needs a timed step)."""
    try:
        counts = count_pending(engine_core)
    except Exception as exc:  # drift: answer with the reason, never raise into EngineCore
        return {"version": SNAPSHOT_VERSION, "error": f"{type(exc).__name__}: {exc}"}
    answer: dict[str, Any] = {"version": SNAPSHOT_VERSION,
                              **dict(zip(FIELDS, counts, strict=False)),
                              "has_work": bool(counts[6] & BoardFlags.HAS_WORK)}
    try:
        publisher = engine_publisher(engine_core)
        answer["eta"] = publisher.eta_details(counts)
    except Exception as exc:  # the ETA never costs the counts
        answer["eta"] = {"expected_ms": None, "upper_ms": None,
                         "flags": int(EtaFlags.NOT_COMPUTED),
                         "error": f"{type(exc).__name__}: {exc}"}
    return answer


def quiesce_subscribe(engine_core: Any, directory: str, fifo_name: str) -> dict[str, Any]:
    """Utility: start publishing to a new board in ``directory``; never raises."""
    try:
        publisher = engine_publisher(engine_core)
        parallel = engine_core.vllm_config.parallel_config
        rank = int(getattr(parallel, "data_parallel_index",
                           getattr(parallel, "data_parallel_rank", 0)) or 0)
        name = f"engine-{rank}-{os.getpid()}.board"
        board = BoardWriter(os.path.join(directory, name), os.path.join(directory, fifo_name),
                            rank)
        publisher.add(board)
    except Exception as exc:  # e.g. a DP engine on another host cannot see ``directory``
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"board": name, "pid": os.getpid(), "dp_rank": rank}
