"""A test KV connector that moves no KV and only paces the engine: every model step
takes at least ``kv_connector_extra_config["step_s"]`` seconds.

The tiny test model generates a token in well under a millisecond on the CPU, so a
stream ends before its client has even read its first event, and "a signal under
streaming load" would be a matter of luck. With a floor under each step, requests stay
in the engine for a predictable time. Finished requests' blocks are freed at once (no
hold). Loaded by vLLM through ``kv_connector_module_path`` in the model runner
(worker side) and in EngineCore (scheduler side).
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)


class _NoMetadata(KVConnectorMetadata):
    pass


class PacedConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._step_s = float(extra.get("step_s", 0.01))
        self._step_started = 0.0

    # -- scheduler side (EngineCore) ---------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _NoMetadata()

    # -- worker side: the step starts at start_load_kv and ends at wait_for_save -------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._step_started = time.monotonic()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        left = self._step_s - (time.monotonic() - self._step_started)
        if left > 0:
            time.sleep(left)
