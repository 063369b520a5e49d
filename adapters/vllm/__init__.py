"""vLLM adapter: a truthful probe for a V1 ``AsyncLLM``, its engine control, and a plugin.

- :class:`VllmProbe` (:mod:`.probe`): frontend unfinished count AND EngineCore's own
  signal (the plugin's detailed snapshot, or ``has_work``), on every DP engine.
- :class:`VllmEngineControl` (:mod:`.control`): ``abort_all`` and ``shutdown``.
- :mod:`.plugin`: the ``vllm.general_plugins`` entry point that adds the snapshot.

Importing this package never imports vLLM; building a probe without vLLM installed
raises :class:`~quiesce.errors.EngineNotInstalled` naming ``pip install 'quiesce[vllm]'``.
"""

from .control import VllmEngineControl
from .probe import TESTED_VERSIONS, VllmProbe, installed_vllm_version, probe_factory

__all__ = ["TESTED_VERSIONS", "VllmEngineControl", "VllmProbe", "installed_vllm_version",
           "probe_factory"]
