"""A vLLM ``AsyncLLM`` behind the reference worker (``quiesce serve --engine vllm``).

Builds the engine from a model path, streams a request's output as
:class:`~quiesce.generation.Delta` pieces, and exposes the probe
(:class:`~.probe.VllmProbe`) and the control (:class:`~.control.VllmEngineControl`) the
lifecycle and the shutdown use. vLLM is imported only when the engine starts.

Defaults that let ``--model DIR`` alone start (each applies only when the operator set
nothing for it):

- ``max_model_len``: the model's own context length (vLLM derives it);
- on a CPU, ``dtype="auto"`` means float32: vLLM would choose bfloat16, and with
  bfloat16 on a CPU that reports AMX, vLLM 0.32's CPU attention picks its AMX kernel,
  which killed the engine with SIGILL on the VMs this was tested on;
- on a CPU, the KV cache gets :func:`cpu_kv_cache_bytes` (at most 4 GiB, at most a
  quarter of the memory available at start) unless ``VLLM_CPU_KVCACHE_SPACE``,
  ``kv_cache_memory_bytes`` or ``gpu_memory_utilization`` was given: vLLM's own default
  would reserve 92 % of the machine's memory and refuses to start when that much is not
  free.

Error mapping (the contract of :class:`~quiesce.serve.openai_api.ServingEngine`): finish
reason ``stop``/``length`` ends the stream normally; ``abort`` or ``error``, a dead
engine (``EngineDeadError``) and a failed generate (``EngineGenerateError``) raise
:class:`~quiesce.errors.RequestAborted`; sampling parameters vLLM refuses, a
``max_tokens`` over the context length, and input refused before any output (vLLM's
validation errors, e.g. a prompt longer than the context) raise
:class:`~quiesce.errors.RequestRejected`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from quiesce.errors import ConfigError, RequestAborted, RequestRejected
from quiesce.generation import FINISHED_BY_ENGINE, Delta, Prompt, Sampling, chat_prompt, model_names
from quiesce.probe import Role

from .control import VllmEngineControl
from .exit import track_shared_memory
from .probe import VllmProbe

log = logging.getLogger("quiesce.adapters.vllm.serving")

GIB = 1 << 30
CPU_KV_CACHE_MAX_BYTES = 4 * GIB
CPU_KV_CACHE_SHARE = 0.25
"""Default KV cache on a CPU: min(4 GiB, a quarter of the memory available at start)."""
CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                "frequency_penalty", "repetition_penalty")
"""Sampling knobs whose unset value takes the model's generation config (as vLLM's server)."""


def available_memory_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo``; None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_kv_cache_bytes(environ: Mapping[str, str], engine_args: Mapping[str, Any],
                       available: int | None) -> int | None:
    """The KV cache for a CPU engine when the operator sized none, else None (vLLM decides).

    The operator sized it with ``$VLLM_CPU_KVCACHE_SPACE`` (GiB), ``kv_cache_memory_bytes``
    or ``gpu_memory_utilization`` (on a CPU: the share of memory the engine reserves).
    Default: ``min(4 GiB, available / 4)``, or 4 GiB when the available memory is unknown.
    """
    if environ.get(CPU_KV_ENV, "") != "":
        return None
    if any(engine_args.get(name) is not None
           for name in ("kv_cache_memory_bytes", "gpu_memory_utilization")):
        return None
    if available is None:
        return CPU_KV_CACHE_MAX_BYTES
    return max(1, min(CPU_KV_CACHE_MAX_BYTES, int(available * CPU_KV_CACHE_SHARE)))


def _client_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the request's own input was refused."""
    errors: tuple[type[BaseException], ...] = (ValueError, TypeError)
    try:
        from vllm.exceptions import VLLMClientError  # noqa: PLC0415 (optional engine)
    except ImportError:  # version drift: plain ValueError still counts
        return errors
    return (*errors, VLLMClientError)


