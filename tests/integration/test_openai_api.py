"""The reference worker's OpenAI-compatible API on the sim engine, in-process (httpx's
ASGI transport): every route, every error path, and how each admitted request ends.

The sim's text is deterministic (``" t1 t2 ..."``, one token per piece), so answers are
checked exactly. Every stream is read to its end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import httpx
import pytest

from quiesce.adapters.sim import SIM_DEFAULT_MAX_TOKENS, SimConfig, SimServing
from quiesce.admission import AdmissionGate, OutcomeCounts
from quiesce.errors import RequestAborted, RequestRejected
from quiesce.generation import Delta, Prompt, Sampling
from quiesce.serve.openai_api import create_completions_app
from quiesce.serve.openai_protocol import CompletionRequest, sampling_from

PROMPT = "hello world"  # two sim prompt tokens


class Served:
    """A started sim engine behind the serving app, and a client for it."""

    def __init__(self, serving: SimServing, model_name: str | None = None) -> None:
        self.serving = serving
        self.gate = AdmissionGate()
        self.app = create_completions_app(serving, self.gate, model_name)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                        base_url="http://test", timeout=30)

    def outcomes(self) -> OutcomeCounts:
        return self.gate.outcomes()

    async def stream(self, path: str, body: dict[str, Any]) -> list[Any]:
        """POST a streaming request; every event to the end (``"[DONE]"`` as a string)."""
        answer = await self.client.post(path, json={**body, "stream": True})
        assert answer.status_code == 200, answer.text
        assert answer.headers["content-type"].startswith("text/event-stream")
        events: list[Any] = []
        for line in answer.text.splitlines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
        return events


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    serving = SimServing(SimConfig(decode_step_s=0.001), name="api-test")
    await serving.start()
    server = Served(serving)
    try:
        yield server
    finally:
        await server.client.aclose()
        await serving.engine.shutdown()


def assert_error(answer: httpx.Response, status: int, kind: str) -> str:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"type", "message", "retryable"}, error
    assert error["type"] == kind, error
    message: str = error["message"]
    return message


def text_of(events: list[Any], chat: bool = False) -> str:
    pieces = []
    for event in events:
        if isinstance(event, dict) and event.get("choices"):
            choice = event["choices"][0]
            pieces.append(choice["delta"].get("content", "") if chat else choice["text"])
    return "".join(pieces)


def finish_reasons(events: list[Any]) -> list[str]:
    return [e["choices"][0]["finish_reason"] for e in events
            if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]]


# -- models --------------------------------------------------------------------------------


async def test_models_lists_the_served_model_name(served: Served) -> None:
    answer = await served.client.get("/v1/models")
    assert answer.status_code == 200
    body = answer.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["quiesce"]
    assert body["data"][0]["object"] == "model"


async def test_a_served_model_name_is_listed_and_answers_name_it() -> None:
    serving = SimServing(SimConfig(decode_step_s=0.001), served_model_name="tiny-chat")
    await serving.start()
    server = Served(serving)
    try:
        models = (await server.client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny-chat"]
        answer = await server.client.post("/v1/completions", json={
            "model": "tiny-chat", "prompt": PROMPT, "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["model"] == "tiny-chat"
        wrong = await server.client.post("/v1/completions", json={
            "model": "gpt-4", "prompt": PROMPT, "max_tokens": 2})
        assert "gpt-4" in assert_error(wrong, 404, "model_not_found")
        assert server.gate.admitted_total == 1  # the wrong model was never admitted
    finally:
        await server.client.aclose()
        await serving.engine.shutdown()


# -- completions ---------------------------------------------------------------------------


async def test_completion_answers_max_tokens_with_usage(served: Served) -> None:
    answer = await served.client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 5})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "text_completion" and body["model"] == "quiesce"
    assert body["choices"] == [{"index": 0, "text": " t1 t2 t3 t4 t5", "finish_reason": "length",
                                "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    assert body["kv_transfer_params"] is None
    assert served.outcomes() == OutcomeCounts(completed=1)
    assert served.gate.inflight == 0


async def test_streaming_with_ignore_eos_delivers_exactly_max_tokens(served: Served) -> None:
    events = await served.stream("/v1/completions", {
        "prompt": PROMPT, "max_tokens": 150, "ignore_eos": True, "min_tokens": 150,
        "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 2, "completion_tokens": 150,
                                    "total_tokens": 152}
    token_chunks = events[:-2]
    assert len(token_chunks) == 150  # the sim sends one chunk per token
    assert all(e["object"] == "text_completion" and "usage" not in e for e in token_chunks)
    assert finish_reasons(events) == ["length"]
    assert text_of(events) == "".join(f" t{i}" for i in range(1, 151))
    assert served.outcomes() == OutcomeCounts(completed=1)


async def test_continuous_usage_puts_usage_on_every_chunk(served: Served) -> None:
    events = await served.stream("/v1/completions", {
        "prompt": PROMPT, "max_tokens": 3,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [e for e in events if isinstance(e, dict)]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 3]
    assert chunks[-1]["choices"] == []


async def test_without_include_usage_no_usage_chunk_is_sent(served: Served) -> None:
    events = await served.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert len(events) == 4


@pytest.mark.parametrize("stop", ["t3", ["zz", "t3"], [" t3", "2 t"]])
async def test_a_stop_string_ends_the_text_before_it(served: Served,
                                                     stop: str | list[str]) -> None:
    answer = await served.client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 10, "stop": stop})
    body = answer.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    # " t1 t2 t3": "2 t" starts at 5, "t3" at 7; the earliest match wins
    assert choice["text"] == (" t1 t" if stop == [" t3", "2 t"] else " t1 t2 ")
    assert body["usage"]["completion_tokens"] == 3
    assert served.outcomes() == OutcomeCounts(completed=1)


async def test_a_streamed_stop_string_never_leaks_into_the_text(served: Served) -> None:
    events = await served.stream("/v1/completions", {
        "prompt": PROMPT, "max_tokens": 10, "stop": ["t4 t", "nope"],
        "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    assert text_of(events) == " t1 t2 t3 "
    assert all("t4" not in (e["choices"][0]["text"] if e["choices"] else "")
               for e in events[:-1])
    assert finish_reasons(events) == ["stop"]
    assert events[-2]["usage"]["completion_tokens"] == 5  # " t5" completes "t4 t"
    assert served.outcomes() == OutcomeCounts(completed=1)


async def test_a_prompt_of_token_ids_is_counted(served: Served) -> None:
    answer = await served.client.post("/v1/completions", json={
        "prompt": [5, 6, 7, 8], "max_tokens": 1})
    assert answer.json()["usage"]["prompt_tokens"] == 4
    single = await served.client.post("/v1/completions", json={"prompt": ["one two three"],
                                                                "max_tokens": 1})
    assert single.json()["usage"]["prompt_tokens"] == 3


# -- chat ----------------------------------------------------------------------------------


async def test_chat_completion_answers_an_assistant_message(served: Served) -> None:
    answer = await served.client.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hi there"}]}],
        "max_completion_tokens": 3, "max_tokens": 50})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "finish_reason": "length", "logprobs": None,
                                "message": {"role": "assistant", "content": " t1 t2 t3"}}]
    # the sim's rendering: "system: be brief\nuser: hi there\nassistant:" (7 words)
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    assert served.outcomes() == OutcomeCounts(completed=1)


def test_the_sim_renders_a_conversation_line_by_line() -> None:
    serving = SimServing()
    assert serving.render_chat([{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "yes"}]) == (
        "user: hi\nassistant: yes\nassistant:")


async def test_chat_streams_chunks_with_deltas(served: Served) -> None:
    events = await served.stream("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "stream_options": {"include_usage": True}})
    chunks = [e for e in events if isinstance(e, dict)]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert text_of(events, chat=True) == " t1 t2 t3 t4"
    assert finish_reasons(events) == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert events[-1] == "[DONE]"
    assert served.outcomes() == OutcomeCounts(completed=1)


async def test_chat_without_a_limit_gets_the_sims_default_length(served: Served) -> None:
    answer = await served.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}]})
    assert answer.json()["usage"]["completion_tokens"] == SIM_DEFAULT_MAX_TOKENS


# -- invalid requests: 400, never admitted ---------------------------------------------------


@pytest.mark.parametrize("extra,named", [
    ({"best_of": 2}, "best_of"),
    ({"n": 2}, "n"),
    ({"logprobs": 3}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stop": 7}, "stop"),
    ({"ignore_eos": "very"}, "ignore_eos"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": True, "extra": 1}}, "extra"),
    ({"prompt": ["one", "two"]}, "one prompt per request"),
    ({"prompt": []}, "prompt"),
])
async def test_an_invalid_completion_parameter_is_a_400_naming_it(
        served: Served, extra: dict[str, Any], named: str) -> None:
    answer = await served.client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 4, **extra})
    assert named in assert_error(answer, 400, "invalid_request")
    assert served.gate.admitted_total == 0


@pytest.mark.parametrize("body,named", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
    ({"prompt": "chat needs messages"}, "messages"),
])
async def test_an_invalid_chat_parameter_is_a_400_naming_it(
        served: Served, body: dict[str, Any], named: str) -> None:
    answer = await served.client.post("/v1/chat/completions", json=body)
    assert named in assert_error(answer, 400, "invalid_request")
    assert served.gate.admitted_total == 0


async def test_malformed_json_is_a_400(served: Served) -> None:
    answer = await served.client.post("/v1/completions", content=b'{"prompt": ',
                                      headers={"content-type": "application/json"})
    assert_error(answer, 400, "invalid_request")
    assert served.gate.admitted_total == 0


async def test_unknown_routes_and_methods_get_the_typed_error(served: Served) -> None:
    assert_error(await served.client.get("/v1/nothing"), 404, "not_found")
    assert_error(await served.client.get("/v1/completions"), 405, "method_not_allowed")


# -- admission and outcomes ------------------------------------------------------------------


async def test_a_closed_gate_answers_503_retryable(served: Served) -> None:
    served.gate.close()
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]})):
        answer = await served.client.post(path, json=body)
        assert_error(answer, 503, "worker_draining")
        assert answer.json()["error"]["retryable"] is True
    assert served.gate.refused_total == 2 and served.gate.admitted_total == 0


async def test_an_engine_abort_ends_the_stream_with_an_error_event_and_is_lost(
        served: Served) -> None:
    engine = served.serving.engine
    request = asyncio.create_task(served.stream("/v1/completions", {
        "prompt": PROMPT, "max_tokens": 100_000, "ignore_eos": True}))
    while engine.counts()[1] == 0:  # until it runs
        await engine.wait_for_change(1.0)
    assert await engine.abort_all("test") == 1
    events = await request
    assert events[-1]["error"]["type"] == "request_aborted"
    assert events[-1]["error"]["outcome"] == "lost"
    assert "[DONE]" not in events
    assert served.outcomes() == OutcomeCounts(lost=1)


async def test_an_engine_abort_of_a_plain_request_is_a_503_and_lost(served: Served) -> None:
    engine = served.serving.engine
    request = asyncio.create_task(served.client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 100_000}))
    while engine.counts()[1] == 0:
        await engine.wait_for_change(1.0)
    await engine.abort_all("test")
    assert_error(await request, 503, "request_aborted")
    assert served.outcomes() == OutcomeCounts(lost=1)


class Scripted(SimServing):
    """The sim's probe and control with a scripted stream: the failures a real engine has."""

    def __init__(self, script: str) -> None:
        super().__init__(SimConfig(decode_step_s=0.001))
        self.script = script

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        if self.script == "no-template":
            raise RequestRejected("this model has no chat template")
        return super().render_chat(messages)

    def stream(self, prompt: Prompt, sampling: Sampling, request_id: str,
               kv_transfer_params: Mapping[str, Any]) -> AsyncIterator[Delta]:
        if self.script == "refuse-parameters":
            raise RequestRejected("temperature is not supported")
        return self._scripted()

    async def _scripted(self) -> AsyncIterator[Delta]:
        if self.script == "refuse-input":  # found by the engine, before any output
            raise RequestRejected("the prompt is longer than the context")
        yield Delta(" a", 1)
        if self.script == "die":
            raise RequestAborted("the engine died")
        if self.script == "no-finish":
            return
        yield Delta(" b", 1, "stop", 2)


