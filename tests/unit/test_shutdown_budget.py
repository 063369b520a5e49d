"""Budget, Deadline and ShutdownPolicy: the budget arithmetic on an injected fake clock.

Deadlines count down and combine; a budget's allowance for a stage is capped by the time
left minus the cleanup reserve (also as a property); bad totals, reserves and policy
values are refused naming the field.

No real signals are sent. Fakes and helpers: :mod:`tests.unit.shutdown_harness`.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quiesce import ConfigError
from quiesce.budget import Budget, Deadline
from quiesce.shutdown import ShutdownPolicy
from tests.unit.shutdown_harness import FakeClock

# -- Deadline ---------------------------------------------------------------------


def test_deadline_after_counts_down_on_the_injected_clock() -> None:
    clock = FakeClock()
    deadline = Deadline.after(5.0, clock)
    assert deadline.bounded
    assert deadline.at == 1005.0
    assert deadline.remaining() == 5.0
    assert not deadline.expired()
    clock.advance(3.0)
    assert deadline.remaining() == 2.0
    clock.advance(2.0)
    assert deadline.remaining() == 0.0
    assert deadline.expired()
    clock.advance(7.0)
    assert deadline.remaining() == 0.0  # never negative
    assert deadline.expired()


def test_unbounded_deadline_never_expires() -> None:
    clock = FakeClock()
    deadline = Deadline.after(None, clock)
    assert not deadline.bounded
    assert deadline.remaining() == math.inf
    clock.advance(1e9)
    assert not deadline.expired()


def test_deadline_earlier_takes_whichever_comes_first() -> None:
    clock = FakeClock()
    deadline = Deadline.after(10.0, clock)
    assert deadline.earlier(None) is deadline
    assert deadline.earlier(3.0).at == 1003.0
    assert deadline.earlier(30.0).at == 1010.0
    unbounded = Deadline.after(None, clock)
    tighter = unbounded.earlier(2.0)
    assert tighter.bounded
    assert tighter.at == 1002.0
    clock.advance(2.0)
    assert tighter.expired()  # the derived deadline keeps the injected clock


# -- Budget -----------------------------------------------------------------------


def test_budget_allowance_is_capped_by_time_left_minus_reserve() -> None:
    clock = FakeClock()
    budget = Budget(10.0, 2.0, clock)
    assert budget.remaining() == 10.0
    assert budget.elapsed() == 0.0
    assert budget.allowance() == 8.0
    assert budget.allowance(3.0) == 3.0
    assert budget.allowance(20.0) == 8.0
    assert budget.cleanup_allowance() == 10.0
    clock.advance(5.0)
    assert budget.allowance() == 3.0
    assert budget.allowance(1.0) == 1.0
    assert budget.allowance(4.0) == 3.0
    assert budget.elapsed() == 5.0
    clock.advance(2.5)  # 2.5 s left, inside the reserve soon
    assert budget.allowance() == 0.5
    clock.advance(1.5)  # 1 s left: all of it belongs to cleanup
    assert budget.allowance() == 0.0
    assert budget.allowance(5.0) == 0.0
    assert budget.cleanup_allowance() == 1.0
    assert budget.cleanup_allowance(0.25) == 0.25
    clock.advance(4.0)  # past the deadline
    assert budget.remaining() == 0.0
    assert budget.allowance() == 0.0
    assert budget.cleanup_allowance() == 0.0
    assert budget.deadline.expired()
    assert budget.elapsed() == 13.0


def test_budget_with_no_reserve_gives_stages_everything() -> None:
    clock = FakeClock()
    budget = Budget(4.0, 0.0, clock)
    clock.advance(1.0)
    assert budget.allowance() == 3.0
    assert budget.cleanup_allowance() == 3.0


@given(total=st.floats(min_value=0.001, max_value=1e6),
       reserve_fraction=st.floats(min_value=0.0, max_value=0.999),
       elapsed=st.floats(min_value=0.0, max_value=2e6),
       cap=st.none() | st.floats(min_value=0.0, max_value=1e6))
def test_budget_allowance_property(total: float, reserve_fraction: float, elapsed: float,
                                   cap: float | None) -> None:
    reserve = total * reserve_fraction
    clock = FakeClock(0.0)
    budget = Budget(total, reserve, clock)
    clock.advance(elapsed)
    remaining = budget.remaining()
    assert remaining == max(0.0, total - elapsed)
    left = max(0.0, remaining - reserve)
    expected = left if cap is None else min(cap, left)
    allowance = budget.allowance(cap)
    assert allowance == expected
    assert allowance >= 0.0
    # a stage never eats into the reserve: what is left after it covers cleanup
    assert allowance == 0.0 or remaining - allowance >= reserve - 1e-9 * total
    cleanup = budget.cleanup_allowance()
    assert cleanup == remaining
    assert cleanup >= allowance


BAD_SECONDS: list[object] = [-1.0, float("nan"), True, False, "5", float("inf"),
                             float("-inf"), None]


@pytest.mark.parametrize("value", BAD_SECONDS, ids=repr)
def test_budget_rejects_a_bad_total_naming_it(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        Budget(value, 1.0)  # type: ignore[arg-type]
    assert info.value.field == "total_s"
    assert "total_s" in str(info.value)


@pytest.mark.parametrize("value", BAD_SECONDS, ids=repr)
def test_budget_rejects_a_bad_reserve_naming_it(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        Budget(10.0, value)  # type: ignore[arg-type]
    assert info.value.field == "cleanup_reserve_s"


@pytest.mark.parametrize("total,reserve", [(5.0, 5.0), (5.0, 6.0), (0.5, 1)])
def test_budget_rejects_a_reserve_not_below_the_total(total: float, reserve: float) -> None:
    with pytest.raises(ConfigError) as info:
        Budget(total, reserve)
    assert info.value.field == "cleanup_reserve_s"
    assert isinstance(info.value, ValueError)


def test_budget_rejects_a_zero_total() -> None:
    with pytest.raises(ConfigError) as info:
        Budget(0, 0)
    assert info.value.field == "total_s"


def test_budget_accepts_ints() -> None:
    budget = Budget(3, 1, FakeClock())
    assert budget.allowance() == 2


# -- ShutdownPolicy ---------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("total_s", -1.0), ("total_s", 0), ("total_s", float("nan")), ("total_s", True),
    ("total_s", "30"), ("total_s", float("inf")), ("total_s", None),
    ("cleanup_reserve_s", -0.1), ("cleanup_reserve_s", float("nan")),
    ("cleanup_reserve_s", False), ("cleanup_reserve_s", "5"),
    ("cleanup_reserve_s", float("inf")), ("cleanup_reserve_s", 30.0),
    ("cleanup_reserve_s", 31.0),
    ("drain_cap_s", -2.0), ("drain_cap_s", float("nan")), ("drain_cap_s", True),
    ("drain_cap_s", "10"), ("drain_cap_s", float("inf")),
])
def test_policy_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        ShutdownPolicy(**{field: value})  # type: ignore[arg-type]
    assert info.value.field == field
    assert field in str(info.value)


def test_policy_defaults_and_valid_values() -> None:
    policy = ShutdownPolicy()
    assert policy.cleanup_reserve_s < policy.total_s
    assert policy.drain_cap_s is None
    assert ShutdownPolicy(total_s=1, cleanup_reserve_s=0, drain_cap_s=0).drain_cap_s == 0
