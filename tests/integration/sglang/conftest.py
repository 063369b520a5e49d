"""Contract tests of the SGLang adapter against the real sglang 0.5.23 wheel (CPU only).

They run in .venv-sglang (``make test-sglang``; ci/setup_sglang_cpu.sh builds it). Every
test module starts with ``pytest.importorskip("sglang", reason=SKIP_REASON)``, so in an
environment without SGLang (the core .venv) each module is skipped with that reason
printed (``-ra``). What stands in for what is said in :mod:`.shells` and in each test.
"""

from collections.abc import Iterator

import pytest


@pytest.fixture
def hooked() -> Iterator[None]:
    """quiesce's hook applied to the real ``Scheduler.get_internal_state`` by SGLang's own
    ``HookRegistry`` (as ``load_plugins`` does in a scheduler process); undone afterwards."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_parallel

    from quiesce.adapters.sglang import plugin

    original = Scheduler.__dict__["get_internal_state"]
    plugin._registered.clear()
    try:
        assert plugin.register_hook() is True
        HookRegistry.apply_hooks()
        with get_parallel().override(pp_size=1, pp_rank=0, tp_rank=0, dp_rank=None):
            yield
    finally:
        Scheduler.get_internal_state = original
        HookRegistry.reset()
        plugin._registered.clear()
