"""SGLang adapter: a truthful probe for an SGLang worker, its engine control, and a plugin.

Checked against SGLang 0.5.23 (contract tests on CPU against the real scheduler code,
tests/integration/sglang); 0.5.21 (what ai-dynamo 1.6.1 pins) was checked against its
source and does not fit (:data:`~.probe.UNSUPPORTED_VERSIONS`). By process:

- **main process** (holds ``Engine`` / ``TokenizerManager``):
  :class:`SglangProbe` (:mod:`.probe`) ANDs the scheduler's own ``is_fully_idle()`` on
  every DP rank (:mod:`.scheduler_rpc`, one bounded round trip) with ``rid_to_state`` and
  the shared-memory load snapshot (:mod:`.frontend`, no round trip), for the layout
  SGLang resolved (:mod:`.topology`: DP ranks = ``dp_size * attn_dp_size``; PP > 1 on a
  disaggregated worker is UNKNOWN);
  :class:`SglangEngineControl` (:mod:`.control`) aborts everything (forced path; on
  prefill it waits for aborted KV writes, or counts them abandoned) and shuts the
  engine down; :mod:`.signals` keeps SGLang's own SIGTERM drain out;
  :mod:`.serving` runs the engine behind ``quiesce serve``.
- **scheduler processes**: :mod:`.scheduler_state` reads the queues (and what
  ``is_fully_idle`` does not cover), with its rank and a fingerprint of
  ``is_fully_idle`` (:mod:`.idle_fingerprint`); :mod:`.plugin`
  (entry point ``sglang.srt.plugins``) hooks it into ``get_internal_state`` and guards
  every SGLang process's SIGTERM/SIGINT.

Importing this package never imports SGLang; building a probe without SGLang installed
raises :class:`~quiesce.errors.EngineNotInstalled` naming ``pip install 'quiesce[sglang]'``.
"""

from .control import SglangEngineControl
from .probe import (
    TESTED_VERSIONS,
    UNSUPPORTED_VERSIONS,
    SglangProbe,
    accept_untested,
    installed_sglang_version,
    probe_factory,
    untested_fingerprints,
)

__all__ = ["TESTED_VERSIONS", "UNSUPPORTED_VERSIONS", "SglangEngineControl", "SglangProbe",
           "accept_untested", "installed_sglang_version", "probe_factory",
           "untested_fingerprints"]
