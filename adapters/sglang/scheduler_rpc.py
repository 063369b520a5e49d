"""The scheduler's own verdict, asked from the main process: ``get_internal_state``.

Runs in: the worker's main process, on the event loop. One read is one
``TokenizerManager.get_internal_state()`` call: a ``GetInternalStateReq`` fanned out to
every DP rank (``FanOutCommunicator``, "queueing" mode: callers are served one at a
time), answered by each DP leader at the top of its event loop, so within one loop
iteration when idle and after the current forward step when busy (tens of ms to seconds
for a long prefill). quiesce's plugin hook (:mod:`.plugin`) adds the scheduler's state
(:mod:`.scheduler_state`) to each answer.

Bounded: SGLang's call has no timeout, so a read waits at most ``timeout_s`` and then says
UNKNOWN. The call itself is shielded and kept, never cancelled: cancelling it would leave
SGLang's communicator collecting the late answers into the *next* call's results. A read
that finds a call still in flight waits for that one instead of sending another. Every
answer carries the time the scheduler produced it; an answer produced before this read
began (a call that was already answered when the read joined it) is not used, so a read
never reports state older than itself. Across hosts (multi-node DP) that comparison
assumes clocks in step; a skewed node reads stale (UNKNOWN).

Verdict per read: quiescent only when every DP rank answered, each with the expected
schema, no error, the mode that matches the role, a known ``is_fully_idle`` fingerprint
(:mod:`.idle_fingerprint`), ``is_fully_idle`` true and every queue ``is_fully_idle``
does not cover empty. Answers are keyed by the DP rank each names (``rank.dp``): SGLang's
communicator only counts answers, so a late answer meant for another caller can stand in
for a rank that has not answered; a rank missing from the keys (however many answers
came) is UNKNOWN, and a rank that answered twice counts once (its latest answer). An
answer from a scheduler running more than one pipeline stage on a prefill or decode
worker is UNKNOWN (:mod:`.topology`). A missing ``quiesce`` key (plugin not loaded, e.g.
``SGLANG_PLUGINS`` leaves it out), a timeout or an exception: UNKNOWN with the reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from quiesce.probe import Detail, PendingWork, Role

from .frontend import MODE_OF_ROLE
from .idle_fingerprint import accepted_fingerprints
from .scheduler_state import SCHEMA, STATE_KEY

SCHEDULER_SOURCE = "sglang.scheduler"
DEFAULT_SCHEDULER_TIMEOUT_S = 0.5


class SchedulerStateReader:
    """Reads the scheduler's state from every DP rank; see the module docstring.

    ``fingerprints``: the ``is_fully_idle`` fingerprints to accept (default: the tested
    ones, :func:`.idle_fingerprint.accepted_fingerprints`).
    """

    def __init__(self, tokenizer_manager: Any, timeout_s: float = DEFAULT_SCHEDULER_TIMEOUT_S,
                 clock: Callable[[], float] = time.time,
                 fingerprints: frozenset[str] | None = None) -> None:
        self.tokenizer_manager = tokenizer_manager
        self.timeout_s = timeout_s
        self.fingerprints = accepted_fingerprints() if fingerprints is None else fingerprints
        self._clock = clock
        self._call: asyncio.Future[Any] | None = None

    async def fetch(self) -> tuple[Any, float] | str:
        """One bounded ``get_internal_state`` call: (answers, read start) or why not."""
        started = self._clock()
        call = self._call
        if call is None or call.done():
            try:
                call = asyncio.ensure_future(self.tokenizer_manager.get_internal_state())
            except Exception as exc:  # no such method (drift)
                return f"cannot call get_internal_state ({type(exc).__name__}: {exc})"
            self._call = call
        try:
            answers = await asyncio.wait_for(asyncio.shield(call), self.timeout_s)
        except asyncio.TimeoutError:
            return (f"the scheduler did not answer get_internal_state within "
                    f"{self.timeout_s}s (a long forward step, or a hung scheduler)")
        except Exception as exc:
            return f"get_internal_state failed ({type(exc).__name__}: {exc})"
        return answers, started

    async def read(self, role: Role, expected_ranks: int | None) -> PendingWork:
        if expected_ranks is None:
            return PendingWork.unknown(role, SCHEDULER_SOURCE, "cannot read the number of DP "
                                       "ranks (server_args.dp_size × attn_dp_size)")
        fetched = await self.fetch()
        if isinstance(fetched, str):
            return PendingWork.unknown(role, SCHEDULER_SOURCE, fetched)
        answers, started = fetched
        return states_work(answers, role, expected_ranks=expected_ranks, not_before=started,
                           fingerprints=self.fingerprints)

    def close(self) -> None:
        """Forget a call in flight (its answer is dropped when it arrives)."""
        self._call = None


def states_by_rank(answers: Any, role: Role, *, expected_ranks: int,
                   not_before: float | None = None,
                   fingerprints: frozenset[str] | None = None) -> dict[int, dict[str, Any]] | str:
    """Every DP rank's usable state, keyed by the rank it names, or why not (module
    docstring). A rank answering twice keeps its latest answer."""
    if not isinstance(answers, list):
        return f"get_internal_state answered {type(answers).__name__}"
    want_mode = MODE_OF_ROLE[role]
    accepted = accepted_fingerprints() if fingerprints is None else fingerprints
    states: dict[int, dict[str, Any]] = {}
    for index, answer in enumerate(answers):
        state = answer.get(STATE_KEY) if isinstance(answer, dict) else None
        if not isinstance(state, dict):
            return (f"answer {index} has no {STATE_KEY!r} state: quiesce's SGLang plugin is "
                    "not loaded there (installed? listed in SGLANG_PLUGINS?)")
        rank = state.get("rank")
        dp = rank.get("dp") if isinstance(rank, dict) else None
        where = f"DP rank {dp}" if isinstance(dp, int) else f"answer {index}"
        problem = _problem(state, want_mode, not_before, accepted, role)
        if problem is not None:
            return f"{where}: {problem}"
        if not isinstance(dp, int) or isinstance(dp, bool) or not 0 <= dp < expected_ranks:
            return f"{where} names DP rank {dp!r}, expected 0..{expected_ranks - 1}"
        known = states.get(dp)
        if known is None or state.get("answered_at", 0) >= known.get("answered_at", 0):
            states[dp] = state
    missing = sorted(set(range(expected_ranks)) - set(states))
    if missing:
        return (f"DP rank(s) {missing} did not answer get_internal_state ({len(answers)} "
                f"answer(s) for {expected_ranks} rank(s): a late answer to another caller "
                "can stand in for a missing one)")
    return states


def states_work(answers: Any, role: Role, *, expected_ranks: int,
                not_before: float | None = None,
                fingerprints: frozenset[str] | None = None) -> PendingWork:
    """Combine one internal-state dict per DP rank into a snapshot (module docstring)."""
    states = states_by_rank(answers, role, expected_ranks=expected_ranks,
                            not_before=not_before, fingerprints=fingerprints)
    if isinstance(states, str):
        return PendingWork.unknown(role, SCHEDULER_SOURCE, states)
    totals = dict.fromkeys(("waiting", "running", "kv_sends_held", "kv_recvs_awaited"), 0)
    queues: dict[str, int] = {}
    has_work = paused = False
    for rank, state in sorted(states.items()):
        try:
            counts = {k: int(v) for k, v in state["counts"].items()}
            uncovered = {k: int(v) for k, v in state["uncovered"].items()}
            idle = state["is_fully_idle"]
            if not isinstance(idle, bool):
                raise TypeError(f"is_fully_idle is {idle!r}")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return PendingWork.unknown(role, SCHEDULER_SOURCE,
                                       f"DP rank {rank}: malformed state ({exc!r})")
        has_work = has_work or not idle or any(uncovered.values())
        paused = paused or bool(state.get("engine_paused"))
        totals["waiting"] += counts.get("waiting", 0) + counts.get("prefill_bootstrap", 0) \
            + counts.get("decode_retracted", 0)
        totals["running"] += counts.get("running", 0) + counts.get("chunked", 0)
        totals["kv_sends_held"] += counts.get("prefill_inflight", 0)
        totals["kv_recvs_awaited"] += counts.get("decode_prealloc", 0) \
            + counts.get("decode_transfer", 0)
        for name in ("grammar", "decode_deferred_releases"):
            queues[name] = queues.get(name, 0) + counts.get(name, 0)
        for name, value in uncovered.items():
            queues[name] = queues.get(name, 0) + value
    details: dict[str, Detail] = {"dp_ranks": len(states), "engine_paused": paused}
    return PendingWork(role=role, source=SCHEDULER_SOURCE, waiting=totals["waiting"],
                       running=totals["running"], kv_sends_held=totals["kv_sends_held"],
                       kv_recvs_awaited=totals["kv_recvs_awaited"], queues=queues,
                       engine_has_work=has_work, details=details)


def _problem(state: dict[str, Any], want_mode: str, not_before: float | None,
             fingerprints: frozenset[str], role: Role) -> str | None:
    if state.get("schema") != SCHEMA:
        return f"state schema {state.get('schema')!r}, this quiesce reads {SCHEMA}"
    if "error" in state:
        return f"the scheduler could not read its state: {state['error']}"
    if state.get("mode") != want_mode:
        return f"runs in mode {state.get('mode')!r}, the probe's role needs {want_mode!r}"
    answered = state.get("answered_at")
    if not_before is not None and (not isinstance(answered, (int, float))
                                   or answered < not_before):
        return "the answer predates this read (a late answer to an earlier call)"
    return _code_problem(state, fingerprints, role)


def _code_problem(state: dict[str, Any], fingerprints: frozenset[str],
                  role: Role) -> str | None:
    """Why the scheduler that answered cannot be trusted (layout, code), or None."""
    rank = state.get("rank")
    pp_size = rank.get("pp_size") if isinstance(rank, dict) else None
    if not isinstance(pp_size, int) or pp_size < 1:
        return f"the answer names no pipeline size ({rank!r})"
    if pp_size > 1 and role is not Role.AGGREGATED:
        return (f"pipeline parallelism (pp_size={pp_size}): only pipeline stage 0 answers, "
                "and a later stage can still owe decode its KV")
    fingerprint = state.get("idle_fingerprint")
    if fingerprint not in fingerprints:
        return (f"its Scheduler.is_fully_idle (fingerprint {fingerprint!r}) is not one this "
                "adapter was tested against: it may check other queues than the adapter "
                "assumes; review it and add the fingerprint to accept it")
    return None
