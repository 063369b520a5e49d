"""How a Dynamo handler's stream says it ended (:mod:`quiesce.adapters.dynamo.outcomes`),
on chunks shaped as ai-dynamo 1.6.1's handlers yield them (read from its source; the
prefill chunks' shapes are checked against the installed source by
tests/integration/dynamo/test_contract_vllm.py and test_contract_sglang.py)."""

from __future__ import annotations

from typing import Any

import pytest

from quiesce.adapters.dynamo.gated import EngineEnds, gated
from quiesce.adapters.dynamo.outcomes import (
    sglang_final_outcome,
    sglang_outcome,
    vllm_prefill_outcome,
)
from quiesce.admission import AdmissionGate, Outcome
from tests.unit.dynamo_fakes import FakeContext

VLLM_PREFILL: dict[str, Any] = {"token_ids": [7],
                                "disaggregated_params": {"kv_transfer_params": {}},
                                "completion_usage": {"prompt_tokens": 3}}
"""dynamo.vllm's PrefillWorkerHandler after the prefill ran: no finish reason, its one
token, the KV parameters handed over."""
VLLM_PREFILL_ABORTED: dict[str, Any] = {"token_ids": [], "disaggregated_params": None,
                                        "completion_usage": {"prompt_tokens": 3}}
"""The same handler's chunk for a prefill the engine aborted (NIXL: no KV parameters)."""
SGLANG_BOOTSTRAP: dict[str, Any] = {"token_ids": [], "text": None, "finish_reason": None,
                                    "disaggregated_params": {"bootstrap_room": 1}}
"""dynamo.sglang's PrefillWorkerHandler, yielded before the prefill runs."""


@pytest.mark.parametrize("chunk,stopped,expected", [
    (VLLM_PREFILL, False, Outcome.COMPLETED),
    (VLLM_PREFILL_ABORTED, False, None),
    # an aborted prefill with a connector whose KV parameters do not depend on the
    # engine's output (Mooncake, LMCache): no token, so not completed
    ({**VLLM_PREFILL_ABORTED, "disaggregated_params": {"kv_transfer_params": {}}}, False,
     None),
    ({**VLLM_PREFILL, "disaggregated_params": {"embedding_params": {}}}, False, None),
    ({"token_ids": [], "finish_reason": {"error": "x"}, "disaggregated_params": {"a": 1}},
     False, Outcome.LOST),
    ({"token_ids": [1]}, False, None),
    (SGLANG_BOOTSTRAP, False, None),
])
def test_a_vllm_prefill_is_completed_only_once_the_engine_ran_it_and_handed_the_kv_over(
        chunk: dict[str, Any], stopped: bool, expected: Outcome | None) -> None:
    assert vllm_prefill_outcome(chunk, FakeContext("p", stopped)) is expected


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
    (SGLANG_BOOTSTRAP, False, None),  # before the prefill ran: says nothing
    ({"token_ids": [], "engine_data": {"kv_cache_hit": {"prompt_tokens": 3}}}, False, None),
    ("not a mapping", False, None),
])
def test_every_sglang_chunk_shape_states_its_outcome(chunk: Any, stopped: bool,
                                                     expected: Outcome | None) -> None:
    assert sglang_outcome(chunk, FakeContext("s", stopped)) is expected


@pytest.mark.parametrize("meta_info,stopped,expected", [
    ({"id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 3},
     False, Outcome.COMPLETED),
    ({"id": "r", "finish_reason": {"type": "abort", "message": "x"}}, False, Outcome.LOST),
    ({"id": "r", "finish_reason": {"type": "abort", "message": "x"}}, True,
     Outcome.CLIENT_GONE),
    (None, False, None),  # cancelled or never finished: the stream's end decides
])
def test_an_sglang_prefill_ends_as_its_final_meta_info_says(
        meta_info: Any, stopped: bool, expected: Outcome | None) -> None:
    assert sglang_final_outcome(meta_info, FakeContext("s", stopped)) is expected


async def test_a_vllm_prefill_stream_counts_completed_and_an_aborted_one_lost() -> None:
    """Every dynamo.vllm prefill chunk lacks a finish reason: the engine's token and the
    KV parameters make it completed; without them it is lost (client gone when the client
    stopped it), never completed."""
    gate = AdmissionGate()

    async def generate(request: dict[str, Any], context: FakeContext) -> Any:
        yield request["chunk"]

    handler = gated(generate, gate, outcome=vllm_prefill_outcome)
    for chunk, context in [(VLLM_PREFILL, FakeContext("p1")),
                           (VLLM_PREFILL_ABORTED, FakeContext("p2")),
                           (VLLM_PREFILL_ABORTED, FakeContext("p3", stopped=True))]:
        assert [c async for c in handler({"chunk": chunk}, context)] == [chunk]
    assert gate.outcomes().to_dict() == {"completed": 1, "lost": 1, "client_gone": 1,
                                         "rejected": 0}


async def test_an_engine_end_recorded_while_the_stream_runs_decides_and_nothing_outlives_it(
        ) -> None:
    """:class:`EngineEnds` as the SGLang prefill uses it: what the engine's own loop
    recorded for the request decides over the chunks; a record for a request whose
    stream is not open is dropped (nothing is kept past a stream)."""
    gate, ends = AdmissionGate(), EngineEnds()

    async def generate(request: dict[str, Any], context: FakeContext) -> Any:
        yield SGLANG_BOOTSTRAP
        if request.get("ended") is not None:
            ends.record(context, request["ended"])

    handler = gated(generate, gate, outcome=sglang_outcome, ends=ends)
    for ended in (Outcome.COMPLETED, Outcome.LOST, None):
        assert [c async for c in handler({"ended": ended}, FakeContext("p"))] == \
            [SGLANG_BOOTSTRAP]
    assert gate.outcomes().to_dict() == {"completed": 1, "lost": 2, "client_gone": 0,
                                         "rejected": 0}
    late = FakeContext("late")
    ends.record(late, Outcome.COMPLETED)  # not open: dropped
    assert ends.take(late) is None and ends._open == {}
