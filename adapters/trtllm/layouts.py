"""The names of TensorRT-LLM the adapter relies on, with the known layouts of each.

Data only, no code of TensorRT-LLM: the table was written from the project's research notes
(``reference/trtllm.md``) and checked against the public source where noted in the README.
Two readers share it:

- the probe (:mod:`.executor_reader`) resolves each :class:`Requirement` at run time with
  ``getattr``, trying its layouts in order, and reports UNKNOWN when none is present;
- the drift checker (:mod:`.doctor`) looks for the same names in the installed sources
  with :mod:`ast`, without importing TensorRT-LLM.

A :class:`Layout` holds when every one of its :class:`Member` names is defined: an
attribute assigned on ``self`` (``self.name = ...`` or annotated) anywhere in the class,
a class-level assignment, or a method (``def``, properties included). File paths are
relative to the ``tensorrt_llm`` package directory; the first file that exists and
defines the class is used.
"""

from __future__ import annotations

import dataclasses
from typing import Final, Literal

Kind = Literal["attribute", "method"]

PY_EXECUTOR: Final = "_torch/pyexecutor/py_executor.py"
REQUEST_QUEUE: Final = "_torch/pyexecutor/executor_request_queue.py"
LLM_REQUEST: Final = "_torch/pyexecutor/llm_request.py"
TRANSFER_MANAGER_FILES: Final = ("_torch/disaggregation/orchestration/transfer_manager.py",
                                 PY_EXECUTOR)
"""2026 main moved ``AsyncTransferManager`` out of py_executor.py (where PR #9891 added it)."""


@dataclasses.dataclass(frozen=True)
class Member:
    """One name on one class of TensorRT-LLM."""

    files: tuple[str, ...]
    cls: str
    name: str
    kind: Kind

    def describe(self) -> str:
        call = "()" if self.kind == "method" else ""
        return f"{self.cls}.{self.name}{call}"


@dataclasses.dataclass(frozen=True)
class Layout:
    """One known way a version provides a requirement: every member must exist."""

    label: str
    members: tuple[Member, ...]


@dataclasses.dataclass(frozen=True)
class Requirement:
    """What the adapter needs, for which path, and the layouts that provide it.

    ``layouts[0]`` is the newest known layout; the others are alternatives. ``required``
    requirements decide the doctor's verdict; an optional one only narrows a count
    (its absence is reported, and the probe stays on the safe side without it).
    """

    key: str
    purpose: str
    path: str
    layouts: tuple[Layout, ...]
    required: bool = True


def _pyexec(name: str, kind: Kind = "attribute") -> Member:
    return Member((PY_EXECUTOR,), "PyExecutor", name, kind)


def _queue(name: str, kind: Kind = "method") -> Member:
    return Member((REQUEST_QUEUE,), "ExecutorRequestQueue", name, kind)


_WORKER_CLASS: Final = Member(("executor/worker.py",), "GenerationExecutorWorker", "__init__",
                              "method")
"""The single-process worker's class: the probe picks its layout by this class name."""
_RAY: Final = (
    Member(("executor/ray_executor.py", "executor/ray/executor.py"), "RayExecutor",
           "__init__", "method"),
    Member(("executor/ray_gpu_worker.py", "executor/ray/gpu_worker.py"), "RayWorkerWrapper",
           "_inject_worker_extension", "method"))
"""The Ray executor's class (picked by name) and where ``ray_worker_extension_cls`` is
mixed into the Ray worker class."""

# Layout labels the probe reports in its details (and the doctor in its JSON).
WAITING_ON_EXECUTOR: Final = "waiting_queue on PyExecutor"
WAITING_ON_REQUEST_QUEUE: Final = "waiting queue on ExecutorRequestQueue"
QUEUED_BY_METHOD: Final = "get_request_queue_size()"
QUEUED_BY_QUEUE: Final = "request_queue.qsize()"
TRANSFER_MANAGER: Final = "AsyncTransferManager"
CTX_IN_TRANSMISSION: Final = "ctx_in_transmission_requests"

