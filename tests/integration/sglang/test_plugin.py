"""quiesce's SGLang plugin through SGLang's real plugin machinery.

In this process: SGLang's ``HookRegistry`` applies quiesce's AFTER hook to the real
``Scheduler.get_internal_state``, whose answer then carries the scheduler's state and
still encodes with SGLang's own msgpack encoder. In a child process: SGLang's own
``load_plugins()`` finds the ``sglang.srt.plugins`` entry point, runs :func:`register`,
applies the hook, and guards the process's SIGTERM/SIGINT under a quiesce owner (a signal
is then ignored, as it must be in a scheduler process mid-drain); ``SGLANG_PLUGINS``
without ``quiesce`` leaves both out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.sglang import SKIP_REASON

pytest.importorskip("sglang", reason=SKIP_REASON)

from sglang.srt.managers.io_struct import GetInternalStateReq

from quiesce.adapters.sglang.plugin import ENTRY_POINT_GROUP, HOOK_TARGET
from quiesce.adapters.sglang.scheduler_state import SCHEMA, STATE_KEY
from quiesce.signal_guard import OWNER_ENV
from tests.integration.sglang import shells

msgspec: Any = pytest.importorskip("msgspec", reason=SKIP_REASON)

CHILD = r"""
import json, os, signal, sys
from sglang.srt.plugins import load_plugins
from sglang.srt.managers.scheduler import Scheduler
load_plugins()
fn = Scheduler.get_internal_state
hooked = getattr(fn, "__wrapped__", None) is not None
survived = []
for sig in (signal.SIGTERM, signal.SIGINT):
    handler = signal.getsignal(sig)
    os.kill(os.getpid(), sig)  # unguarded: SIGTERM kills us, SIGINT raises KeyboardInterrupt
    survived.append(signal.Signals(sig).name)
print(json.dumps({"hooked": hooked, "survived": survived,
                  "handler": type(signal.getsignal(signal.SIGTERM)).__name__}))
"""


def test_the_hook_adds_the_state_to_the_real_answer(hooked: None) -> None:
    s = shells.scheduler("prefill")
    s.disagg_prefill_inflight_queue.append(shells.req())
    out = s.get_internal_state(GetInternalStateReq())
    assert out.internal_state["component"] == "stand-in"  # SGLang's own answer kept
    state = out.internal_state[STATE_KEY]
    assert state["schema"] == SCHEMA and state["is_fully_idle"] is False
    assert state["counts"]["prefill_inflight"] == 1
    # what crosses ZMQ: SGLang's msgspec struct, encoded and decoded
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=type(out))
    assert wire.internal_state[STATE_KEY] == state


def _child(tmp_path: Path, plugins: str | None) -> dict[str, object]:
    owner = tmp_path / "owner"
    owner.mkdir()
    env = {**os.environ, OWNER_ENV: f"{os.getpid()}:{owner}"}
    env.pop("SGLANG_PLUGINS", None)
    if plugins is not None:
        env["SGLANG_PLUGINS"] = plugins
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    if plugins is not None and "quiesce" not in plugins:
        # unguarded: the child dies of its own SIGTERM, as an SGLang process would
        assert proc.returncode == -15, proc.stderr[-2000:]
        return {}
    assert proc.returncode == 0, proc.stderr[-2000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "ignores SIGTERM" in proc.stderr and "ignores SIGINT" in proc.stderr
    assert list(owner.iterdir()), "guard_process writes its marker into the owner directory"
    return result


@pytest.mark.parametrize("plugins", [None, "quiesce"])
def test_sglang_loads_the_plugin_which_hooks_and_guards(tmp_path: Path,
                                                        plugins: str | None) -> None:
    result = _child(tmp_path, plugins)
    assert result == {"hooked": True, "survived": ["SIGTERM", "SIGINT"],
                      "handler": "_GuardedHandler"}


def test_sglang_plugins_whitelist_without_quiesce_leaves_it_out(tmp_path: Path) -> None:
    assert _child(tmp_path, "someone_else") == {}


def test_the_entry_point_is_where_sglang_looks() -> None:
    from importlib.metadata import entry_points

    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP

    assert ENTRY_POINT_GROUP == GENERAL_PLUGINS_GROUP
    names = {ep.name: ep.value for ep in entry_points(group=GENERAL_PLUGINS_GROUP)}
    assert names.get("quiesce") == "quiesce.adapters.sglang.plugin:register"
    assert HOOK_TARGET.rsplit(".", 1)[0] == "sglang.srt.managers.scheduler.Scheduler"