@pytest.mark.parametrize("script,status,kind,outcome", [
    ("refuse-parameters", 400, "invalid_request", OutcomeCounts(rejected=1)),
    ("refuse-input", 400, "invalid_request", OutcomeCounts(rejected=1)),
    ("no-template", 400, "invalid_request", OutcomeCounts(rejected=1)),
    ("die", 503, "request_aborted", OutcomeCounts(lost=1)),
    ("no-finish", 503, "request_aborted", OutcomeCounts(lost=1)),
])
async def test_engine_failures_map_to_status_and_outcome(
        script: str, status: int, kind: str, outcome: OutcomeCounts) -> None:
    server = Served(Scripted(script))
    answer = await server.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}]})
    assert_error(answer, status, kind)
    assert server.outcomes() == outcome
    assert server.gate.inflight == 0
    await server.client.aclose()


@pytest.mark.parametrize("script,kind,outcome", [
    ("refuse-input", "invalid_request", "rejected"),
    ("die", "request_aborted", "lost"),
    ("no-finish", "request_aborted", "lost"),
])
async def test_engine_failures_after_the_stream_started_end_it_with_an_error_event(
        script: str, kind: str, outcome: str) -> None:
    server = Served(Scripted(script))
    events = await server.stream("/v1/completions", {"prompt": PROMPT})
    error = events[-1]["error"]
    assert (error["type"], error["outcome"], error["retryable"]) == (kind, outcome, False)
    assert "[DONE]" not in events
    counts = server.outcomes()
    assert counts.ended == 1 and counts.to_dict()[outcome] == 1
    await server.client.aclose()


