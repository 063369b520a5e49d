"""What the plugin's board costs EngineCore per step, on a real vLLM scheduler.

Run by :mod:`bench.vllm.run` in a child process (vLLM reads
``VLLM_ENABLE_V1_MULTIPROCESSING`` when the engine starts, and this needs EngineCore in
the same process as the timer)::

    .venv-vllm/bin/python -m bench.vllm.publish MODEL_DIR RELEASE_DIR

With ``RUNNING`` requests decoding it times, between engine steps: the plugin's count
(``count_pending``, run twice per step once a probe subscribed), a board write (only when
the counts changed), and the step itself. Prints one JSON object on its last line.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.stats import median

RUNNING = (16, 64)
COUNT_CALLS = 20_000
WRITE_CALLS = 20_000
STEPS = 40


def measure(model: Path, release_dir: Path) -> dict[str, float]:
    from vllm import LLM, SamplingParams

    from quiesce.adapters.vllm.board import BoardWriter, ChangeFifo
    from quiesce.adapters.vllm.publisher import count_pending
    from tests.integration.vllm.tiny_model import engine_kwargs, holding_connector

    llm = LLM(model=str(model), tokenizer=str(model), **engine_kwargs(),
              kv_transfer_config=holding_connector(release_dir))
    engine = llm.llm_engine
    core = engine.engine_core.engine_core  # InprocClient -> EngineCore
    out: dict[str, float] = {}
    for running in RUNNING:
        params = SamplingParams(max_tokens=400, min_tokens=400, temperature=0.0)
        for i in range(running):
            engine.add_request(f"r{running}-{i}", "hello world", params)
        for _ in range(3):
            engine.step()
        if len(core.scheduler.running) != running:
            raise RuntimeError(f"{len(core.scheduler.running)} running, not {running}")
        begin = time.perf_counter()
        for _ in range(COUNT_CALLS):
            count_pending(core)
        out[f"count_{running}_running_us"] = (time.perf_counter() - begin) / COUNT_CALLS * 1e6
        steps = []
        for _ in range(STEPS):
            begin = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - begin)
        out[f"step_{running}_running_ms"] = median(steps) * 1e3
        engine.abort_request([f"r{running}-{i}" for i in range(running)])
        while engine.has_unfinished_requests():
            engine.step()
    with tempfile.TemporaryDirectory() as tmp:
        fifo = ChangeFifo(os.path.join(tmp, "changes.fifo"))
        board = BoardWriter(os.path.join(tmp, "b"), os.path.join(tmp, "changes.fifo"), 0)
        counts = [(0, i % 2, 0, 0, 0, 0, 1) for i in range(2)]
        begin = time.perf_counter()
        for i in range(WRITE_CALLS):
            board.publish(counts[i % 2])  # a change every time: write + FIFO byte
            if i % 1000 == 999:
                fifo.drain()
        out["write_us"] = (time.perf_counter() - begin) / WRITE_CALLS * 1e6
        board.close()
        fifo.close()
    return out


def main() -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    result = measure(Path(sys.argv[1]), Path(sys.argv[2]))
    print(json.dumps({k: round(v, 4) for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
