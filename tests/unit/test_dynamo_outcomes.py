"""How a Dynamo handler's stream says it ended (:mod:`quiesce.adapters.dynamo.outcomes`),
on chunks shaped as ai-dynamo 1.6.1's handlers yield them (read from its source; the
prefill handoff shape is checked against the installed source by
tests/integration/dynamo/test_contract_sglang.py)."""

from __future__ import annotations

from typing import Any

import pytest

from quiesce.adapters.dynamo.gated import gated
from quiesce.adapters.dynamo.outcomes import handoff_outcome, sglang_outcome
from quiesce.admission import AdmissionGate, Outcome
from tests.unit.dynamo_fakes import FakeContext

VLLM_PREFILL: dict[str, Any] = {"token_ids": [7],
                                "disaggregated_params": {"kv_transfer_params": {}},
                                "completion_usage": {"prompt_tokens": 3}}
"""dynamo.vllm's PrefillWorkerHandler: no finish reason, the KV parameters handed over."""
SGLANG_BOOTSTRAP: dict[str, Any] = {"token_ids": [], "text": None, "finish_reason": None,
                    "disaggregated_params": {"bootstrap_room": 1}}


@pytest.mark.parametrize("chunk,stopped,expected", [
    (VLLM_PREFILL, False, Outcome.COMPLETED),
    (SGLANG_BOOTSTRAP, False, Outcome.COMPLETED),
    ({"token_ids": [5], "finish_reason": "length", "disaggregated_params": {}}, False,
     Outcome.COMPLETED),  # TensorRT-LLM's prefill states its finish reason
    ({"token_ids": [], "finish_reason": {"error": "x"}, "disaggregated_params": {"a": 1}},
     False, Outcome.LOST),
    ({"token_ids": [1]}, False, None),
    ({"token_ids": [], "disaggregated_params": None}, False, None),
])
def test_a_prefill_stream_is_done_once_it_handed_over_the_kv_parameters(
        chunk: dict[str, Any], stopped: bool, expected: Outcome | None) -> None:
    assert handoff_outcome(chunk, FakeContext("p", stopped)) is expected


@pytest.mark.parametrize("chunk,stopped,expected", [
    ({"token_ids": [2], "finish_reason": "stop"}, False, Outcome.COMPLETED),  # token stream
    ({"token_ids": [], "finish_reason": "cancelled"}, True, Outcome.CLIENT_GONE),
    ({"token_ids": [], "finish_reason": "cancelled"}, False, Outcome.LOST),
    ({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "length"}]},
     False, Outcome.COMPLETED),  # --use-sglang-tokenizer text stream
    ({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]},
     False, None),
    ({"engine_data": {"sglang_response": {"meta_info": {"finish_reason": {
        "type": "stop"}}}}}, False, Outcome.COMPLETED),  # native Generate
    ({"engine_data": {"sglang_response": {"meta_info": {"finish_reason": {
        "type": "abort", "message": "x"}}}}}, False, Outcome.LOST),
    ({"text": "x", "meta_info": {"finish_reason": {"type": "length"}}}, False,
     Outcome.COMPLETED),  # the health canary's raw engine output
    ({"text": "x", "meta_info": {"finish_reason": None}}, False, None),
    (SGLANG_BOOTSTRAP, False, Outcome.COMPLETED),
    ("not a mapping", False, None),
])
def test_every_sglang_chunk_shape_states_its_outcome(chunk: Any, stopped: bool,
                                                     expected: Outcome | None) -> None:
    assert sglang_outcome(chunk, FakeContext("s", stopped)) is expected


async def test_a_vllm_prefill_stream_counts_completed_not_lost() -> None:
    """Before the handoff reading, every dynamo.vllm prefill request was counted lost
    (its chunks carry no finish reason), so a prefill worker's drain ended ``lost``."""
    gate = AdmissionGate()

    async def generate(request: dict[str, Any], context: FakeContext) -> Any:
        yield VLLM_PREFILL

    handler = gated(generate, gate, outcome=handoff_outcome)
    assert [c async for c in handler({}, FakeContext("p1"))] == [VLLM_PREFILL]
    assert gate.outcomes().completed == 1 and gate.outcomes().lost == 0