async def test_parameters_refused_before_the_stream_are_a_400_even_when_streaming() -> None:
    server = Served(Scripted("refuse-parameters"))
    answer = await server.client.post("/v1/completions", json={"prompt": PROMPT,
                                                                "stream": True})
    assert "temperature" in assert_error(answer, 400, "invalid_request")
    assert server.outcomes() == OutcomeCounts(rejected=1)
    await server.client.aclose()


# -- KV transfer between a prefill and a decode worker ----------------------------------------


async def test_a_prefill_answer_carries_the_engines_kv_transfer_params(served: Served) -> None:
    engine = served.serving.engine
    prefill = await served.client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 1, "request_id": "p-1",
        "kv_transfer_params": {"do_remote_decode": True}})
    body = prefill.json()
    assert body["kv_transfer_params"] == {"do_remote_prefill": True, "do_remote_decode": False,
                                          "remote_engine_id": "api-test",
                                          "remote_request_id": "p-1"}
    assert engine.counts()[2] == 1  # its KV is held for the decoder
    assert engine.release_held("p-1") == 1
    # the decode worker's request carries the handle on, as vLLM's disaggregated proxy does
    decode = await served.client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 3, "kv_transfer_params": body["kv_transfer_params"]})
    assert decode.json()["choices"][0]["finish_reason"] == "length"
    assert decode.json()["kv_transfer_params"] is None
    assert served.outcomes() == OutcomeCounts(completed=2)


