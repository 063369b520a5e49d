"""The OpenAI-compatible API of `quiesce serve --engine vllm` against a real vLLM engine on
the CPU, as a newcomer meets it: started with nothing but the model (and free ports).

Two workers, one after the other: a copy of the tiny model with a chat template (a
working chat), then the plain tiny model (no chat template), shared by every other test
of the module. Each test checks how its requests ended through ``GET /engine/status``.
Before them, the adapter's mapping of vLLM's outputs and errors is checked against
vLLM's own output and exception classes, without an engine.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from quiesce.errors import ConfigError, RequestAborted, RequestRejected
from quiesce.generation import Delta, Sampling
from tests.integration.vllm.conftest import SKIP_REASON
from tests.integration.worker_process import Worker, start_worker

pytest.importorskip("vllm", reason=SKIP_REASON)

STARTUP_S = 600.0
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . "
                 "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
PROMPT = "hello world the quick brown fox"


# -- the adapter's mapping, against vLLM's own classes (no engine) --------------------------


class FakeEngine:
    """Stands in for AsyncLLM.generate only: yields scripted vLLM outputs, or raises."""

    def __init__(self, outputs: list[Any], error: BaseException | None = None) -> None:
        self.outputs = outputs
        self.error = error

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        for output in self.outputs:
            yield output
        if self.error is not None:
            raise self.error


def output(text: str, tokens: list[int], finish: str | None,
           kv: dict[str, Any] | None = None) -> Any:
    from vllm.outputs import CompletionOutput, RequestOutput

    completion = CompletionOutput(index=0, text=text, token_ids=tokens, cumulative_logprob=None,
                                  logprobs=None, finish_reason=finish)
    return RequestOutput("r", None, [1, 2, 3], None, [completion], finish is not None,
                         kv_transfer_params=kv)


def serving_with(engine: FakeEngine) -> Any:
    from quiesce.adapters.vllm.serving import VllmServing

    serving = VllmServing("/models/tiny")
    serving.engine = engine
    serving._context = 512
    return serving


async def collect(serving: Any, sampling: Sampling | None = None) -> list[Delta]:
    return [d async for d in serving.stream("hi", sampling or Sampling(), "r", {})]


async def test_outputs_become_deltas_with_counts_and_the_kv_handle() -> None:
    handle = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1]}
    serving = serving_with(FakeEngine([output(" a", [7], None),
                                       output(" b c", [8, 9], "length", handle)]))
    deltas = await collect(serving)
    assert deltas == [Delta(" a", 1), Delta(" b c", 2, "length", 3, handle)]


@pytest.mark.parametrize("reason", ["abort", "error"])
async def test_an_engine_abort_is_request_aborted(reason: str) -> None:
    serving = serving_with(FakeEngine([output(" a", [7], None), output("", [], reason)]))
    with pytest.raises(RequestAborted):
        await collect(serving)


async def test_engine_death_is_request_aborted() -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    serving = serving_with(FakeEngine([output(" a", [7], None)], EngineDeadError()))
    with pytest.raises(RequestAborted):
        await collect(serving)


def generate_error(cause: BaseException) -> BaseException:
    from vllm.v1.engine.exceptions import EngineGenerateError

    error: BaseException = EngineGenerateError()
    error.__cause__ = cause
    return error


async def test_input_refused_before_any_output_is_rejected_and_later_failures_are_lost() -> None:
    from vllm.exceptions import VLLMValidationError

    refused = VLLMValidationError("The decoder prompt (length 900) is longer than the maximum")
    with pytest.raises(RequestRejected, match="longer than"):
        await collect(serving_with(FakeEngine([], refused)))
    with pytest.raises(RequestRejected):
        await collect(serving_with(FakeEngine([], generate_error(ValueError("bad input")))))
    with pytest.raises(RequestAborted):
        await collect(serving_with(FakeEngine([output(" a", [7], None)],
                                              generate_error(ValueError("mid-stream")))))
    with pytest.raises(RequestAborted):
        await collect(serving_with(FakeEngine([], generate_error(RuntimeError("bug")))))


def test_parameters_vllm_cannot_honour_are_rejected_before_the_stream() -> None:
    serving = serving_with(FakeEngine([]))
    with pytest.raises(RequestRejected, match="context length"):
        serving.stream("hi", Sampling(max_tokens=513), "r", {})
    with pytest.raises(RequestRejected, match="sampling parameters"):
        serving.stream("hi", Sampling(max_tokens=None, min_tokens=-1), "r", {})


def test_a_model_without_a_chat_template_is_rejected() -> None:
    class NoTemplate:
        chat_template = None

    class Engine(FakeEngine):
        def get_tokenizer(self) -> NoTemplate:
            return NoTemplate()

    with pytest.raises(RequestRejected, match="no chat template"):
        serving_with(Engine([])).render_chat([{"role": "user", "content": "hi"}])


def test_an_invalid_kv_transfer_config_is_a_config_error() -> None:
    from quiesce.adapters.vllm.serving import VllmServing

    serving = VllmServing("/m", kv_transfer_config={"kv_role": "both-ways"})
    with pytest.raises(ConfigError) as raised:
        serving._resolved_args()
    assert raised.value.field == "kv_transfer_config"
    good = VllmServing("/m", kv_transfer_config={"kv_connector": "NixlConnector",
                                                 "kv_role": "kv_both"})._resolved_args()
    assert good["kv_transfer_config"].kv_connector == "NixlConnector"
    assert good["dtype"] == "float32"  # on the CPU, unless the operator chose one


# -- a real engine ---------------------------------------------------------------------------


def ended(worker: Worker) -> dict[str, int]:
    requests = worker.status()["requests"]
    assert isinstance(requests, dict)
    counts: dict[str, int] = requests["ended_total"]
    return counts


def admitted(worker: Worker) -> int:
    requests = worker.status()["requests"]
    assert isinstance(requests, dict)
    return int(requests["admitted_total"])


async def post(worker: Worker, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=300) as client:
        return await client.post(f"{worker.url}{path}", json=body)


async def stream(worker: Worker, path: str, body: dict[str, Any]) -> list[Any]:
    """Every event of a streamed answer, to its end (``"[DONE]"`` as a string)."""
    events: list[Any] = []
    async with httpx.AsyncClient(timeout=300) as client, \
            client.stream("POST", f"{worker.url}{path}", json={**body, "stream": True}) as answer:
        assert answer.status_code == 200, await answer.aread()
        async for line in answer.aiter_lines():
            if line:
                assert line.startswith("data: "), line
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def texts(events: list[Any], key: str = "text") -> str:
    out = []
    for event in events:
        if isinstance(event, dict) and event.get("choices"):
            choice = event["choices"][0]
            out.append(choice[key] if key == "text" else choice["delta"].get("content", ""))
    return "".join(out)


def finish_reasons(events: list[Any]) -> list[str]:
    return [e["choices"][0]["finish_reason"] for e in events
            if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]]


@pytest.mark.slow
async def test_chat_with_a_chat_template(tiny_model: Path, tmp_path: Path) -> None:
    """Runs first (file order), so its engine is gone before the module's worker starts."""
    model = tmp_path / "tiny-chat"
    shutil.copytree(tiny_model, model)
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_file.write_text(json.dumps(config))
    with start_worker("--served-model-name", "tiny-chat", "--max-model-len", "256",
                      engine=("--engine", "vllm", "--model", str(model)),
                      startup_timeout=STARTUP_S) as worker:
        models = (await post_get(worker, "/v1/models"))["data"]
        assert [m["id"] for m in models] == ["tiny-chat"]
        messages = [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hello world"}]
        answer = await post(worker, "/v1/chat/completions", {
            "model": "tiny-chat", "messages": messages, "max_completion_tokens": 8,
            "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["object"] == "chat.completion" and body["model"] == "tiny-chat"
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
        assert choice["finish_reason"] == "length"
        # "system : be brief . user : hello world . assistant :" through the template
        assert body["usage"]["prompt_tokens"] >= 11
        assert body["usage"]["completion_tokens"] == 8
        events = await stream(worker, "/v1/chat/completions", {
            "messages": messages, "max_tokens": 5, "ignore_eos": True,
            "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]"
        assert events[0]["object"] == "chat.completion.chunk"
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert texts(events, "delta")
        assert finish_reasons(events) == ["length"]
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 5
        assert ended(worker) == {"completed": 2, "lost": 0, "client_gone": 0, "rejected": 0}


async def post_get(worker: Worker, path: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60) as client:
        answer = await client.get(f"{worker.url}{path}")
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


@pytest.fixture(scope="module")
def worker(tiny_model: Path) -> Iterator[Worker]:
    """`quiesce serve --engine vllm --model DIR` and nothing else but free ports, with no
    KV cache size in the environment either (the conftest sets one for other tests)."""
    with start_worker(engine=("--engine", "vllm", "--model", str(tiny_model)),
                      startup_timeout=STARTUP_S,
                      env_changes={"VLLM_CPU_KVCACHE_SPACE": None}) as started:
        yield started


@pytest.mark.slow
async def test_models_names_the_model_directory(worker: Worker, tiny_model: Path) -> None:
    body = await post_get(worker, "/v1/models")
    assert [m["id"] for m in body["data"]] == [tiny_model.name]


@pytest.mark.slow
def test_the_no_flags_start_chose_the_cpu_defaults(worker: Worker) -> None:
    """What vLLM's own log lines (the worker's stdout) say it was given."""
    log = "".join(worker.lines)
    assert "dtype=torch.float32" in log  # not vLLM's bfloat16 (SIGILL in its AMX kernel)
    assert "max_seq_len=2048" in log  # the tiny model's own max_position_embeddings
    # quiesce sized the KV cache (vLLM says "Auto set" when it sizes it itself)
    assert "Explicitly set (" in log and "GiB for KV cache" in log


@pytest.mark.slow
async def test_ignore_eos_delivers_exactly_max_tokens(worker: Worker, tiny_model: Path) -> None:
    before = ended(worker)
    events = await stream(worker, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True,
        "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 40
    assert usage["usage"]["prompt_tokens"] == prompt_length(tiny_model, PROMPT)
    assert finish_reasons(events) == ["length"]
    assert texts(events)
    # past the 512 tokens the test engines use: the context is the model's own (2048)
    answer = await post(worker, "/v1/completions", {"prompt": PROMPT, "max_tokens": 600,
                                                    "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 600
    assert answer.json()["choices"][0]["finish_reason"] == "length"
    assert delta(ended(worker), before) == {"completed": 2}


def prompt_length(model: Path, prompt: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(str(model))(prompt)["input_ids"])


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


@pytest.mark.slow
async def test_a_stop_string_ends_the_text_before_it(worker: Worker) -> None:
    before = ended(worker)
    greedy = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    full = (await post(worker, "/v1/completions", greedy)).json()["choices"][0]["text"]
    words = full.split()
    assert len(words) >= 6, full
    stop = words[4]
    cut = full[:full.find(stop)]
    answer = (await post(worker, "/v1/completions", {**greedy, "stop": [stop, "zzz"]})).json()
    assert answer["choices"][0]["text"] == cut
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] <= 5
    events = await stream(worker, "/v1/completions", {**greedy, "stop": stop})
    assert texts(events) == cut
    assert finish_reasons(events) == ["stop"]
    assert delta(ended(worker), before) == {"completed": 3}


@pytest.mark.slow
async def test_chat_without_a_chat_template_is_a_400(worker: Worker) -> None:
    before = ended(worker)
    answer = await post(worker, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello"}]})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request"
    assert "chat template" in answer.json()["error"]["message"]
    assert delta(ended(worker), before) == {"rejected": 1}


@pytest.mark.slow
@pytest.mark.parametrize("extra,named", [({"best_of": 2}, "best_of"), ({"n": 2}, "n"),
                                         ({"logprobs": 1}, "logprobs"),
                                         ({"max_tokens": 5000}, "context length")])
async def test_unknown_or_unsupported_parameters_are_a_400(
        worker: Worker, extra: dict[str, Any], named: str) -> None:
    before, admitted_before = ended(worker), admitted(worker)
    answer = await post(worker, "/v1/completions", {"prompt": PROMPT, **extra})
    assert answer.status_code == 400, answer.text
    assert named in answer.json()["error"]["message"]
    if named == "context length":  # refused by the engine's adapter: admitted, rejected
        assert delta(ended(worker), before) == {"rejected": 1}
    else:  # refused by the request's schema: never admitted
        assert admitted(worker) == admitted_before


@pytest.mark.slow
async def test_a_prompt_longer_than_the_context_is_rejected(worker: Worker) -> None:
    before = ended(worker)
    long_prompt = " ".join(["hello"] * 3000)
    answer = await post(worker, "/v1/completions", {"prompt": long_prompt, "max_tokens": 4})
    assert answer.status_code == 400, answer.text
    assert "maximum" in answer.json()["error"]["message"]
    events = await stream(worker, "/v1/completions", {"prompt": long_prompt, "max_tokens": 4})
    assert events[-1]["error"]["outcome"] == "rejected"
    assert "[DONE]" not in events
    assert delta(ended(worker), before) == {"rejected": 2}
