"""Skip a module whose real outside part is missing, except where it must be there.

``make test`` installs every real part the integration tests use (etcd, aiperf) and sets
``QUIESCE_REQUIRE_REAL_PARTS=1``; there a missing part fails the collection instead of
skipping the module, so that a broken set-up can never pass as green. Run by hand
without the variable, a module skips with the reason.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from quiesce.adapters.etcd.local import etcd_binary

REQUIRE = "QUIESCE_REQUIRE_REAL_PARTS"


def skip_unless_present(missing: str | None) -> None:
    """At module level: ``missing`` is why the real part is not there (None: it is)."""
    if missing is None:
        return
    if os.environ.get(REQUIRE, "0") not in ("", "0"):
        pytest.fail(f"{missing} ({REQUIRE} is set: `make test` installs it)", pytrace=False)
    pytest.skip(missing, allow_module_level=True)


def require_etcd(client: bool = True) -> None:
    """At module level: the etcd server binary (``ci/setup_etcd.sh``) and, with ``client``,
    the aetcd client library."""
    skip_unless_present(None if etcd_binary() is not None else
                        "the etcd binary is not on PATH: run ci/setup_etcd.sh "
                        "(apt-get install etcd-server)")
    if client:
        skip_unless_present(None if importlib.util.find_spec("aetcd") else
                            "aetcd is not installed: pip install 'quiesce[etcd]'")
