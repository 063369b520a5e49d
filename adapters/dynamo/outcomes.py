"""How a Dynamo handler's stream says it ended, beyond :func:`~.gated.finish_outcome`.

Each function is a :data:`~.gated.FinishOutcome`: ``(chunk, context) -> Outcome | None``,
None when the chunk does not end the stream; the last chunk that states one counts, and
a stream that never states one is client gone if the client stopped it, else lost
(:func:`~.gated.unstated_outcome`). Checked against ai-dynamo 1.6.1.

- :func:`handoff_outcome` — a **prefill** handler's stream. Dynamo's vLLM and SGLang
  prefill handlers hand the decode side its KV parameters (``disaggregated_params``) in
  a chunk without a finish reason: the stream's work is done once they were handed over
  (whether the decode side then pulled the KV is the probe's business, and a failed pull
  shows as a lost request on the decode worker). A finish reason stated anyway (the
  TensorRT-LLM prefill handler's ``length``, an ``error``) is read as
  :func:`~.gated.finish_outcome` reads it.
- :func:`sglang_outcome` — Dynamo's SGLang handlers, whose chunks take one of three
  shapes: the token stream (``finish_reason`` at the top, Dynamo's normalized string),
  the text stream of ``--use-sglang-tokenizer`` (``choices[i].finish_reason``) and the
  native Generate stream or the health canary (SGLang's own ``meta_info.finish_reason``,
  a dict with ``type``, under ``engine_data.sglang_response`` or at the top); a prefill
  handoff as :func:`handoff_outcome`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quiesce.admission import Outcome

from .gated import finish_outcome


def handoff_outcome(chunk: Any, context: Any) -> Outcome | None:
    """A prefill stream's outcome (module docstring)."""
    stated = finish_outcome(chunk, context)
    if stated is not None:
        return stated
    if isinstance(chunk, Mapping) and chunk.get("disaggregated_params"):
        return Outcome.COMPLETED
    return None


def _native_reason(chunk: Mapping[str, Any]) -> Any:
    """SGLang's own ``meta_info.finish_reason`` in a native or canary chunk, or None."""
    engine_data = chunk.get("engine_data")
    native = engine_data.get("sglang_response") if isinstance(engine_data, Mapping) else None
    for holder in (native, chunk):
        meta = holder.get("meta_info") if isinstance(holder, Mapping) else None
        reason = meta.get("finish_reason") if isinstance(meta, Mapping) else None
        if reason:
            return reason.get("type") if isinstance(reason, Mapping) else reason
    return None


def sglang_outcome(chunk: Any, context: Any) -> Outcome | None:
    """A Dynamo SGLang handler's stream outcome, any of its chunk shapes (module docstring)."""
    if not isinstance(chunk, Mapping):
        return None
    stated = handoff_outcome(chunk, context)
    choices = chunk.get("choices")
    if stated is None and isinstance(choices, list):
        for choice in choices:
            stated = finish_outcome(choice, context) or stated
    if stated is None:
        native = _native_reason(chunk)
        if native is not None:
            stated = finish_outcome({"finish_reason": native}, context)
    return stated
