"""A vLLM ``AsyncLLM`` behind the reference worker (``quiesce serve --engine vllm``).

Builds the engine from a model path, streams completions as text pieces, and exposes
the probe (:class:`~.probe.VllmProbe`) and the control (:class:`~.control.VllmEngineControl`)
the lifecycle and the shutdown use. vLLM is imported only when the engine starts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from quiesce.errors import RequestAborted
from quiesce.probe import Role

from .control import VllmEngineControl
from .probe import VllmProbe


class VllmServing:
    def __init__(self, model: str, role: Role | str = Role.AGGREGATED, *,
                 max_model_len: int = 2048, shutdown_timeout_s: float | None = None,
                 **engine_args: Any) -> None:
        self.model = model
        self.role = Role.parse(role)
        self.max_model_len = max_model_len
        self.shutdown_timeout_s = shutdown_timeout_s
        self.engine_args = engine_args
        self.engine: Any = None
        self._probe: VllmProbe | None = None
        self._control: VllmEngineControl | None = None

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

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415 (optional engine)
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415

        args = AsyncEngineArgs(model=self.model, tokenizer=self.model,
                               max_model_len=self.max_model_len, **self.engine_args)
        self.engine = AsyncLLM.from_engine_args(args)
        self._probe = VllmProbe(self.engine, self.role)
        self._control = VllmEngineControl(self.engine, self.shutdown_timeout_s)

    async def stream(self, prompt: str, max_tokens: int, request_id: str,
                     kv_transfer_params: Mapping[str, Any]
                     ) -> AsyncIterator[tuple[str, str | None]]:
        """Text pieces and, on the last, vLLM's finish reason. Raises RequestAborted."""
        from vllm import SamplingParams  # noqa: PLC0415
        from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

        params = SamplingParams(
            max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": dict(kv_transfer_params)}
            if kv_transfer_params else None)
        async for output in self.engine.generate(prompt, params, request_id):
            completion = output.outputs[0]
            if completion.finish_reason == "abort":
                raise RequestAborted(f"request {request_id} aborted by the engine")
            yield completion.text, completion.finish_reason
