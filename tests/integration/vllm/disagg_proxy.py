"""A tiny disaggregated proxy for the tests: prefill on one worker, decode on another.

It does what vLLM's toy disaggregated proxy does for a completion, with httpx and in
process (no server of its own): send the request to the prefill worker with
``max_tokens=1``, ``stream=False`` and ``kv_transfer_params`` asking for a remote decode;
take the ``kv_transfer_params`` of that answer (where the decoder finds the KV: engine id,
block ids, host and port of the prefill worker's NIXL side channel); send the original
request, streaming, with those parameters to the decode worker, which pulls the KV over
NIXL and generates. ``hold`` lets a test decide when the decode side asks (a decoder that
is slow to pull); the proxy reads the decode stream to its end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from typing import Any

import httpx

REMOTE_DECODE: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""The prefill request's ``kv_transfer_params``: finish after prefill, hold the KV for a
decoder that will pull it (the decoder's address is not known yet)."""


class ProxyError(RuntimeError):
    """A worker answered the proxy with something other than what the protocol needs."""


@dataclasses.dataclass
class DecodeStream:
    """The decode worker's stream, as the proxy read it to the end."""

    status: int
    chunks: int = 0
    """Chunks with a choice (one or more tokens each: the engine may merge deltas)."""
    completion_tokens: int | None = None
    """From the usage chunk the proxy asks for (``stream_options.include_usage``)."""
    text: str = ""
    finish_reason: str | None = None
    done: bool = False
    """``data: [DONE]`` arrived: the stream ended normally."""
    error: str | None = None
    """The type of an error event in the stream, the body of a non-200 answer, or a
    transport error (the worker went away mid-stream)."""

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.done and self.error is None


class DisaggProxy:
    """Sends each completion to ``prefill_url`` then ``decode_url`` (``/v1/completions``)."""

    def __init__(self, prefill_url: str, decode_url: str, timeout_s: float = 120.0) -> None:
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.timeout_s = timeout_s
        self.waiting_to_decode = 0
        """Requests whose prefill answered and whose decode has not been sent yet."""

    async def prefill(self, body: dict[str, Any]) -> dict[str, Any]:
        """The prefill leg; returns the ``kv_transfer_params`` the decoder needs."""
        request = {**body, "max_tokens": 1, "stream": False,
                   "kv_transfer_params": dict(REMOTE_DECODE)}
        request.pop("stream_options", None)
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            answer = await client.post(f"{self.prefill_url}/v1/completions", json=request)
        if answer.status_code != 200:
            raise ProxyError(f"prefill answered {answer.status_code}: {answer.text}")
        params = answer.json().get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            raise ProxyError(f"prefill answer has no usable kv_transfer_params: {answer.text}")
        return params

    async def decode(self, body: dict[str, Any], kv_params: dict[str, Any]) -> DecodeStream:
        """The decode leg, streaming, read to the end."""
        request = {**body, "stream": True, "stream_options": {"include_usage": True},
                   "kv_transfer_params": kv_params}
        result = DecodeStream(status=0)
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client, \
                    client.stream("POST", f"{self.decode_url}/v1/completions",
                                  json=request) as answer:
                result.status = answer.status_code
                if answer.status_code != 200:
                    await answer.aread()
                    result.error = answer.text
                    return result
                async for line in answer.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        result.done = True
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = str(chunk["error"].get("type"))
                        continue
                    usage = chunk.get("usage")
                    if isinstance(usage, dict):
                        result.completion_tokens = usage.get("completion_tokens")
                    if not chunk.get("choices"):
                        continue
                    choice = chunk["choices"][0]
                    result.chunks += 1
                    result.text += choice.get("text") or ""
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
        except httpx.TransportError as exc:
            result.error = f"transport error: {exc!r}"
        return result

    async def complete(self, body: dict[str, Any],
                       hold: asyncio.Event | None = None) -> DecodeStream:
        """One completion through both workers; the decode leg waits for ``hold`` if given."""
        kv_params = await self.prefill(body)
        if hold is not None:
            self.waiting_to_decode += 1
            try:
                await hold.wait()
            finally:
                self.waiting_to_decode -= 1
        return await self.decode(body, kv_params)


def prompt() -> str:
    """A fresh prompt per request, so that the decoder's own prefix cache never hits."""
    words = " ".join(f"w{n}" for n in uuid.uuid4().bytes[:12])
    return f"hello world the quick brown fox {words} jumps over the lazy dog"


def completion(max_tokens: int = 12) -> dict[str, Any]:
    """One completion of ``max_tokens`` tokens exactly (``ignore_eos``), on a fresh prompt."""
    return {"prompt": prompt(), "max_tokens": max_tokens, "ignore_eos": True}
