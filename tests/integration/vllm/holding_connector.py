"""A test KV connector that holds every finished request's KV blocks until released.

It stands in for a remote decoder that has not pulled yet, deterministically: the
scheduler side (in EngineCore) tells vLLM to delay freeing every finished request's
blocks; the worker side reports them as sent only once the file ``release`` exists in
``kv_connector_extra_config["release_dir"]`` (a file, because the two halves live in
different processes). Loaded by vLLM through ``kv_connector_module_path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)


class _NoMetadata(KVConnectorMetadata):
    pass


class HoldingConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self._release = Path(extra["release_dir"]) / "release"
        self._finished: set[str] = set()

    # -- scheduler side (EngineCore) ---------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _NoMetadata()

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return True, None  # hold: vLLM frees the blocks once get_finished reports the id

    # -- worker side ---------------------------------------------------------------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        self._finished |= finished_req_ids
        if not self._finished or not self._release.exists():
            return None, None
        done, self._finished = self._finished, set()
        return done, None
