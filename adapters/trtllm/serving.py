"""A TensorRT-LLM ``LLM`` behind the reference worker (``quiesce serve --engine trtllm``).

Builds the engine (PyTorch backend) from a model path in the **single-process** layout
(``TLLM_WORKER_USE_SINGLE_PROCESS=1`` unless the operator set it): the ``PyExecutor``
then lives in the worker's own process, so the probe is the authoritative in-process one
(:class:`~.probe.InProcessProbe`) and there is no engine process that a signal could
reach on its own. This layout runs TP=1; larger models need the Ray layout, which this
serving module does not build. TensorRT-LLM is imported only in :meth:`start`, which
also runs the drift check (:func:`~.doctor.startup_check`) and logs its verdict.

Signals: the ``LLM`` is built off the event loop, so TensorRT-LLM cannot install
Python signal handlers of its own while it starts (``signal.signal`` works only on the
main thread); :meth:`start` still compares the main thread's SIGTERM/SIGINT handlers
before and after and puts the worker's back if they changed, logging it. A handler
installed natively (``sigaction`` from C) is invisible to this check.

Disaggregated serving: a request's ``kv_transfer_params`` become TensorRT-LLM's
``DisaggregatedParams`` (the fields in :data:`DISAGG_FIELDS`; the binary ``opaque_state``
travels as base64 in ``opaque_state_b64``). A prefill worker sends ``request_type
"context_only"`` by default; a context-only request runs with ``max_tokens=1`` (the
prompt's KV and the first token; the decode worker generates the rest), and its last
delta carries the context's parameters with ``request_type "generation_only"``, ready for
the decode worker's request. Both sides
need a KV cache transceiver: ``cache_transceiver_config`` (a mapping for
``CacheTransceiverConfig``), ``{"backend": "DEFAULT"}`` when unset for a prefill or
decode role. A prefill worker runs with ``disable_overlap_scheduler=True`` unless told
otherwise (1.2-era context workers require it).

Defaults that apply only when the operator set nothing for them: ``max_seq_len`` is the
model's (TensorRT-LLM derives it); ``gpu_memory_fraction`` (the share of free GPU memory
the KV cache takes, ``kv_cache_config.free_gpu_memory_fraction``) is TensorRT-LLM's.

Error mapping (the contract of :class:`~quiesce.serve.openai_api.ServingEngine`): finish
reason ``stop``/``length`` ends the stream normally, and so does ``not_finished`` on a
context-only request (how TensorRT-LLM ends a prefill whose KV waits for the decode
worker): it is reported as ``length`` (completed; the prefill produced the one token it
was asked for) and carries the transfer parameters. ``not_finished`` on any other
request, and any other finish reason
(``cancelled``, ``timeout``), an error response (``RequestError``), a dead or shut-down
executor, and a stream that fails part-way raise :class:`~quiesce.errors.RequestAborted`
(lost); sampling parameters TensorRT-LLM refuses, ``max_tokens`` over the context
length, malformed ``kv_transfer_params`` and input ``generate_async`` refuses before
enqueuing it (it checks prompt length synchronously) raise
:class:`~quiesce.errors.RequestRejected`. A client that leaves aborts its request in
the engine.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import importlib.util
import logging
import os
import signal
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Final

from quiesce.errors import ConfigError, EngineNotInstalled, RequestAborted, RequestRejected
from quiesce.generation import FINISHED_BY_ENGINE, Delta, Prompt, Sampling, chat_prompt, model_names
from quiesce.probe import Probe, Role

from .control import TrtllmEngineControl
from .doctor import DriftReport, startup_check
from .probe import probe_for_llm

log = logging.getLogger("quiesce.adapters.trtllm.serving")

SINGLE_PROCESS_ENV: Final = "TLLM_WORKER_USE_SINGLE_PROCESS"
DISAGG_FIELDS: Final = ("request_type", "first_gen_tokens", "ctx_request_id", "draft_tokens",
                        "disagg_request_id", "ctx_dp_rank", "ctx_info_endpoint")
OPAQUE_KEY: Final = "opaque_state_b64"
REQUEST_TYPES: Final = ("context_only", "generation_only", "context_and_generation")
CONTEXT_DONE: Final = "not_finished"
"""The finish reason TensorRT-LLM gives a context-only request whose prefill is done
(``GenerationResult._handle_sequence``: ``NOT_FINISHED`` for ``request_type
"context_only"``); the decode worker finishes it."""
_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)


def disaggregated_kwargs(params: Mapping[str, Any], role: Role) -> dict[str, Any] | None:
    """``DisaggregatedParams`` keyword arguments from a request's ``kv_transfer_params``;
    None for a plain request. Raises RequestRejected naming what is wrong."""
    if not params and role is not Role.PREFILL:
        return None
    unknown = sorted(set(params) - {*DISAGG_FIELDS, OPAQUE_KEY})
    if unknown:
        raise RequestRejected(f"kv_transfer_params: unknown field(s) {unknown}; TensorRT-LLM "
                              f"takes {[*DISAGG_FIELDS, OPAQUE_KEY]}")
    kwargs = {k: v for k, v in params.items() if k in DISAGG_FIELDS}
    if OPAQUE_KEY in params:
        try:
            kwargs["opaque_state"] = base64.b64decode(str(params[OPAQUE_KEY]), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RequestRejected(f"kv_transfer_params.{OPAQUE_KEY} is not base64: {exc}"
                                  ) from None
    kind = kwargs.setdefault("request_type", "context_only" if role is Role.PREFILL else None)
    if kind not in REQUEST_TYPES:
        raise RequestRejected(f"kv_transfer_params.request_type must be one of "
                              f"{REQUEST_TYPES}, got {kind!r}")
    return kwargs


def transfer_params_out(params: Any) -> dict[str, Any] | None:
    """The context's ``DisaggregatedParams`` as JSON-ready ``kv_transfer_params`` for the
    decode worker's request (``request_type`` ``generation_only``); None if there are none."""
    if params is None:
        return None
    out: dict[str, Any] = {}
    for name in DISAGG_FIELDS:
        value = getattr(params, name, None)
        if value is not None:
            out[name] = list(value) if isinstance(value, (list, tuple)) else value
    opaque = getattr(params, "opaque_state", None)
    if isinstance(opaque, (bytes, bytearray)):
        out[OPAQUE_KEY] = base64.b64encode(bytes(opaque)).decode("ascii")
    out["request_type"] = "generation_only"
    return out


