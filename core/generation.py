"""One generation request between the serving face and an engine: what is asked, what comes back.

Engine-neutral and standard library only, so that the OpenAI-compatible face
(:mod:`quiesce.serve.openai_api`) and every serving adapter (``SimServing``,
``VllmServing``) share it without importing each other:

- :class:`Sampling` is what the request asks of the sampler. Field names are vLLM's
  ``SamplingParams`` names; ``None`` means "not set by the request", and an engine then
  uses its own default. Built by one function in the face
  (:func:`quiesce.serve.openai_protocol.sampling_from`); each engine honours it or raises
  :class:`~quiesce.errors.RequestRejected` naming what it cannot honour.
- :class:`Delta` is one piece of the engine's output: new text, how many tokens it
  holds, and on the last piece the finish reason, the prompt's token count and the KV
  transfer parameters the engine returned (a prefill worker's handle for its decoder).
- :func:`model_names` and :func:`chat_prompt` are what every engine adapter does alike
  with a model path and a Hugging Face tokenizer.

An engine stream is ``AsyncIterator[Delta]`` whose last item carries ``finish_reason``.
It raises :class:`~quiesce.errors.RequestAborted` when the engine ended the request
itself (abort, engine death) and :class:`~quiesce.errors.RequestRejected` when the
request's own input is invalid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any

from .errors import RequestRejected

Prompt = str | tuple[int, ...]
"""A prompt: text, or token ids (as OpenAI's completions API accepts them)."""

FINISHED_BY_ENGINE = frozenset({"stop", "length"})
"""Finish reasons that mean the engine finished the request itself: ``completed``."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one request (vLLM's names). ``None``: the engine's default.

    ``max_tokens=None`` means "up to the context length" (vLLM) or the engine's own cap.
    ``ignore_eos`` with ``max_tokens=N`` asks for exactly ``N`` tokens, unless a stop
    string or the context length ends the request first.
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None

    def engine_kwargs(self) -> dict[str, Any]:
        """The parameters the request set, by vLLM's ``SamplingParams`` keyword names.

        Unset optional knobs are left out, so the engine's defaults apply to them.
        """
        out: dict[str, Any] = {"max_tokens": self.max_tokens, "min_tokens": self.min_tokens,
                               "ignore_eos": self.ignore_eos, "stop": list(self.stop)}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


@dataclasses.dataclass(frozen=True)
class Delta:
    """One piece of a request's output. The last piece of a stream has ``finish_reason``.

    ``tokens`` counts the tokens this piece adds (its text may be empty while a stop
    string is still possible). ``prompt_tokens`` and ``kv_transfer_params`` are set on
    the last piece when the engine knows them.
    """

    text: str
    tokens: int
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    kv_transfer_params: Mapping[str, Any] | None = None


def model_names(model: str, served_model_name: str | None) -> tuple[str, str]:
    """The names a served model answers to (``ServingEngine.model_names``): first the name
    the worker reports, ``served_model_name`` or else the last component of the ``model``
    path (``model`` itself when it has none); then ``model`` as given."""
    return (served_model_name or PurePath(model).name or model, model)


def chat_prompt(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> str:
    """``messages`` through ``tokenizer``'s chat template, with the generation prompt, as
    text (a Hugging Face tokenizer's ``apply_chat_template``).

    Raises :class:`~quiesce.errors.RequestRejected` when there is no tokenizer (``None``)
    or it has no chat template, and when the template fails on these messages.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise RequestRejected("this model has no chat template: use /v1/completions, "
                              "or serve a model with a chat template")
    try:
        text = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:
        raise RequestRejected(f"the chat template failed on these messages: {exc}") from exc
    return str(text)
