"""TensorRT-LLM adapter: probes over the executor that owns the engine, control, serving,
and a drift checker that reads TensorRT-LLM's sources without importing them.

Modules, each with its contract in its docstring:

- :mod:`.layouts`: the names of TensorRT-LLM the adapter reads, with the known layouts
  (``AsyncTransferManager`` vs ``ctx_in_transmission_requests``, the waiting queue on
  ``PyExecutor`` vs on ``ExecutorRequestQueue``);
- :mod:`.executor_reader`: one ``PyExecutor``'s pending work, read in its own process;
- :mod:`.zero_confirmation`: a zero reading accepted only once confirmed across a pass
  of the executor loop;
- :mod:`.probe`: the probe per layout (in-process, Ray, multi-process proxy) and the
  registry entry point :func:`probe_factory`;
- :mod:`.ray_extension`: the Ray worker extension that runs the reading in every rank;
- :mod:`.control`: ``abort_all`` and ``shutdown`` (:class:`TrtllmEngineControl`);
- :mod:`.serving`: ``quiesce serve --engine trtllm`` (:class:`~.serving.TrtllmServing`,
  imported from its module so that this package stays light);
- :mod:`.doctor`: ``quiesce doctor trtllm`` and :func:`~.doctor.startup_check`, over
  :mod:`.source_index` (what each class of a source file defines, read with ``ast``).

Signals, per layout (the worker owns SIGTERM/SIGINT, :mod:`quiesce.signal_guard`):

- **single-process worker** (what ``quiesce serve --engine trtllm`` runs): the
  ``PyExecutor`` runs in threads of the worker's own process, and Python delivers
  signals to the main thread only, where the worker's handlers are. No engine process
  exists that a group or every-process signal could stop on its own. The serving module
  checks that TensorRT-LLM left the main thread's handlers in place (and restores them);
  ``LLM``'s own shutdown runs only when the worker calls it after the drain.
- **Ray**: the workers are Ray actors, started by the raylet: a signal to the worker's
  process group does not reach them; ``pkill``/systemd does. The worker extension calls
  :func:`~quiesce.signal_guard.guard_process` in each of them, effective only where the
  owner's ``QUIESCE_SIGNAL_OWNER`` reaches the actors (2026 builds copy the owner's
  environment into the actors' ``runtime_env``; older ones may need it passed) and the
  call runs on the actor's main thread; the answer says whether it did.
- **multi-process proxy (MPI)**: TensorRT-LLM spawns its MPI workers itself and offers
  no hook that runs quiesce's code in them, so they are not guarded. The worker's
  start-up report (:meth:`~quiesce.signal_guard.SignalOwnership.report`) lists them as
  unprotected by pid and name; use the single-process worker or Ray where signals reach
  every process.

Importing this package never imports TensorRT-LLM; building a probe without it installed
raises :class:`~quiesce.errors.EngineNotInstalled` naming ``pip install 'quiesce[trtllm]'``.
"""

from .control import TrtllmEngineControl
from .doctor import DriftReport, check_installed, startup_check
from .probe import (
    InProcessProbe,
    ProxyStatsProbe,
    RayProbe,
    installed_trtllm_version,
    probe_factory,
    probe_for_llm,
)
from .ray_extension import EXTENSION

__all__ = ["EXTENSION", "DriftReport", "InProcessProbe", "ProxyStatsProbe", "RayProbe",
           "TrtllmEngineControl", "check_installed", "installed_trtllm_version",
           "probe_factory", "probe_for_llm", "startup_check"]
