"""Dynamo's token-in/token-out protocol for a quiesce engine stream: the ``generate``
handler of ``quiesce serve --dynamo`` (checked against ai-dynamo 1.6.1).

Request: the ``PreprocessedRequest`` Dynamo's frontend sends a model registered with
``ModelInput.Tokens``: ``token_ids`` (the prompt) and ``stop_conditions``
(``max_tokens``, ``min_tokens``, ``ignore_eos``). Stop strings and hidden stop tokens
stay with the frontend, which applies them to the output; sampling options are not read
(the simulated engine's output does not depend on them).

Response: the chunks ``dynamo/vllm/handlers.py`` yields: ``{"index": 0, "token_ids":
[...]}`` per engine delta, the last with ``finish_reason`` and ``completion_usage``
(``prompt_tokens``, ``completion_tokens``, ``total_tokens``). Every output token is one
id (:func:`output_token`): an engine that makes no real text still has to hand the
frontend ids its tokenizer can decode, and never a special one (an end-of-sequence id
would end the stream at the frontend).

Aborts, as Dynamo's vLLM handler does them: each request has a monitor that waits for
the client to stop it (``context.async_killed_or_stopped()``) or for the worker's
``shutdown_event``; either aborts the engine's request. Then, on the shutdown event, the
handler raises Dynamo's ``EngineShutdown`` (the frontend ends the client's stream with
an error); on a client stop, or an engine abort with neither, the stream ends with
``finish_reason`` ``cancelled``. A request the engine refuses raises Dynamo's
``InvalidArgument`` (HTTP 400).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from quiesce.errors import ConfigError, RequestAborted, RequestRejected
from quiesce.generation import Delta, Prompt, Sampling

SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
"""Ids in ``config.json`` / ``generation_config.json`` never used as output."""


class TokenStreamer(Protocol):
    """An engine's request stream (``SimServing.stream``): the last delta carries the
    finish reason; raises RequestAborted when the engine ended the request, and
    RequestRejected for input it refuses."""

    def __call__(self, prompt: Prompt, sampling: Sampling, request_id: str,
                 kv_transfer_params: Mapping[str, Any]) -> AsyncIterator[Delta]: ...


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("model", f"{path} is not readable JSON: {exc}") from None
    return value if isinstance(value, dict) else {}


def output_token(model_dir: str | Path) -> int:
    """The id every output token gets: the smallest id of the tokenizer's vocabulary
    (``tokenizer.json``) that is not special (its added tokens marked special, and the
    BOS/EOS/PAD ids of ``config.json`` and ``generation_config.json``). ConfigError
    naming ``model`` when there is no ``tokenizer.json`` or no such id."""
    directory = Path(model_dir)
    tokenizer = _json(directory / "tokenizer.json")
    vocab = tokenizer.get("model", {}).get("vocab") if tokenizer else None
    if isinstance(vocab, dict):
        ids = sorted(i for i in vocab.values() if isinstance(i, int))
    elif isinstance(vocab, list):  # Unigram: [piece, score] pairs, the index is the id
        ids = list(range(len(vocab)))
    else:
        raise ConfigError("model", f"{directory} has no tokenizer.json with a vocabulary: "
                          "Dynamo's frontend needs the model's tokenizer")
    special = {t.get("id") for t in tokenizer.get("added_tokens", [])
               if isinstance(t, dict) and t.get("special")}
    for name in ("config.json", "generation_config.json"):
        config = _json(directory / name)
        for key in SPECIAL_ID_KEYS:
            value = config.get(key)
            special.update(value if isinstance(value, list) else [value])
    for token in ids:
        if token not in special:
            return token
    raise ConfigError("model", f"the tokenizer of {directory} has no ordinary token")


def has_chat_template(model_dir: str | Path) -> bool:
    """Whether the model directory has a chat template (Dynamo's frontend registers the
    chat surface only with one: "chat_template field is required")."""
    directory = Path(model_dir)
    return (bool(_json(directory / "tokenizer_config.json").get("chat_template"))
            or (directory / "chat_template.jinja").is_file()
            or (directory / "chat_template.json").is_file())


def _int_or(value: Any, default: int | None, field: str) -> int | None:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestRejected(f"stop_conditions.{field} must be an int >= 0, got {value!r}")
    return value


def request_of(request: Any) -> tuple[tuple[int, ...], Sampling]:
    """The prompt and sampling of a ``PreprocessedRequest``; RequestRejected when it is
    not one (no ``token_ids`` list, a bad stop condition)."""
    if not isinstance(request, Mapping):
        raise RequestRejected(f"expected a PreprocessedRequest, got {type(request).__name__}")
    tokens = request.get("token_ids")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise RequestRejected("token_ids must be a list of ints")
    stop = request.get("stop_conditions") or {}
    if not isinstance(stop, Mapping):
        raise RequestRejected("stop_conditions must be an object")
    max_tokens = _int_or(stop.get("max_tokens"), None, "max_tokens")
    if max_tokens == 0:
        raise RequestRejected("stop_conditions.max_tokens must be >= 1")
    sampling = Sampling(max_tokens=max_tokens,
                        min_tokens=_int_or(stop.get("min_tokens"), 0, "min_tokens") or 0,
                        ignore_eos=bool(stop.get("ignore_eos")))
    return tuple(tokens), sampling


async def _stopped(context: Any, shutdown_event: asyncio.Event) -> None:
    """Until the client stopped the request or the worker's shutdown began."""
    waiters = [asyncio.ensure_future(context.async_killed_or_stopped()),
               asyncio.ensure_future(shutdown_event.wait())]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)


