"""The names of TensorRT-LLM the adapter relies on, with the known layouts of each.

Data only, no code of TensorRT-LLM: the table was written from the project's research notes
(``reference/trtllm.md``) and checked against the public source where noted in the README.
Two readers share it:

- the probe (:mod:`.executor_reader`) resolves each :class:`Requirement` at run time with
  ``getattr``, trying its layouts in order, and reports UNKNOWN when none is present;
- the drift checker (:mod:`.doctor`) looks for the same names in the installed sources
  with :mod:`ast`, without importing TensorRT-LLM.

A :class:`Layout` holds when every one of its :class:`Member` names is defined with the
kind the adapter uses it as, and is live, and none of its ``absent`` names is defined:

- **kind**: a ``method`` is called, so it must be a plain ``def`` (not a property, not an
  attribute assigned on ``self``); an ``attribute`` is read, so an assignment on ``self``
  or in the class body, or a property, will do (a plain ``def`` will not);
- **live** (``live="read"``): the class reads ``self.<name>`` somewhere (the executor
  loop, or a helper handed the object), so the assignment found is the one the loop
  uses and not a leftover of the same name; ``live="bumped"``: the class increments it
  (``self.<name> += ...``), as the loop does its iteration counter; ``value``: the
  assigned value's constructor must be one of these (``Queue``: the stdlib queue whose
  waiters the parked-loop detection reads).

File paths are relative to the ``tensorrt_llm`` package directory; the first file that
exists and defines the class is used.
"""

from __future__ import annotations

import dataclasses
from typing import Final, Literal

Kind = Literal["attribute", "method"]
Live = Literal["", "read", "bumped"]
Resolve = Literal["first", "any"]

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
    live: Live = ""
    value: tuple[str, ...] = ()

    def describe(self) -> str:
        call = "()" if self.kind == "method" else ""
        return f"{self.cls}.{self.name}{call}"


@dataclasses.dataclass(frozen=True)
class Layout:
    """One known way a version provides a requirement: every member must exist."""

    label: str
    members: tuple[Member, ...]
    absent: tuple[Member, ...] = ()
    """Names that must not be defined for this layout to hold (a build without a feature)."""


@dataclasses.dataclass(frozen=True)
class Requirement:
    """What the adapter needs, for which path, and the layouts that provide it.

    ``layouts[0]`` is the newest known layout; the others are alternatives. ``required``
    requirements decide the doctor's verdict; an optional one only narrows a count
    (its absence is reported, and the probe stays on the safe side without it).
    ``resolve``: ``"first"`` when the probe takes the first layout whose names exist
    (so that layout, and no later one, must hold); ``"any"`` when it reads every layout
    present and adds them up (one holding layout suffices).
    """

    key: str
    purpose: str
    path: str
    layouts: tuple[Layout, ...]
    required: bool = True
    resolve: Resolve = "first"


def _pyexec(name: str, kind: Kind = "attribute", live: Live = "") -> Member:
    return Member((PY_EXECUTOR,), "PyExecutor", name, kind, live)


def _queue(name: str, kind: Kind = "method", live: Live = "",
           value: tuple[str, ...] = ()) -> Member:
    return Member((REQUEST_QUEUE,), "ExecutorRequestQueue", name, kind, live, value)


def _live(name: str) -> Member:
    """A ``PyExecutor`` attribute the executor loop reads."""
    return _pyexec(name, "attribute", "read")


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
CONTROL_ON_EXECUTOR: Final = "control lists on PyExecutor"
CONTROL_ON_REQUEST_QUEUE: Final = "control lists on ExecutorRequestQueue"
NO_CONTROL: Final = "no control requests in this build"

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
                (Layout("active_requests", (_live("active_requests"),)),)),
    Requirement("waiting_queue", "requests fetched from the queue but not yet active",
                "in-process",
                (Layout(WAITING_ON_EXECUTOR, (_live("waiting_queue"),)),
                 Layout(WAITING_ON_REQUEST_QUEUE,
                        (_live("executor_request_queue"),
                         _queue("waiting_queue", "attribute", "read"),
                         _queue("get_waiting_queue_size"))))),
    Requirement("request_queue", "requests enqueued by the API, not yet fetched",
                "in-process",
                (Layout(QUEUED_BY_METHOD, (_live("executor_request_queue"),
                                           _queue("get_request_queue_size"))),
                 Layout(QUEUED_BY_QUEUE, (_live("executor_request_queue"),
                                          _queue("request_queue", "attribute", "read"))))),
    Requirement("control_requests", "requests parked behind a control sentinel "
                "(request_accumulated) and control actions in flight (control_requests)",
                "in-process",
                (Layout(CONTROL_ON_EXECUTOR, (_live("request_accumulated"),
                                              _live("control_requests"))),
                 Layout(CONTROL_ON_REQUEST_QUEUE,
                        (_live("executor_request_queue"),
                         _queue("request_accumulated", "attribute", "read"),
                         _queue("control_requests", "attribute", "read"))),
                 Layout(NO_CONTROL, (), absent=(_pyexec("control_action", "method"),
                                                _pyexec("enqueue_control_request", "method"),
                                                _queue("enqueue_control_request")))),
                resolve="any"),
    Requirement("ctx_in_transfer", "context requests whose KV a generation worker is "
                "still pulling (dropped from active_requests)", "in-process",
                (Layout(TRANSFER_MANAGER,
                        (_live("async_transfer_manager"),
                         Member(TRANSFER_MANAGER_FILES, "AsyncTransferManager",
                                "requests_in_transfer", "method"))),
                 Layout(CTX_IN_TRANSMISSION, (_live("ctx_in_transmission_requests"),)))),
    Requirement("kv_connector", "KV connector saves: counted by the transfer manager; on "
                "the older layout only kv_connector_manager tells that one may hold KV "
                "(then UNKNOWN)", "in-process",
                (Layout(TRANSFER_MANAGER, (_live("async_transfer_manager"),)),
                 Layout("kv_connector_manager", (_live("kv_connector_manager"),)))),
    Requirement("iteration_counter", "the executor loop's pass counter that confirms a "
                "zero (without it, two readings 2 ms apart: weaker)", "in-process",
                (Layout("PyExecutor.iter_counter", (_pyexec("iter_counter", "attribute",
                                                            "bumped"),)),
                 Layout("model_engine.iter_counter",
                        (_live("model_engine"),
                         Member(("_torch/pyexecutor/model_engine.py",), "PyTorchModelEngine",
                                "iter_counter", "attribute", "bumped")))),
                required=False),
    Requirement("parked_loop", "the request queue is a stdlib queue.Queue whose waiters "
                "show the loop parked on it (without it, no confirmation by parking)",
                "in-process",
                (Layout("request_queue: queue.Queue",
                        (_live("executor_request_queue"),
                         _queue("request_queue", "attribute", "read", ("Queue",)))),),
                required=False),
    Requirement("is_shutdown", "whether the executor stopped, and whether a shutdown was "
                "requested (the queue's active flag) or a fatal error stopped it",
                "in-process",
                (Layout("PyExecutor.is_shutdown",
                        (_pyexec("is_shutdown"), _live("executor_request_queue"),
                         _queue("active", "attribute", "read"))),
                 Layout("ExecutorRequestQueue.is_shutdown",
                        (_live("executor_request_queue"), _queue("is_shutdown", "attribute"),
                         _queue("active", "attribute", "read")))),
                required=False),
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
