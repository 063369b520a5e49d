"""Smoke test of a real vLLM engine on CPU with the tiny local model.

Run with the vLLM environment's interpreter, from the repo root:

    .venv-vllm/bin/python tests/integration/vllm/smoke.py

1. AsyncLLM (EngineCore in its own process): startup time; tokens/s of 4 concurrent
   requests of 32 tokens (after one warm-up round); then 4 more while reading the
   engine's `has_work` utility and the frontend's unfinished count, while busy and
   after; a clean shutdown.
2. vllm.LLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), in a child process so that
   the variable is read fresh: startup time and tokens/s.

Prints one `SMOKE key=value ...` line per measurement; exits non-zero on a failed check.
The CPU platform starts its processes with spawn, hence the `__main__` guard.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
}
for _key, _value in ENV.items():  # before vllm is imported, also for spawned children
    os.environ.setdefault(_key, _value)

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:  # run as a script: make `tests` importable
    sys.path.insert(0, str(REPO))

NUM_REQUESTS = 4
MAX_TOKENS = 32
SHUTDOWN_TIMEOUT_S = 30.0
PROMPT = "hello world the quick brown fox jumps over the lazy dog"


def report(**fields: object) -> None:
    print("SMOKE " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


def engine_kwargs(model: Path) -> dict[str, Any]:
    return {
        "model": str(model),
        "tokenizer": str(model),
        "max_model_len": 512,
        "enforce_eager": True,
        "dtype": "float32",
        "seed": 0,
    }


async def run_async(model: Path) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(model)))
    startup = time.perf_counter() - t0
    report(variant="async", startup_s=f"{startup:.1f}", client=type(engine.engine_core).__name__)
    try:
        await exercise(engine)
    finally:
        # With timeout=None vLLM waits 5 s for EngineCore to exit, then kills it; give it
        # longer so the measurement shows how long a clean exit takes.
        t3 = time.perf_counter()
        engine.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        report(variant="async", shutdown_s=f"{time.perf_counter() - t3:.2f}")
        # vLLM keeps a traceback that holds this frame alive until exit; drop the engine
        # now, or its __del__ -> shutdown() fails during interpreter teardown.
        del engine


async def exercise(engine: Any) -> None:
    from vllm import SamplingParams

    idle_before = await engine.engine_core.call_utility_async("has_work")
    report(phase="before", has_work=idle_before,
           unfinished=engine.output_processor.get_num_unfinished_requests())

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first_token = asyncio.Event()

    async def one(tag: str, i: int) -> int:
        tokens = 0
        async for out in engine.generate(PROMPT, params, request_id=f"smoke-{tag}-{i}"):
            tokens = len(out.outputs[0].token_ids)
            first_token.set()
        return tokens

    # Round 1, throughput, with no probes competing for the machine's 2 cores.
    for tag in ("warmup", "timed"):
        t1 = time.perf_counter()
        counts = await asyncio.gather(*(one(tag, i) for i in range(NUM_REQUESTS)))
        elapsed = time.perf_counter() - t1
        assert counts == [MAX_TOKENS] * NUM_REQUESTS, counts
    total = sum(counts)
    report(variant="async", requests=NUM_REQUESTS, tokens=total, seconds=f"{elapsed:.2f}",
           tokens_per_s=f"{total / elapsed:.0f}")

    # Round 2, probes while busy.
    first_token.clear()
    busy_probes: list[tuple[bool, int]] = []
    tasks = [asyncio.create_task(one("probed", i)) for i in range(NUM_REQUESTS)]
    while engine.output_processor.get_num_unfinished_requests() < NUM_REQUESTS:  # noqa: ASYNC110
        await asyncio.sleep(0)  # generate() registers the request on its first step
    # Right after submit: the frontend knows the requests, the engine may not yet.
    report(phase="submitted", unfinished=engine.output_processor.get_num_unfinished_requests(),
           has_unfinished=engine.output_processor.has_unfinished_requests(),
           has_work=await engine.engine_core.call_utility_async("has_work"))
    await first_token.wait()
    while not all(t.done() for t in tasks):
        busy_probes.append((
            await engine.engine_core.call_utility_async("has_work"),
            engine.output_processor.get_num_unfinished_requests(),
        ))
        await asyncio.sleep(0.005)
    counts = await asyncio.gather(*tasks)
    assert counts == [MAX_TOKENS] * NUM_REQUESTS, counts
    # (has_work, frontend unfinished) -> how often. (False, n > 0) would be the window
    # where the engine is done but the frontend has not yet processed the outputs.
    pairs = {p: busy_probes.count(p) for p in sorted(set(busy_probes))}
    report(phase="busy", probes=len(busy_probes),
           pairs=",".join(f"{h}/{u}:{n}" for (h, u), n in pairs.items()))
    assert any(h for h, _ in busy_probes), "has_work was never True while busy"

    # After the last output: `has_work` can stay True for one more engine step
    # (finished_req_ids not yet flushed); it must turn False soon.
    after = await engine.engine_core.call_utility_async("has_work")
    t2 = time.perf_counter()
    settled = after
    while settled and time.perf_counter() - t2 < 5.0:
        await asyncio.sleep(0.01)
        settled = await engine.engine_core.call_utility_async("has_work")
    report(phase="after", has_work_first=after, has_work_settled=settled,
           settle_s=f"{time.perf_counter() - t2:.3f}",
           unfinished=engine.output_processor.get_num_unfinished_requests(),
           has_unfinished=engine.output_processor.has_unfinished_requests())
    assert not settled, "has_work still True 5 s after the last output"
    assert engine.output_processor.get_num_unfinished_requests() == 0


def run_inproc(model: Path) -> None:
    """vllm.LLM with the engine core and the worker in this process."""
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(model))
    startup = time.perf_counter() - t0
    client = llm.llm_engine.engine_core
    report(variant="inproc", startup_s=f"{startup:.1f}", client=type(client).__name__)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for _ in ("warmup", "timed"):
        t1 = time.perf_counter()
        outs = llm.generate([PROMPT] * NUM_REQUESTS, params, use_tqdm=False)
        elapsed = time.perf_counter() - t1
    total = sum(len(o.outputs[0].token_ids) for o in outs)
    scheduler = client.engine_core.scheduler
    report(variant="inproc", requests=NUM_REQUESTS, tokens=total, seconds=f"{elapsed:.2f}",
           tokens_per_s=f"{total / elapsed:.0f}", scheduler_requests=len(scheduler.requests),
           has_requests=scheduler.has_requests())
    assert total == MAX_TOKENS * NUM_REQUESTS, total


def main() -> int:
    t_import = time.perf_counter()
    import vllm

    from tests.integration.vllm.tiny_model import build_tiny_llama

    report(vllm=vllm.__version__, import_s=f"{time.perf_counter() - t_import:.1f}")
    if len(sys.argv) == 3 and sys.argv[1] == "--inproc":
        run_inproc(Path(sys.argv[2]))
        return 0

    with tempfile.TemporaryDirectory(prefix="quiesce-tiny-llama-") as tmp:
        model = build_tiny_llama(Path(tmp) / "model")
        asyncio.run(run_async(model))
        gc.collect()  # the engine's reference cycles, while the interpreter is whole
        t0 = time.perf_counter()
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        rc = subprocess.run(
            [sys.executable, __file__, "--inproc", str(model)], env=env, check=False
        ).returncode
        report(variant="inproc", child_rc=rc, child_total_s=f"{time.perf_counter() - t0:.1f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
