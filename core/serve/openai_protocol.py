"""Request bodies of the reference worker's OpenAI-compatible API, and the one mapping from a
request to the engine's :class:`~quiesce.generation.Sampling`.

The models forbid unknown fields, as vLLM's own server can: a parameter the worker does
not know is a 400 naming it, never silently dropped (a load generator that asks for
``ignore_eos`` must get it, or be told). Besides OpenAI's fields they accept vLLM's
sampling extensions that benchmark clients send (``ignore_eos``, ``min_tokens``,
``top_k``, ``min_p``, ``repetition_penalty``), ``request_id`` and ``kv_transfer_params``
(handed to the engine as vLLM's server does; a prefill worker's answer carries the
engine's own ``kv_transfer_params`` back). Only what the worker can honour is accepted:
``n`` must be 1, ``logprobs`` must be absent (or null/false), one prompt per request.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from quiesce.generation import Prompt, Sampling

MAX_TOKENS_LIMIT = 1 << 20
"""Largest ``max_tokens`` accepted at all; the engine refuses what exceeds its context."""
MAX_STOP_STRINGS = 16
INT64 = 1 << 63


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """``include_usage``: a last chunk with ``usage`` and no choices (as OpenAI sends it);
    ``continuous_usage_stats`` (vLLM): ``usage`` on every chunk too."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class GenerationRequest(_Strict):
    """Fields both routes share. Values out of range are refused with their name."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    user: str | None = None
    request_id: str | None = Field(default=None, min_length=1, max_length=200)
    kv_transfer_params: dict[str, Any] | None = Field(
        default=None, description="Handed to the engine (vLLM: its KV connector; sim: "
                                  "do_remote_decode holds the KV for a decoder, "
                                  "do_remote_prefill awaits it, sim_never_pulled: the "
                                  "decoder never pulls).")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else (value or [])
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in strings):
            raise ValueError("a stop string must not be empty")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream=true")
        limit = self.max_new_tokens()
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                             f"({limit})")
        return self

    def max_new_tokens(self) -> int | None:
        """The request's output limit; ``None``: up to the engine's own limit."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: one prompt (text or token ids); ``max_tokens`` 16 unless set."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = None
    echo: bool = False

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("logprobs are not supported by this worker")
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported by this worker")
        return value

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str] | list[int] | list[list[int]]
                    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)) \
                and len(value) != 1:
            raise ValueError("one prompt per request (batches are not supported)")
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        return value

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def engine_prompt(self) -> Prompt:
        """The prompt as the engine takes it: text, or a tuple of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list):
            return tuple(first)
        return tuple(token for token in prompt if isinstance(token, int))


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One message; content is text, or a list of text parts (joined by newlines)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``: ``max_completion_tokens`` (or the older ``max_tokens``);
    unset, the engine's limit (the context length on vLLM)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("logprobs are not supported by this worker")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("top_logprobs are not supported by this worker")
        return value

    def max_new_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        """The conversation as ``{"role", "content"}`` dicts, as chat templates take it."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def sampling_from(request: GenerationRequest) -> Sampling:
    """The request's sampling parameters, engine-neutral. Every engine honours the result
    or refuses it with :class:`~quiesce.errors.RequestRejected`; nothing is dropped."""
    stop = request.stop
    return Sampling(
        max_tokens=request.max_new_tokens(), min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
        min_p=request.min_p, seed=request.seed, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty)