def restore_signal_handlers(before: Mapping[signal.Signals, Any]) -> list[str]:
    """Put back the handlers of ``before`` that changed; returns the signals' names."""
    changed = []
    for sig, handler in before.items():
        if signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
            changed.append(sig.name)
    return changed


class TrtllmServing:
    """:class:`~quiesce.serve.openai_api.ServingEngine` over ``tensorrt_llm.LLM`` (module
    docstring)."""

    def __init__(self, model: str, role: Role | str = Role.AGGREGATED, *,
                 max_model_len: int | None = None, served_model_name: str | None = None,
                 cache_transceiver_config: Mapping[str, Any] | None = None,
                 gpu_memory_fraction: float | None = None, **llm_args: Any) -> None:
        """``llm_args`` go to ``tensorrt_llm.LLM`` as they are (e.g. ``kv_cache_config`` as a
        mapping, ``disable_overlap_scheduler``); ``max_model_len`` becomes ``max_seq_len``.
        Raises ConfigError for an invalid value, before anything starts."""
        if max_model_len is not None and (isinstance(max_model_len, bool) or max_model_len < 1):
            raise ConfigError("max_model_len", f"must be >= 1, got {max_model_len!r}")
        if gpu_memory_fraction is not None and not 0 < gpu_memory_fraction <= 1:
            raise ConfigError("gpu_memory_fraction",
                              f"must be in (0, 1], got {gpu_memory_fraction!r}")
        if cache_transceiver_config is not None and not isinstance(cache_transceiver_config,
                                                                   Mapping):
            raise ConfigError("cache_transceiver_config", "must be a mapping")
        self.model = model
        self.role = Role.parse(role)
        self.max_model_len = max_model_len
        self.model_names = model_names(model, served_model_name)
        self.cache_transceiver_config = cache_transceiver_config
        self.gpu_memory_fraction = gpu_memory_fraction
        self.llm_args = llm_args
        self.llm: Any = None
        self.drift: DriftReport | None = None
        self._probe: Probe | None = None
        self._control: TrtllmEngineControl | None = None
        self._context: int | None = None

    @property
    def probe(self) -> Probe:
        if self._probe is None:
            raise RuntimeError("start() the TensorRT-LLM engine first")
        return self._probe

    @property
    def control(self) -> TrtllmEngineControl:
        if self._control is None:
            raise RuntimeError("start() the TensorRT-LLM engine first")
        return self._control

    def _llm_kwargs(self) -> dict[str, Any]:
        from tensorrt_llm.llmapi import CacheTransceiverConfig  # noqa: PLC0415 (optional engine)

        kwargs = dict(self.llm_args)
        if self.max_model_len is not None:
            kwargs["max_seq_len"] = self.max_model_len
        if self.gpu_memory_fraction is not None:
            kv = kwargs.get("kv_cache_config")
            if kv is not None and not isinstance(kv, Mapping):
                raise ConfigError("kv_cache_config", "give a mapping to combine it with "
                                                     "gpu_memory_fraction")
            kwargs["kv_cache_config"] = {**(kv or {}),
                                         "free_gpu_memory_fraction": self.gpu_memory_fraction}
        if self.role is Role.PREFILL:
            kwargs.setdefault("disable_overlap_scheduler", True)
        config = self.cache_transceiver_config
        if config is None and self.role is not Role.AGGREGATED:
            config = {"backend": "DEFAULT"}
        if config is not None:
            try:
                kwargs["cache_transceiver_config"] = CacheTransceiverConfig(**config)
            except (TypeError, ValueError) as exc:
                raise ConfigError("cache_transceiver_config",
                                  f"not a valid CacheTransceiverConfig: {exc}") from exc
        return kwargs

    async def start(self) -> None:
        """Check for drift, build the engine, keep the worker's signal handlers.
        Raises EngineNotInstalled, or ConfigError for an invalid transceiver config."""
        if importlib.util.find_spec("tensorrt_llm") is None:
            raise EngineNotInstalled("trtllm", "tensorrt_llm", "trtllm")
        if os.environ.setdefault(SINGLE_PROCESS_ENV, "1") != "1":
            log.warning("%s=%s: TensorRT-LLM runs its executor in other processes, where "
                        "only the weak statistics probe can see it", SINGLE_PROCESS_ENV,
                        os.environ[SINGLE_PROCESS_ENV])
        self.drift = await asyncio.to_thread(startup_check)
        before = {sig: signal.getsignal(sig) for sig in _SIGNALS}
        from tensorrt_llm import LLM  # noqa: PLC0415 (optional engine; on the main thread)

        kwargs = self._llm_kwargs()
        self.llm = await asyncio.to_thread(LLM, model=self.model, **kwargs)
        changed = restore_signal_handlers(before)
        if changed:
            log.warning("TensorRT-LLM replaced the %s handler(s) while starting; the "
                        "worker's were put back (the worker owns the shutdown)",
                        "/".join(changed))
        context = self.max_model_len or getattr(getattr(self.llm, "args", None),
                                                "max_seq_len", None)
        self._context = context if isinstance(context, int) else None
        self._probe = probe_for_llm(self.llm, self.role)
        self._control = TrtllmEngineControl(self.llm)

    def _tokenizer(self) -> Any:
        tokenizer = self.llm.tokenizer
        return getattr(tokenizer, "tokenizer", tokenizer)  # TensorRT-LLM wraps HF's

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The conversation through the chat template. RequestRejected when there is none
        or it fails."""
        return chat_prompt(self._tokenizer(), messages)

    def stream(self, prompt: Prompt, sampling: Sampling, request_id: str,
               kv_transfer_params: Mapping[str, Any]) -> AsyncIterator[Delta]:
        """Check the parameters (RequestRejected now), then start the request when the
        stream is first read (see the module docstring for the error mapping)."""
        from tensorrt_llm import SamplingParams  # noqa: PLC0415 (optional engine)

        context = self._context
        if sampling.max_tokens is not None and context is not None \
                and sampling.max_tokens > context:
            raise RequestRejected(f"max_tokens ({sampling.max_tokens}) is more than this "
                                  f"model's context length ({context})")
        disagg = disaggregated_kwargs(kv_transfer_params, self.role)
        kwargs = sampling.engine_kwargs()
        if disagg is not None and disagg["request_type"] == "context_only":
            kwargs["max_tokens"] = 1  # the prompt's KV and the first token (module docstring)
        elif kwargs["max_tokens"] is None:
            del kwargs["max_tokens"]
            if context is not None:  # "up to the context length"
                ids = prompt if isinstance(prompt, tuple) else \
                    self._tokenizer().encode(prompt)
                kwargs["max_tokens"] = max(1, context - len(ids))
        try:
            params = SamplingParams(**kwargs)
        except (TypeError, ValueError) as exc:
            raise RequestRejected(f"invalid sampling parameters for TensorRT-LLM: {exc}"
                                  ) from exc
        engine_prompt: Any = prompt if isinstance(prompt, str) else list(prompt)
        return self._deltas(engine_prompt, params, disagg, request_id)

    def _submit(self, prompt: Any, params: Any, disagg: dict[str, Any] | None) -> Any:
        from tensorrt_llm.disaggregated_params import (  # noqa: PLC0415 (optional engine)
            DisaggregatedParams,
        )

        extra: dict[str, Any] = {}
        if disagg is not None:
            try:
                extra["disaggregated_params"] = DisaggregatedParams(**disagg)
            except (TypeError, ValueError) as exc:
                raise RequestRejected(f"invalid kv_transfer_params: {exc}") from exc
        try:
            return self.llm.generate_async(prompt, sampling_params=params, streaming=True,
                                           **extra)
        except (TypeError, ValueError) as exc:  # checked before it was enqueued
            raise RequestRejected(str(exc)) from exc
        except Exception as exc:  # e.g. the executor is shut down or dead
            raise RequestAborted(f"TensorRT-LLM refused the request: {exc!r}") from exc

    async def _deltas(self, prompt: Any, params: Any, disagg: dict[str, Any] | None,
                      request_id: str) -> AsyncIterator[Delta]:
        result = self._submit(prompt, params, disagg)
        context_only = disagg is not None and disagg.get("request_type") == "context_only"
        text, tokens, finished = "", 0, False
        try:
            async for output in result:
                completion = output.outputs[0]
                reason = completion.finish_reason
                if reason == CONTEXT_DONE and context_only:
                    reason = "length"  # the prefill ended as asked (module docstring)
                if reason is not None and reason not in FINISHED_BY_ENGINE:
                    finished = True  # the engine ended it: nothing left to abort
                    raise RequestAborted(f"request {request_id} ended by TensorRT-LLM "
                                         f"(finish reason {reason!r})")
                new_text, new_tokens = str(completion.text), len(completion.token_ids)
                piece = new_text[len(text):] if new_text.startswith(text) else new_text
                last = reason is not None
                prompt_ids = getattr(output, "prompt_token_ids", None)
                disagg_out = getattr(completion, "disaggregated_params", None) or \
                    getattr(output, "disaggregated_params", None)
                delta = Delta(piece, new_tokens - tokens, reason,
                              len(prompt_ids) if last and prompt_ids is not None else None,
                              transfer_params_out(disagg_out) if last else None)
                text, tokens, finished = new_text, new_tokens, last
                yield delta
        except (RequestAborted, RequestRejected):
            raise
        except Exception as exc:  # RequestError, a dead executor, a failure part-way
            finished = True
            raise RequestAborted(f"request {request_id}: TensorRT-LLM failed it "
                                 f"({type(exc).__name__}: {exc})") from exc
        finally:
            if not finished:  # the client left (or the worker closed the stream)
                abort = getattr(result, "abort", None)
                if callable(abort):
                    abort()
