"""A simulated LLM engine and its probe: the default engine of the demo, benchmarks and tests.

- :mod:`.engine`: :class:`SimEngine`, an asyncio engine with a waiting queue, a running
  batch, a per-token time model and the parts of disaggregated serving that make
  shutdown dangerous (held KV sends, awaited KV receives);
- :mod:`.probe`: :class:`SimProbe`, which reads the engine's counters (O(1),
  change-notifying), and :func:`probe_factory`, the registry's ``sim`` entry point;
- :mod:`.serving`: :class:`SimServing`, the engine behind ``quiesce serve --engine sim``.
"""

from quiesce.errors import RequestAborted

from .engine import KVFate, SimConfig, SimEngine, SimRequest
from .probe import SimProbe, probe_factory
from .serving import SIM_DEFAULT_MAX_TOKENS, SimServing

__all__ = ["SIM_DEFAULT_MAX_TOKENS", "KVFate", "RequestAborted", "SimConfig", "SimEngine",
           "SimProbe", "SimRequest", "SimServing", "probe_factory"]
