"""SGLang on an H200 with the CUDA build: a real prefill/decode pair, and the CPU scenarios.

Run by ``ci/gpu/sglang.sh`` (which installs SGLang and NIXL); skipped, with the reason,
where there is no GPU, no SGLang or no NIXL (tests/gpu/conftest.py). Written from SGLang
0.5.23's source and the CPU runs; not yet run on a GPU (see the README).

- A real disaggregated pair on one GPU, NIXL transfer backend: the prefill ``Engine`` in
  this process (quiesce's probe holds its TokenizerManager), the decode server
  (``python -m sglang.launch_server --disaggregation-mode decode``) in its own process. The
  prefill request is sent first and the decode request only after a hold: for the whole
  hold the KV has nowhere to go, and the prefill probe must never read quiescent; once
  the decode request is sent, the decode stream completes in full and only then does the
  prefill probe read quiescent.
- The CPU tier's own scenarios, collected again (test_engine_cpu: probe busy/idle over the
  real round trip, drain, abort, rejection, the signal guard in the scheduler and
  detokenizer; test_sglang_worker: SIGTERM under streaming load to the main process, the
  process group, SIGINT to the group and every process, each stream read to its end).

The model: the CPU tests' tiny random-weight Llama with 64-wide heads (GPU attention
kernels want 64 or more); no model hub is reachable from the GPU machine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.conftest import gpu_reason, pick_free_ports

REQUIRES = ("sglang", "nixl")

_why = gpu_reason() or next((f"engine not installed: {m}" for m in REQUIRES
                             if importlib.util.find_spec(m) is None), None)
if _why:
    pytest.skip(_why, allow_module_level=True)

os.environ.setdefault("QUIESCE_SGLANG_ALL_SIGNALS", "1")  # every delivery, not the CPU subset

import pytest_asyncio  # noqa: E402

from quiesce.adapters.sglang.serving import SglangServing  # noqa: E402
from quiesce.budget import Deadline  # noqa: E402
from quiesce.drain import DrainConfig, wait_quiescent  # noqa: E402
from quiesce.generation import Sampling  # noqa: E402
from quiesce.probe import Verdict, observe  # noqa: E402
from tests.integration.sglang.test_engine_cpu import *  # noqa: E402, F403
from tests.integration.sglang.test_sglang_worker import *  # noqa: E402, F403

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MEMORY_SHARE = float(os.environ.get("QUIESCE_GPU_MEMORY_UTILIZATION", "0.2"))
"""``mem_fraction_static`` of each engine: several share the GPU."""
TRANSFER_BACKEND = os.environ.get("QUIESCE_SGLANG_TRANSFER_BACKEND", "nixl")
HOLD_S = 3.0
FAST = DrainConfig(router_grace_s=0, poll_base_s=0.001, poll_cap_s=0.01, probe_timeout_s=5)


@pytest.fixture(scope="module")  # type: ignore[no-redef]  # replaces the CPU modules' one
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CPU tests' tiny Llama and tokenizer, with 2 heads of 64 (hidden size 128)."""
    from tests.integration.vllm import tiny_model as tiny

    saved = dict(tiny.CONFIG)
    tiny.CONFIG.update(hidden_size=128, head_dim=64, intermediate_size=256)
    try:
        return tiny.build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-gpu"))
    finally:
        tiny.CONFIG.clear()
        tiny.CONFIG.update(saved)


@pytest.fixture(scope="module")
def decode_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[str]:
    """The decode side: SGLang's own HTTP server in decode mode, in its own process."""
    (port,) = pick_free_ports(1)
    log = tmp_path_factory.mktemp("decode") / "decode.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_model),
             "--port", str(port), "--disaggregation-mode", "decode",
             "--disaggregation-transfer-backend", TRANSFER_BACKEND,
             "--mem-fraction-static", str(MEMORY_SHARE), "--context-length", "512"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert process.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "decode server never healthy"
            time.sleep(1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def prefill(tiny_model: Path) -> AsyncIterator[tuple[SglangServing, int]]:
    (bootstrap_port,) = pick_free_ports(1)
    s = SglangServing(str(tiny_model), "prefill", max_model_len=512,
                      mem_fraction_static=MEMORY_SHARE,
                      disaggregation_transfer_backend=TRANSFER_BACKEND,
                      disaggregation_bootstrap_port=bootstrap_port)
    await s.start()
    try:
        yield s, bootstrap_port
    finally:
        await s.control.shutdown()


def decode_generate(url: str, room: int, bootstrap_port: int, tokens: int) -> dict[str, Any]:
    body = json.dumps({"text": "hello world the quick brown fox",
                       "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
                       "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
                       "bootstrap_room": room}).encode()
    request = urllib.request.Request(f"{url}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        result: dict[str, Any] = json.loads(answer.read())
    return result


async def test_prefill_is_drained_only_after_decode_received_the_kv(
        prefill: tuple[SglangServing, int], decode_server: str) -> None:
    serving, bootstrap_port = prefill
    assert (await observe(serving.probe, timeout=5)).verdict is Verdict.QUIESCENT
    room = 4242
    kv = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
          "bootstrap_room": room}

    async def prefill_side() -> list[str | None]:
        return [d.finish_reason async for d in serving.stream(
            "hello world the quick brown fox", Sampling(max_tokens=1), "pd-1", kv)]

    task = asyncio.create_task(prefill_side())
    verdicts = []
    held_until = time.monotonic() + HOLD_S
    while time.monotonic() < held_until:  # the decode side has not asked for the KV yet
        verdicts.append((await observe(serving.probe, timeout=5)).verdict)
        await asyncio.sleep(0.05)
    assert verdicts and Verdict.QUIESCENT not in verdicts, verdicts
    decoded = await asyncio.to_thread(decode_generate, decode_server, room, bootstrap_port, 64)
    assert decoded["meta_info"]["finish_reason"]["type"] == "length", decoded
    assert decoded["meta_info"]["completion_tokens"] == 64
    _, last = await wait_quiescent(serving.probe, Deadline.after(60), FAST)
    assert last.verdict is Verdict.QUIESCENT
    assert (await task)[-1] in ("length", "stop")