def token_handler(stream: TokenStreamer, abort: Callable[[str], object], token: int,
                  shutdown_event: asyncio.Event
                  ) -> Callable[[Any, Any], AsyncIterator[dict[str, Any]]]:
    """The endpoint handler ``generate(request, context)`` over ``stream`` (module
    docstring). ``abort(request_id)``: ends one request in the engine (its stream then
    raises RequestAborted). ``token``: the output id (:func:`output_token`).
    Raises ConfigError when ai-dynamo's exceptions cannot be imported."""
    try:
        errors = importlib.import_module("dynamo.llm.exceptions")
    except ImportError:
        raise ConfigError("dynamo", "dynamo.llm cannot be imported: quiesce serve --dynamo "
                          "needs ai-dynamo-runtime 1.6.1") from None
    engine_shutdown, invalid = errors.EngineShutdown, errors.InvalidArgument

    async def generate(request: Any, context: Any) -> AsyncIterator[dict[str, Any]]:
        request_id = str(context.id())
        try:
            prompt, sampling = request_of(request)
            deltas = stream(prompt, sampling, request_id, {})
        except RequestRejected as exc:
            raise invalid(str(exc)) from exc
        monitor = asyncio.ensure_future(_stopped(context, shutdown_event))
        monitor.add_done_callback(lambda done: done.cancelled() or abort(request_id))
        produced = 0
        try:
            async for delta in deltas:
                produced += delta.tokens
                chunk: dict[str, Any] = {"index": 0, "token_ids": [token] * delta.tokens}
                if delta.finish_reason is not None:
                    chunk["finish_reason"] = delta.finish_reason
                    chunk["completion_usage"] = {
                        "prompt_tokens": len(prompt), "completion_tokens": produced,
                        "total_tokens": len(prompt) + produced}
                yield chunk
        except RequestAborted:
            if shutdown_event.is_set():
                raise engine_shutdown("Engine was shut down during generation.") from None
            yield {"index": 0, "token_ids": [], "finish_reason": "cancelled"}
        except RequestRejected as exc:
            raise invalid(str(exc)) from exc
        finally:  # the engine drops a request whose stream is closed early
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
            close = getattr(deltas, "aclose", None)
            if close is not None:
                await close()

    return generate
