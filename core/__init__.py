"""quiesce: let an LLM inference worker leave service without losing a request.

The mechanisms are re-exported here; see the README for how a worker backend
wires them together.
"""

from quiesce.admission import Admission, AdmissionGate, Outcome, OutcomeCounts
from quiesce.budget import Budget, Deadline
from quiesce.discovery import Discovery, InMemoryDirectory, InMemoryDiscovery
from quiesce.drain import DrainConfig, DrainReport, StageOutcome, StageReport
from quiesce.engine import EngineControl
from quiesce.errors import (
    AdapterNotFound,
    ConfigError,
    EngineNotInstalled,
    InvalidTransition,
    QuiesceError,
    RequestAborted,
    RequestRejected,
    ResumeFailed,
    WorkerDraining,
)
from quiesce.probe import (
    UNKNOWN,
    AllOf,
    ChangeNotifier,
    PendingWork,
    Probe,
    QuiescenceProbe,
    Role,
    Verdict,
    observe,
)
from quiesce.registry import available_adapters, probe_for, register_adapter

__version__ = "0.1.0"

__all__ = [
    "UNKNOWN",
    "AdapterNotFound",
    "Admission",
    "AdmissionGate",
    "AllOf",
    "Budget",
    "ChangeNotifier",
    "ConfigError",
    "Deadline",
    "Discovery",
    "DrainConfig",
    "DrainReport",
    "EngineControl",
    "EngineNotInstalled",
    "InMemoryDirectory",
    "InMemoryDiscovery",
    "InvalidTransition",
    "Outcome",
    "OutcomeCounts",
    "PendingWork",
    "Probe",
    "QuiesceError",
    "QuiescenceProbe",
    "RequestAborted",
    "RequestRejected",
    "ResumeFailed",
    "Role",
    "StageOutcome",
    "StageReport",
    "Verdict",
    "WorkerDraining",
    "__version__",
    "available_adapters",
    "observe",
    "probe_for",
    "register_adapter",
]
