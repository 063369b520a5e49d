"""Dynamo's disaggregated ``dynamo.vllm`` pair on the CPU: a prefill worker
(``--disaggregation-mode prefill``) and a decode worker (``--disaggregation-mode
decode``) behind Dynamo's real frontend, which sends each request to the prefill worker
first and then to the decode worker with the KV's whereabouts; the decoder pulls the KV
from the prefill worker over NIXL (vLLM's ``NixlConnector``, NIXL's UCX backend).

Both workers run the same connector, vLLM's ``MultiConnector`` of ``NixlConnector`` and
the test's ``PacedConnector`` (every engine step at least ``step_s``, so that a stream
lasts seconds): NIXL's handshake refuses a pair whose KV transfer settings differ. The
decoder runs ``--max-num-seqs`` requests at a time; the others wait in its queue, and
vLLM starts their pulls only when they are scheduled, so under load the prefill worker
holds KV that its decoder has not pulled yet. vLLM 0.31 fails a request whose pull fails
(``kv_load_failure_policy`` ``fail``): a prefill worker that leaves with KV unpulled
loses those requests.

The NIXL-on-a-small-CPU settings are the vLLM tier's (tests/integration/vllm/
test_disagg_workers.py): NIXL agents without their busy-polling progress thread and no
core pinning (``nixl_cpu/sitecustomize.py``, ``VLLM_CPU_OMP_THREADS_BIND=nobind``), a
side-channel port per worker, and a lease on held KV far longer than any run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.integration.dynamo.processes import REPO, STEP_S, dynamo_env, free_port

NIXL_CPU_SITE = REPO / "tests" / "integration" / "vllm" / "nixl_cpu"
KV_LEASE_S = 300
"""The prefill worker's lease on held KV (vLLM's safety net; default 30 s): held KV is
freed by the decoder's pull or by the engine's end, never by the lease, within a run."""
DECODE_MAX_NUM_SEQS = 2


def disagg_args(model: Path, template: Path, role: str, step_s: float = STEP_S) -> list[str]:
    """``dynamo.vllm`` arguments of the ``prefill`` or ``decode`` worker of the pair."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be prefill or decode, got {role!r}")
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"kv_lease_duration": KV_LEASE_S}}
    paced = {"kv_connector": "PacedConnector", "kv_role": "kv_both",
             "kv_connector_module_path": "tests.integration.vllm.paced_connector",
             "kv_connector_extra_config": {"step_s": step_s}}
    both = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"connectors": [nixl, paced]}}
    args = ["--model", str(model), "--discovery-backend", "file", "--enforce-eager",
            "--max-model-len", "512", "--dtype", "float32",
            "--custom-jinja-template", str(template), "--disaggregation-mode", role,
            "--kv-transfer-config", json.dumps(both)]
    if role == "decode":
        args += ["--max-num-seqs", str(DECODE_MAX_NUM_SEQS)]
    return args


def disagg_env(store: Path) -> dict[str, str]:
    """:func:`~.processes.dynamo_env` plus NIXL on a small CPU and a side channel of the
    worker's own (call once per worker)."""
    env = dynamo_env(store)
    env.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                "PYTHONPATH": os.pathsep.join((str(NIXL_CPU_SITE), env["PYTHONPATH"]))})
    return env