REQUIREMENTS: Final[tuple[Requirement, ...]] = (
    Requirement(
        "in_process_worker", "the single-process worker that holds the PyExecutor "
        "(llm._executor.engine)", "in-process",
        (Layout("BaseWorker.engine", (_WORKER_CLASS, Member(("executor/base_worker.py",),
                                                            "BaseWorker", "engine",
                                                            "attribute"))),
         Layout("GenerationExecutorWorker.engine",
                (Member(("executor/worker.py",), "GenerationExecutorWorker", "engine",
                        "attribute"),)))),
    Requirement("active_requests", "requests scheduled or resident in the batch "
                "(generation requests awaiting KV included)", "in-process",
                (Layout("active_requests", (_pyexec("active_requests"),)),)),
    Requirement("waiting_queue", "requests fetched from the queue but not yet active",
                "in-process",
                (Layout(WAITING_ON_EXECUTOR, (_pyexec("waiting_queue"),)),
                 Layout(WAITING_ON_REQUEST_QUEUE,
                        (_pyexec("executor_request_queue"),
                         _queue("get_waiting_queue_size"))))),
    Requirement("request_queue", "requests enqueued by the API, not yet fetched",
                "in-process",
                (Layout(QUEUED_BY_METHOD, (_pyexec("executor_request_queue"),
                                           _queue("get_request_queue_size"))),
                 Layout(QUEUED_BY_QUEUE, (_pyexec("executor_request_queue"),
                                          _queue("request_queue", "attribute"))))),
    Requirement("ctx_in_transfer", "context requests whose KV a generation worker is "
                "still pulling (dropped from active_requests)", "in-process",
                (Layout(TRANSFER_MANAGER,
                        (_pyexec("async_transfer_manager"),
                         Member(TRANSFER_MANAGER_FILES, "AsyncTransferManager",
                                "requests_in_transfer", "method"))),
                 Layout(CTX_IN_TRANSMISSION, (_pyexec("ctx_in_transmission_requests"),)))),
    Requirement("attention_dp_dummy", "marks attention-DP padding requests, not counted "
                "as work (without it they are counted: safe)", "in-process",
                (Layout("is_attention_dp_dummy",
                        (Member((LLM_REQUEST,), "LlmRequest", "is_attention_dp_dummy",
                                "attribute"),)),),
                required=False),
    Requirement("abort", "aborting a request for the forced path (EngineControl)",
                "control",
                (Layout("GenerationExecutor.abort_request",
                        (Member(("executor/executor.py",), "GenerationExecutor",
                                "abort_request", "method"),)),)),
    Requirement("proxy_results", "the proxy's unfinished results (multi-process "
                "default, weak signal)", "proxy",
                (Layout("GenerationExecutorProxy._results",
                        (Member(("executor/proxy.py",), "GenerationExecutorProxy",
                                "_results", "attribute"),)),),
                required=False),
    Requirement("stats", "iteration statistics (multi-process default, weak signal)",
                "proxy",
                (Layout("BaseLLM.get_stats_async", (Member(("llmapi/llm.py",), "BaseLLM",
                                                           "get_stats_async", "method"),)),
                 Layout("_TorchLLM.get_stats_async",
                        (Member(("llmapi/llm.py",), "_TorchLLM", "get_stats_async",
                                "method"),))),
                required=False),
    Requirement("ray_rpc", "running the probe in every Ray worker (collective RPC and a "
                "worker extension)", "ray",
                (Layout("_TorchLLM._collective_rpc",
                        (Member(("llmapi/llm.py",), "_TorchLLM", "_collective_rpc", "method"),
                         *_RAY)),
                 Layout("BaseLLM._collective_rpc",
                        (Member(("llmapi/llm.py",), "BaseLLM", "_collective_rpc", "method"),
                         *_RAY))),
                required=False),
)
"""Everything the adapter reads. Required ones decide whether the in-process probe can
answer at all; optional ones belong to the weaker paths or only narrow a count."""

GEN_AWAITING_KV_STATES: Final = frozenset({"DISAGG_GENERATION_INIT",
                                           "DISAGG_GENERATION_TRANS_IN_PROGRESS"})
"""``LlmRequestState`` member names of a generation request still waiting for its KV.
Compared by name: the integer values changed between versions."""
