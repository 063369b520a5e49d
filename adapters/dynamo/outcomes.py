"""How a Dynamo handler's stream says it ended, beyond :func:`~.gated.finish_outcome`.

Each ``*_outcome`` function is a :data:`~.gated.FinishOutcome`: ``(chunk, context) ->
Outcome | None``, None when the chunk does not end the stream; the last chunk that states
one counts, and a stream that never states one is client gone if the client stopped it,
else lost (:func:`~.gated.unstated_outcome`). Checked against ai-dynamo 1.6.1.

A prefill handler hands the decode side its KV parameters (``disaggregated_params``) in
a chunk without a finish reason. That chunk alone never counts as completed (whether the
decode side then pulled the KV is the probe's business, but the prefill itself must have
ended well):

- :func:`vllm_prefill_outcome` — Dynamo's vLLM ``PrefillWorkerHandler`` yields one chunk
  per engine output, after the engine ran the prefill (``max_tokens`` = ``min_tokens`` =
  1). Completed when it carries ``disaggregated_params.kv_transfer_params`` and the
  token the prefill generated; an aborted prefill generated none (and, with NIXL, has no
  KV parameters), so its stream states nothing.
- Dynamo's SGLang ``PrefillWorkerHandler`` yields its bootstrap parameters *before* the
  prefill runs, then consumes the engine's results off the stream
  (``_consume_results``, which returns the final ``meta_info``, or None when the request
  was cancelled or never finished). Its stream cannot say how the prefill ended:
  :func:`sglang_final_outcome` reads that ``meta_info`` (the component hooks
  ``_consume_results``; :class:`~.gated.EngineEnds`).

- :func:`sglang_outcome` — Dynamo's SGLang handlers, whose chunks take one of three
  shapes: the token stream (``finish_reason`` at the top, Dynamo's normalized string),
  the text stream of ``--use-sglang-tokenizer`` (``choices[i].finish_reason``) and the
  native Generate stream or the health canary (SGLang's own ``meta_info.finish_reason``,
  a dict with ``type``, under ``engine_data.sglang_response`` or at the top).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from quiesce.admission import Outcome

from .gated import finish_outcome


def vllm_prefill_outcome(chunk: Any, context: Any) -> Outcome | None:
    """A Dynamo vLLM prefill stream's outcome (module docstring)."""
    stated = finish_outcome(chunk, context)
    if stated is not None or not isinstance(chunk, Mapping):
        return stated
    handoff = chunk.get("disaggregated_params")
    tokens = chunk.get("token_ids")
    if isinstance(handoff, Mapping) and handoff.get("kv_transfer_params") is not None \
            and isinstance(tokens, list) and tokens:
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
    stated = finish_outcome(chunk, context)
    choices = chunk.get("choices")
    if stated is None and isinstance(choices, list):
        for choice in choices:
            stated = finish_outcome(choice, context) or stated
    if stated is None:
        native = _native_reason(chunk)
        if native is not None:
            stated = finish_outcome({"finish_reason": native}, context)
    return stated


def sglang_final_outcome(meta_info: Any, context: Any) -> Outcome | None:
    """How SGLang ended a request, from the final ``meta_info`` Dynamo's prefill handler's
    ``_consume_results`` returns (its ``finish_reason`` ``type``: ``length``/``stop`` is
    completed, ``abort`` client gone or lost); None for None (cancelled, never
    finished) or a ``meta_info`` without a finish reason."""
    if not isinstance(meta_info, Mapping):
        return None
    return sglang_outcome({"meta_info": meta_info}, context)