async def test_a_streamed_prefill_puts_kv_transfer_params_on_the_last_chunk(
        served: Served) -> None:
    events = await served.stream("/v1/completions", {
        "prompt": PROMPT, "max_tokens": 2, "request_id": "p-2",
        "kv_transfer_params": {"do_remote_decode": True},
        "stream_options": {"include_usage": True}})
    chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
    assert "kv_transfer_params" not in chunks[0]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["kv_transfer_params"]["remote_request_id"] == "p-2"
    assert served.serving.engine.release_held("p-2") == 1


# -- the one mapping to the engine -------------------------------------------------------------


def test_the_request_maps_to_sampling_by_vllms_names() -> None:
    request = CompletionRequest.model_validate({
        "prompt": "x", "max_tokens": 7, "stop": "end", "ignore_eos": True, "min_tokens": 2,
        "temperature": 0.5, "top_p": 0.9, "top_k": 4, "min_p": 0.1, "seed": 3,
        "presence_penalty": 0.2, "frequency_penalty": 0.3, "repetition_penalty": 1.1})
    assert sampling_from(request).engine_kwargs() == {
        "max_tokens": 7, "min_tokens": 2, "ignore_eos": True, "stop": ["end"],
        "temperature": 0.5, "top_p": 0.9, "top_k": 4, "min_p": 0.1, "seed": 3,
        "presence_penalty": 0.2, "frequency_penalty": 0.3, "repetition_penalty": 1.1}
    plain = sampling_from(CompletionRequest.model_validate({"prompt": "x"}))
    assert plain.engine_kwargs() == {"max_tokens": 16, "min_tokens": 0, "ignore_eos": False,
                                     "stop": []}


async def test_a_request_id_already_in_flight_is_rejected_not_hung(served: Served) -> None:
    """Request ids key the sim engine's queues: a second one in flight is a 400, and both
    requests end (one completed, one rejected) instead of one hanging forever."""
    body = {"prompt": PROMPT, "max_tokens": 200, "request_id": "same"}
    first = asyncio.create_task(served.client.post("/v1/completions", json=body))
    for _ in range(30_000):  # bounded: the first request reaches the engine in a few steps
        if served.serving.engine.holds("same"):
            break
        await asyncio.sleep(0.001)
    assert served.serving.engine.holds("same")
    second = await served.client.post("/v1/completions", json=body)
    assert "already in flight" in assert_error(second, 400, "invalid_request")
    assert (await asyncio.wait_for(first, 30)).status_code == 200
    assert served.outcomes() == OutcomeCounts(completed=1, rejected=1)
    assert served.gate.inflight == 0
