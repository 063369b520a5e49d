"""Which ``Scheduler.is_fully_idle`` the adapter trusts: a fingerprint of its code.

The scheduler-side verdict is SGLang's own ``is_fully_idle()`` plus the queues it does
not look at (:mod:`.scheduler_state`, ``uncovered``). That split is only right for the
body it was checked against: a new SGLang that adds a queue to the scheduler and to
``is_fully_idle`` is fine, but one that adds a queue *elsewhere*, or drops a check from
``is_fully_idle``, would be trusted silently. So the scheduler answers with a fingerprint
of the method it runs (SHA-256 of the AST of its source, unwrapped from any hook:
comments, blank lines and formatting do not count, any change to the code does), and the
main process accepts only the fingerprints in :data:`TESTED_IDLE_FINGERPRINTS` (plus any
the operator adds after reading the new body). Anything else is UNKNOWN, with the
fingerprint in the reason.

The same code gives the same fingerprint on every Python from 3.10 to 3.13 (checked):
the AST is written out field by field with its field names, leaving out fields that are
empty (``None`` or ``[]``). ``ast.dump`` itself is not stable across versions (3.12 adds
``type_params=[]`` to every function, 3.13 leaves empty fields out), so a fingerprint
taken with it on 3.11 never matched the same SGLang running on 3.12.

Cost: the first call per process reads and parses the method's source (about a
millisecond, once, on the scheduler's loop thread); later calls are one dict lookup.
A method whose source cannot be read (no ``.py`` in the install) raises, and the state
answers with that error: UNKNOWN.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from typing import Any

TESTED_IDLE_FINGERPRINTS: dict[str, str] = {
    "0.5.23": "6f3f9183c255378e",
}
"""SGLang release → fingerprint of its ``Scheduler.is_fully_idle``, as checked by
tests/integration/sglang/test_coverage.py against the installed wheel."""
REFUSED_IDLE_FINGERPRINTS: dict[str, str] = {
    "0.5.21": "3b00b244f84bc11a",
}
"""Bodies read from a release's wheel whose logic differs from a tested one's (0.5.21:
0.5.23's without its check of decode's deferred KV releases, and without the
``ignore_waiting`` rule for waiting requests that hold KV): never accepted, not even as
the running release's own (:func:`installed_idle_fingerprint`)."""

_cache: dict[Any, str] = {}


def idle_fingerprint(scheduler_class: type) -> str:
    """The fingerprint of ``scheduler_class.is_fully_idle`` (module docstring).

    Raises AttributeError (no such method), OSError/TypeError (source unavailable) or
    SyntaxError; callers turn any of them into UNKNOWN.
    """
    method: Any = getattr(scheduler_class, "is_fully_idle", None)
    if method is None:
        raise AttributeError(f"{scheduler_class.__name__} has no is_fully_idle")
    func = inspect.unwrap(method)
    key = getattr(func, "__code__", func)
    cached = _cache.get(key)
    if cached is not None:
        return cached
    digest = source_fingerprint(inspect.getsource(func))
    _cache[key] = digest
    return digest


def source_fingerprint(source: str) -> str:
    """The fingerprint of one function's source text (indented or not; module docstring).

    Raises SyntaxError for text that does not parse.
    """
    tree = ast.parse(textwrap.dedent(source))
    return hashlib.sha256(_canonical(tree).encode()).hexdigest()[:16]


def _canonical(node: Any) -> str:
    """``node`` written out with its field names, empty fields left out (the same text on
    every Python that parses the code to the same tree)."""
    if isinstance(node, ast.AST):
        fields = [f"{name}={_canonical(value)}" for name in node._fields
                  if (value := getattr(node, name, None)) is not None and value != []]
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return f"[{','.join(_canonical(item) for item in node)}]"
    return repr(node)


def accepted_fingerprints(extra: tuple[str, ...] = ()) -> frozenset[str]:
    """The tested fingerprints plus ``extra`` (the operator's own, after review)."""
    return frozenset(TESTED_IDLE_FINGERPRINTS.values()) | frozenset(extra)


def installed_idle_fingerprint() -> str:
    """The fingerprint of the installed SGLang's ``Scheduler.is_fully_idle``, read in this
    process (the scheduler processes run the same installed code). Imports SGLang's
    scheduler module: call it where SGLang is loaded already (``Engine`` imports it).
    Raises ImportError, or what :func:`idle_fingerprint` raises."""
    from sglang.srt.managers.scheduler import Scheduler  # noqa: PLC0415 (optional engine)

    return idle_fingerprint(Scheduler)