class VllmServing:
    def __init__(self, model: str, role: Role | str = Role.AGGREGATED, *,
                 max_model_len: int | None = None, shutdown_timeout_s: float | None = None,
                 served_model_name: str | None = None,
                 kv_transfer_config: Mapping[str, Any] | Any | None = None,
                 **engine_args: Any) -> None:
        """``kv_transfer_config``: a JSON-like mapping for vLLM's ``KVTransferConfig`` (as
        ``vllm serve --kv-transfer-config`` takes it) or a ``KVTransferConfig``; an invalid
        one raises :class:`ConfigError` from :meth:`start`. ``engine_args`` go to vLLM's
        ``AsyncEngineArgs``; the CPU defaults in the module docstring fill what is unset."""
        self.model = model
        self.role = Role.parse(role)
        self.max_model_len = max_model_len
        self.shutdown_timeout_s = shutdown_timeout_s
        self.model_names = model_names(model, served_model_name)
        self.kv_transfer_config = kv_transfer_config
        self.engine_args = engine_args
        self.engine: Any = None
        self._probe: VllmProbe | None = None
        self._control: VllmEngineControl | None = None
        self._defaults: dict[str, Any] = {}
        self._context = 0

    @property
    def probe(self) -> VllmProbe:
        if self._probe is None:
            raise RuntimeError("start() the vLLM engine first")
        return self._probe

    @property
    def control(self) -> VllmEngineControl:
        if self._control is None:
            raise RuntimeError("start() the vLLM engine first")
        return self._control

    def _resolved_args(self) -> dict[str, Any]:
        """The engine arguments with this module's defaults filled in (module docstring)."""
        from vllm.platforms import current_platform  # noqa: PLC0415 (optional engine)

        args = dict(self.engine_args)
        if current_platform.is_cpu():
            if args.get("dtype", "auto") == "auto":
                args["dtype"] = "float32"
            kv_bytes = cpu_kv_cache_bytes(os.environ, args, available_memory_bytes())
            if kv_bytes is not None:
                args["kv_cache_memory_bytes"] = kv_bytes
                log.info("CPU KV cache: %.2f GiB (quiesce's default; set $%s in GiB to "
                         "choose)", kv_bytes / GIB, CPU_KV_ENV)
        config = self.kv_transfer_config
        if isinstance(config, Mapping):
            from vllm.config import KVTransferConfig  # noqa: PLC0415

            try:
                config = KVTransferConfig(**config)
            except (TypeError, ValueError) as exc:
                raise ConfigError("kv_transfer_config",
                                  f"not a valid vLLM KVTransferConfig: {exc}") from exc
        if config is not None:
            args["kv_transfer_config"] = config
        return args

    async def start(self) -> None:
        """Build and start the engine. Raises ConfigError for an invalid KV transfer config."""
        from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415 (optional engine)
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415

        args = AsyncEngineArgs(model=self.model, tokenizer=self.model,
                               max_model_len=self.max_model_len, **self._resolved_args())
        # Engine processes are spawned, never forked, as `vllm serve` does too: a forked
        # child inherits vLLM's "plugins loaded" flag and would never run quiesce's plugin,
        # so its signal handlers would stay unguarded (vLLM forks by default on CUDA).
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        # Count the shared memory this process creates, so that its fast exit can tell
        # whether a segment still waits for its finalizer (.exit.end_process).
        track_shared_memory()
        # Off the event loop: loading the model takes long, and a signal meanwhile must
        # still reach the worker's handlers (a second one forces the exit).
        self.engine = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        self._context = int(self.engine.model_config.max_model_len)
        try:  # the model's generation config, as vLLM's own server applies it
            diff = self.engine.model_config.get_diff_sampling_param()
            self._defaults = {k: v for k, v in dict(diff).items() if k in _DEFAULTABLE}
        except Exception as exc:
            log.warning("the model's sampling defaults could not be read: %r", exc)
        self._probe = VllmProbe(self.engine, self.role)
        self._control = VllmEngineControl(self.engine, self.shutdown_timeout_s)

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The conversation through the tokenizer's chat template (with the generation
        prompt). Raises RequestRejected when the model has none, or the template fails."""
        return chat_prompt(self.engine.get_tokenizer(), messages)

    def stream(self, prompt: Prompt, sampling: Sampling, request_id: str,
               kv_transfer_params: Mapping[str, Any]) -> AsyncIterator[Delta]:
        """Start the request (see the module docstring for the error mapping).

        Parameters are checked here, before the stream starts; input the engine refuses
        surfaces from the stream's first step.
        """
        from vllm import SamplingParams  # noqa: PLC0415 (optional engine)
        from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

        if sampling.max_tokens is not None and sampling.max_tokens > self._context:
            raise RequestRejected(f"max_tokens ({sampling.max_tokens}) is more than this "
                                  f"model's context length ({self._context})")
        kwargs = {**self._defaults, **sampling.engine_kwargs()}
        try:
            params = SamplingParams(
                **kwargs, output_kind=RequestOutputKind.DELTA,
                extra_args={"kv_transfer_params": dict(kv_transfer_params)}
                if kv_transfer_params else None)
        except _client_errors() as exc:
            raise RequestRejected(f"invalid sampling parameters: {exc}") from exc
        engine_prompt: Any = (prompt if isinstance(prompt, str)
                              else {"prompt_token_ids": list(prompt)})
        return self._deltas(engine_prompt, params, request_id)

    async def _deltas(self, prompt: Any, params: Any, request_id: str
                      ) -> AsyncIterator[Delta]:
        from vllm.v1.engine.exceptions import (  # noqa: PLC0415 (optional engine)
            EngineDeadError,
            EngineGenerateError,
        )

        client_errors = _client_errors()
        produced = False
        try:
            async for output in self.engine.generate(prompt, params, request_id):
                completion = output.outputs[0]
                reason = completion.finish_reason
                if reason is not None and reason not in FINISHED_BY_ENGINE:
                    raise RequestAborted(f"request {request_id} ended by the engine "
                                         f"(finish reason {reason!r})")
                produced = True
                last = reason is not None
                prompt_ids = output.prompt_token_ids
                yield Delta(completion.text, len(completion.token_ids), reason,
                            len(prompt_ids) if last and prompt_ids is not None else None,
                            output.kv_transfer_params if last else None)
        except (RequestAborted, RequestRejected):
            raise
        except EngineDeadError as exc:
            raise RequestAborted(f"request {request_id}: the vLLM engine died") from exc
        except EngineGenerateError as exc:
            cause = exc.__cause__
            if not produced and isinstance(cause, client_errors):
                raise RequestRejected(str(cause)) from exc
            raise RequestAborted(f"request {request_id}: vLLM failed to generate "
                                 f"({cause!r})") from exc
        except client_errors as exc:
            if produced:  # the request was valid; the engine failed it part-way: lost
                raise RequestAborted(f"request {request_id}: vLLM failed it part-way "
                                     f"({exc!r})") from exc
            raise RequestRejected(str(exc)) from exc
        except Exception as exc:  # e.g. vLLM's queue limits: the engine refused it (lost)
            raise RequestAborted(f"request {request_id}: vLLM refused or failed it "
                                 f"({exc!r})") from exc
