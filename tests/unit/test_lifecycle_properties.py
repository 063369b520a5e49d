"""Stateful property test of :class:`quiesce.lifecycle.Lifecycle`.

Hypothesis drives random interleavings of: admitting requests, ending them in every
outcome (completed, lost, client gone, rejected, or by an exception) and cancelling
them, starting drains (with and without a budget), resuming (also with a failing
registration), changing the fake probe's answers, letting time pass, and a SIGTERM
(:class:`quiesce.shutdown.Shutdown`). The safety properties are checked at the very
moment of every transition (through :meth:`Lifecycle.add_listener`) and after every step.

Each example owns a fresh event loop: every rule runs its coroutine on it with
``run_until_complete``, so the drain run only progresses while a rule runs the loop.

The probe model is honest: a probe answer is changed only once every zero answer
already handed to a drain run has been consumed by it (:meth:`LifecycleMachine._settle`),
so "the probe says busy" really means that no drain run can see "zero" any more. A
drained worker admits nothing and holds nothing, so its engine cannot become busy
again: answers are not changed while the worker is drained.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from collections import deque
from collections.abc import Coroutine
from typing import Any, TypeVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from quiesce import (
    AdmissionGate,
    DrainConfig,
    InMemoryDiscovery,
    InvalidTransition,
    PendingWork,
    ResumeFailed,
    Role,
    WorkerDraining,
)
from quiesce.admission import Admission, Outcome
from quiesce.lifecycle import DrainRun, EventKind, Lifecycle, LifecycleEvent, State
from quiesce.shutdown import EXIT_CLEAN, EXIT_FORCED, EXIT_LOST, Shutdown, ShutdownPolicy

T = TypeVar("T")

CONFIG = DrainConfig(router_grace_s=0.002, probe_timeout_s=0.003, poll_base_s=0.001,
                     poll_cap_s=0.004)


class Answer(enum.Enum):
    ZERO = "zero"
    BUSY = "busy"
    UNKNOWN = "unknown"
    RAISE = "raise"
    HANG = "hang"


NOT_ZERO = [Answer.BUSY, Answer.UNKNOWN, Answer.RAISE, Answer.HANG]


class ModelProbe:
    """A fake standing in for an engine probe (the real engines are covered by their
    adapters' tests).

    Reads first consume ``script`` (transient answers, never zero), then return
    ``steady``. ``HANG`` never answers (``observe`` times it out), ``RAISE`` raises.
    Every zero snapshot handed out is remembered with the drain run that was current,
    so the machine can wait until that run has consumed it.
    """

    def __init__(self) -> None:
        self.steady = Answer.ZERO
        self.script: deque[Answer] = deque()
        self.reads = 0
        self.last_zero: PendingWork | None = None
        self.last_zero_run: DrainRun | None = None
        self.lifecycle: Lifecycle | None = None

    @property
    def role(self) -> Role:
        return Role.AGGREGATED

    @property
    def source(self) -> str:
        return "model"

    def answer(self) -> Answer:
        """What the next read will say if nothing changes meanwhile."""
        return self.script[0] if self.script else self.steady

    async def pending_work(self) -> PendingWork:
        self.reads += 1
        answer = self.script.popleft() if self.script else self.steady
        if answer is Answer.ZERO:
            snapshot = PendingWork.idle(self.role, self.source)
            self.last_zero = snapshot
            self.last_zero_run = self.lifecycle.current_run if self.lifecycle else None
            return snapshot
        if answer is Answer.BUSY:
            return PendingWork(self.role, self.source, waiting=1, running=1, kv_sends_held=0,
                               kv_recvs_awaited=0)
        if answer is Answer.UNKNOWN:
            return PendingWork.unknown(self.role, self.source, "engine metrics unavailable")
        if answer is Answer.RAISE:
            raise RuntimeError("engine RPC failed")
        await asyncio.Event().wait()  # HANG
        raise AssertionError("unreachable")

    async def is_quiescent(self) -> bool:
        return (await self.pending_work()).is_quiescent


class ModelDiscovery(InMemoryDiscovery):
    """In-memory discovery whose next registration can be made to fail."""

    def __init__(self) -> None:
        super().__init__("worker-0")
        self.fail_next_register = False

    async def register(self) -> None:
        if self.fail_next_register:
            self.fail_next_register = False
            raise ConnectionError("discovery unavailable")
        await super().register()


@dataclasses.dataclass
class Held:
    """An admitted request whose body waits until the machine finishes or cancels it."""

    admission: Admission
    done: asyncio.Event
    task: asyncio.Task[None] = dataclasses.field(init=False)
    fail: bool = False
    outcome: Outcome = Outcome.COMPLETED


async def _serve(held: Held) -> None:
    with held.admission:
        await held.done.wait()
        if held.fail:  # an exception nobody mapped: counted lost
            raise RuntimeError("request failed")
        held.admission.finish(held.outcome)


class FakeEngine:
    """EngineControl for the shutdown: aborting ends every request still admitted."""

    def __init__(self, requests: dict[int, Held]) -> None:
        self._requests = requests
        self.aborted = 0
        self.shut_down = False

    async def abort_all(self, reason: str) -> int:
        tasks = [held.task for held in self._requests.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self.aborted += len(tasks)
        return len(tasks)

    async def shutdown(self) -> None:
        self.shut_down = True


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.probe = ModelProbe()
        self.discovery = ModelDiscovery()
        self.gate = AdmissionGate()
        self.lc = Lifecycle(gate=self.gate, probe=self.probe, discovery=self.discovery,
                            config=CONFIG)
        self.probe.lifecycle = self.lc
        self.requests: dict[int, Held] = {}
        self.next_request = 0
        self.stopped = False
        # model of the transitions, filled by the listener at the moment they happen
        self.transitions: list[tuple[State, int]] = [(State.SERVING, 0)]
        self.drain_starts: set[int] = set()
        self.last_resume_generation = 0
        self.violations: list[str] = []
        self.max_generation = 0
        # model of the losses: how many requests ended lost, and how many had when each
        # drain run (by generation) began
        self.lost = 0
        self.lost_at_drain_start: dict[int, int] = {}
        self.lc.add_listener(self._on_event)
        self._run(self.lc.start())

    # -- helpers ---------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def _on_event(self, event: LifecycleEvent) -> None:
        if event.kind is not EventKind.TRANSITION:
            return
        previous_state, previous_generation = self.transitions[-1]
        self.transitions.append((event.state, event.generation))
        if event.generation != previous_generation + 1:
            self.violations.append(f"generation jumped {previous_generation} -> {event}")
        if event.state is State.DRAINING:
            self.drain_starts.add(event.generation)
            self.lost_at_drain_start[event.generation] = self.lost
        elif event.state is State.SERVING:
            self.last_resume_generation = event.generation
        elif event.state is State.DRAINED:
            self._check_drained_transition(event, previous_state)

    def _check_drained_transition(self, event: LifecycleEvent, previous: State) -> None:
        def bad(why: str) -> None:
            self.violations.append(f"drained at generation {event.generation}: {why}")

        if previous is not State.DRAINING:
            bad(f"came from {previous.value}, not draining")
        if self.gate.inflight:
            bad(f"{self.gate.inflight} request(s) still admitted")
        run_start = self.lost_at_drain_start.get(event.generation - 1)
        if run_start is None or self.lost != run_start:
            bad(f"{self.lost - (run_start or 0)} request(s) lost since the run began")
        if self.gate.accepting:
            bad("admission is open")
        if self.probe.steady is not Answer.ZERO or self.probe.script:
            bad(f"the probe answers {self.probe.answer().value}")
        run = self.lc.current_run
        if run is None:
            bad("there is no drain run")
            return
        if run.generation != event.generation - 1 or run.generation not in self.drain_starts:
            bad(f"published by the run of generation {run.generation}")
        if run.generation <= self.last_resume_generation:
            bad(f"the run of generation {run.generation} predates the resume at "
                f"generation {self.last_resume_generation}")

    async def _settle(self) -> None:
        """Let the current drain run consume a zero answer the probe already handed out."""
        for _ in range(10_000):
            run, zero = self.probe.last_zero_run, self.probe.last_zero
            if (zero is None or run is None or run is not self.lc.current_run
                    or run.task.done() or run.last_pending_work is zero):
                return
            await asyncio.sleep(0)
        raise AssertionError("a zero probe answer was never delivered to its drain run")

    async def _finish(self, held: Held) -> None:
        await asyncio.wait({held.task}, timeout=5.0)
        assert held.task.done(), "a released request did not end"
        if not held.task.cancelled():
            error = held.task.exception()
            assert error is None or str(error) == "request failed", error

    def _pick(self, pick: int) -> Held | None:
        if not self.requests:
            return None
        return self.requests.pop(sorted(self.requests)[pick % len(self.requests)])

    # -- rules -----------------------------------------------------------------------

    @precondition(lambda self: not self.stopped)
    @rule()
    def admit(self) -> None:
        rejected = self.gate.refused_total
        request_id = self.next_request
        self.next_request += 1
        states: list[State] = []

        async def admit() -> Held | None:
            states.append(self.lc.state)
            try:
                admission = self.gate.admit(f"r{request_id}")
            except WorkerDraining:
                return None
            held = Held(admission, asyncio.Event())
            held.task = asyncio.get_running_loop().create_task(_serve(held))
            return held

        held = self._run(admit())
        state = states[0]
        if held is None:
            assert state is not State.SERVING, "a serving worker refused a request"
            assert self.gate.refused_total == rejected + 1
        else:
            assert state in (State.SERVING, State.DRAINING), f"admitted while {state.value}"
            self.requests[request_id] = held

    # Whether a request was admitted depends on timing (the router grace), so these two
    # rules are no-ops without requests instead of having a precondition on it: the
    # enabled rules must not depend on timing, or Hypothesis cannot replay an example.
    @precondition(lambda self: not self.stopped)
    @rule(pick=st.integers(min_value=0, max_value=1_000), fail=st.booleans(),
          outcome=st.sampled_from(list(Outcome)))
    def finish_request(self, pick: int, fail: bool, outcome: Outcome) -> None:
        held = self._pick(pick)
        if held is None:
            return
        held.fail = fail  # fail: released through the exception path
        held.outcome = outcome
        before = self.gate.outcomes()
        held.done.set()
        self._run(self._finish(held))
        assert held.admission.released
        expected = Outcome.LOST if fail else outcome
        assert held.admission.outcome is expected
        assert self.gate.outcomes().ended == before.ended + 1
        if expected is Outcome.LOST:
            self.lost += 1

    @precondition(lambda self: not self.stopped)
    @rule(pick=st.integers(min_value=0, max_value=1_000))
    def cancel_request(self, pick: int) -> None:
        held = self._pick(pick)
        if held is None:
            return
        held.task.cancel()  # a client disconnect: released through cancellation
        self._run(self._finish(held))
        assert held.admission.released
        assert held.admission.outcome is Outcome.CLIENT_GONE

    @precondition(lambda self: not self.stopped)
    @rule(budget=st.one_of(st.none(), st.sampled_from([0.0, 0.004, 0.02])))
    def drain(self, budget: float | None) -> None:
        state, generation, before = self.lc.state, self.lc.generation, self.lc.current_run
        run = self._run(self.lc.drain(budget))
        # The loop first runs what was already due, so the current run may have ended
        # (drained or out of budget) between the reads above and drain() itself.
        assert self.lc.current_run is run
        assert run.generation in self.drain_starts
        if run is before:  # in progress or drained: the same run, never a second one
            assert state is not State.SERVING
            assert self.lc.generation in (generation, generation + 1)
        else:  # serving, or the previous run ended without drained: a fresh run
            assert state is not State.DRAINED
            assert before is None or before.task.done()
            if state is State.DRAINING:
                assert before is not None
                previous = before.report
                assert previous is not None and not previous.drained
            assert run.generation == generation + 1 and run.budget_s == budget
        assert self.lc.state in (State.DRAINING, State.DRAINED)

    @precondition(lambda self: not self.stopped)
    @rule(registration_fails=st.booleans())
    def resume(self, registration_fails: bool) -> None:
        state, generation, before = self.lc.state, self.lc.generation, self.lc.current_run
        self.discovery.fail_next_register = registration_fails
        try:
            self._run(self.lc.resume())
        except ResumeFailed:
            assert registration_fails and state is not State.SERVING
            assert self.lc.state is not State.SERVING
            assert not self.gate.accepting
            error = self.lc.last_error
            assert error is not None and "discovery unavailable" in error
            fresh = self.lc.current_run
            assert fresh is not None and fresh is not before
            assert fresh.generation in self.drain_starts
        except InvalidTransition:
            assert self.lc.state is not State.SERVING
            raise AssertionError("resume refused although the worker is not stopping") from None
        else:
            assert self.lc.state is State.SERVING
            assert self.gate.accepting and self.discovery.registered
            if state is State.SERVING:
                assert self.lc.generation == generation
            else:
                assert self.lc.generation > generation
                assert before is not None and before.task.done()
        finally:
            self.discovery.fail_next_register = False

    @precondition(lambda self: not self.stopped)
    @rule(transient=st.lists(st.sampled_from(NOT_ZERO), max_size=2),
          steady=st.sampled_from(list(Answer)))
    def set_probe_answers(self, transient: list[Answer], steady: Answer) -> None:
        self._run(self._settle())
        if self.lc.state is State.DRAINED:
            return  # nothing is admitted and admission is closed: the engine stays idle
        self.probe.script = deque(transient)
        self.probe.steady = steady

    @rule(ms=st.integers(min_value=1, max_value=25))
    def let_time_pass(self, ms: int) -> None:
        self._run(asyncio.sleep(ms / 1000))

    @precondition(lambda self: not self.stopped)
    @rule(with_engine=st.booleans(), total_s=st.sampled_from([0.02, 0.05]))
    def sigterm(self, with_engine: bool, total_s: float) -> None:
        engine = FakeEngine(self.requests) if with_engine else None
        held_before = len(self.requests)
        quiet_before = self.probe.steady is Answer.ZERO  # transient answers are never zero
        shutdown = Shutdown(self.lc, engine,
                            ShutdownPolicy(total_s=total_s, cleanup_reserve_s=0.01))
        report = self._run(shutdown.run())
        self.stopped = True
        for key in [k for k, held in self.requests.items() if held.task.done()]:
            self._run(self._finish(self.requests.pop(key)))

        assert self.lc.state is State.STOPPING
        assert not self.gate.accepting
        if report.drained:
            assert report.exit_code == EXIT_CLEAN and report.outcome == "drained"
            assert held_before == 0 and quiet_before, "clean exit with work outstanding"
            assert report.aborted_requests == 0
            assert report.requests.lost == 0, "drained with a loss"
        else:
            assert report.exit_code in (EXIT_FORCED, EXIT_LOST)
            assert report.outcome in ("forced", "lost")
            if engine is not None:
                assert report.aborted_requests == held_before == engine.aborted
                assert not self.requests
        if engine is not None:
            assert engine.shut_down

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def safety(self) -> None:
        assert not self.violations, self.violations
        state, generation = self.lc.state, self.lc.generation
        assert generation >= self.max_generation, "generation decreased"
        self.max_generation = generation
        assert (state, generation) == self.transitions[-1]
        assert self.gate.inflight == len(self.requests)
        if state is State.SERVING:
            assert self.gate.accepting
        if state in (State.DRAINED, State.STOPPING):
            assert not self.gate.accepting
        if state is State.DRAINED:
            assert self.gate.inflight == 0
            assert self.probe.answer() is Answer.ZERO
            run = self.lc.current_run
            assert run is not None and run.generation == generation - 1
            assert run.generation > self.last_resume_generation
            report = run.report
            assert report is not None and report.drained
        if self.stopped:
            assert state is State.STOPPING

    def teardown(self) -> None:
        try:
            if not self.stopped:
                self._run(self.lc.stop())
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            if tasks:
                self._run(asyncio.wait(tasks))
            self._run(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()


def test_lifecycle_state_machine() -> None:
    run_state_machine_as_test(
        LifecycleMachine,
        settings=settings(max_examples=60, stateful_step_count=30, deadline=None,
                          database=None),
    )
