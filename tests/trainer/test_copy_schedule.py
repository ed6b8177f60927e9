"""worker/copy_schedule.py, pure: which step boundaries refresh with and without a cost budget, what
a calibration charges a refresh (the steps beside it against the clear ones), the interval it
proposes (property: the fewest steps that keep within the budget, never below the floor nor below
a refresh's duration), and what it refuses. The worker's use of it, with real gloo processes that
agree on one interval: test_worker_buddy_copies.py."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_trainer.worker.copy_schedule import (
    BESIDE_STEPS,
    CALIBRATION_PERIOD,
    CALIBRATION_REFRESHES,
    CopySchedule,
    propose,
)


def _calibrate(schedule: CopySchedule, clear_s: float, cost_s: float, took: int = 1, between_s: float = 0.0) -> None:
    """Run ``schedule``'s calibration as the training loop does: steps of ``clear_s``, the ``cost_s``
    of each refresh spread over the steps beside it, each refresh seen ended ``took`` steps later,
    starting each taking the training thread ``between_s`` between two steps."""
    assert schedule.agree_at is not None
    step, started = schedule.starts[0] - 1, None
    while step < schedule.agree_at:
        step += 1
        beside = any(s < step <= s + BESIDE_STEPS for s in schedule.starts)
        schedule.record_step(step, clear_s + (cost_s / BESIDE_STEPS if beside else 0.0))
        if started is not None and step - started >= took:
            schedule.ended(step)
            started = None
        if step < schedule.agree_at and schedule.due(step):
            schedule.started(step, between_s)
            started = step


def test_without_a_budget_every_interval():
    schedule = CopySchedule(interval=3, budget_percent=None, first=10)
    assert schedule.agree_at is None
    assert [n for n in range(10, 25) if schedule.due(n)] == [12, 15, 18, 21, 24]


def test_calibration_refreshes_then_the_agreed_interval():
    schedule = CopySchedule(interval=1, budget_percent=2.0, first=7)
    # Past the epoch's warm-up step and the next, on multiples of the period; before them every
    # replicaIntervalSteps, but none in the two steps before the first.
    assert schedule.starts == [12, 16, 20, 24] and schedule.agree_at == 28
    assert [n for n in range(7, 28) if schedule.due(n)] == [7, 8, 9, *schedule.starts]
    _calibrate(schedule, clear_s=0.5, cost_s=0.03)
    calibration = schedule.proposal()
    assert calibration.cost_s == pytest.approx(0.03) and calibration.clear_step_s == pytest.approx(0.5)
    assert calibration.refreshes == CALIBRATION_REFRESHES and calibration.refresh_steps == 1
    assert calibration.proposal == 3  # 30 ms a refresh at 2 % of 0.5 s: every 3 steps
    schedule.adopt(5, calibration)  # another rank needed more
    assert schedule.interval == 5
    assert [n for n in range(28, 45) if schedule.due(n)] == [30, 35, 40]
    # 1000 steps on it calibrates again, at the interval in force (longer than the period).
    assert schedule.starts == [1030, 1035, 1040, 1045] and schedule.agree_at == 1050
    assert [n for n in range(1000, 1050) if schedule.due(n)] == [1000, 1005, 1010, 1015, 1020, 1025, *schedule.starts]
    _calibrate(schedule, clear_s=2.0, cost_s=0.03)  # the steps grew longer: every step fits
    again = schedule.proposal()
    assert again.cost_s == pytest.approx(0.03) and again.proposal == 1
    schedule.adopt(1, again)  # below the interval in force, not below replicaIntervalSteps
    assert schedule.interval == 1 and schedule.agree_at is not None and schedule.starts[0] >= 2050


def test_the_training_threads_time_between_steps_is_charged_too():
    schedule = CopySchedule(interval=1, budget_percent=2.0, first=0)
    _calibrate(schedule, clear_s=0.5, cost_s=0.02, between_s=0.01)
    calibration = schedule.proposal()
    assert calibration.cost_s == pytest.approx(0.03) and calibration.proposal == 3


def test_a_longer_floor_calibrates_at_its_own_interval():
    schedule = CopySchedule(interval=6, budget_percent=1.0, first=0)
    assert schedule.starts == [6, 12, 18, 24] and schedule.agree_at == 30
    _calibrate(schedule, clear_s=1.0, cost_s=0.001)
    assert schedule.proposal().proposal == 6  # within budget at the floor: the floor
    with pytest.raises(ValueError, match="below replicaIntervalSteps"):
        schedule.adopt(5, schedule.proposal())


def test_a_refresh_that_outlasts_its_steps_spaces_them_by_its_duration():
    schedule = CopySchedule(interval=1, budget_percent=50.0, first=0)
    _calibrate(schedule, clear_s=0.1, cost_s=0.0, took=3)
    calibration = schedule.proposal()
    assert calibration.refresh_steps == 3 and calibration.proposal == 3


def test_noise_below_the_clear_steps_costs_nothing():
    times = {n: 0.5 for n in range(5, 21)}
    for s in (4, 8, 12, 16):
        times[s + 1] = 0.49  # beside steps a little faster than the clear ones
    assert propose(times, [4, 8, 12, 16], {}, 1, 2.0).cost_s == 0.0


def test_what_cannot_be_measured_is_refused():
    with pytest.raises(ValueError, match="clear"):
        propose({5: 0.1, 6: 0.1}, [4], {}, 1, 2.0)
    with pytest.raises(ValueError, match="beside"):
        propose({9: 0.1, 10: 0.1}, [4], {}, 1, 2.0)
    with pytest.raises(ValueError, match="interval 0"):
        CopySchedule(0, None, 0)
    with pytest.raises(ValueError, match="budget"):
        CopySchedule(1, 0.0, 0)
    with pytest.raises(ValueError, match="budget"):
        CopySchedule(1, 150.0, 0)


@given(
    interval=st.integers(1, 12),
    budget=st.floats(0.1, 100),
    clear_s=st.floats(0.01, 10),
    cost_s=st.floats(0, 5),
    took=st.integers(1, 3),
    first=st.integers(0, 1000),
)
def test_the_proposal_is_the_fewest_steps_within_budget(
    interval: int, budget: float, clear_s: float, cost_s: float, took: int, first: int
) -> None:
    schedule = CopySchedule(interval, budget, first)
    assert all(s % max(interval, CALIBRATION_PERIOD) == 0 and s >= first + 2 for s in schedule.starts)
    _calibrate(schedule, clear_s, cost_s, took=min(took, max(interval, CALIBRATION_PERIOD)))
    c = schedule.proposal()
    n = c.proposal
    assert n >= max(interval, c.refresh_steps)
    fits = math.isclose(c.cost_s / (n * c.clear_step_s), budget / 100, rel_tol=1e-6)
    assert c.cost_s / (n * c.clear_step_s) <= budget / 100 or fits
    if n > max(interval, c.refresh_steps):  # the budget set it: one step fewer would not keep within it
        assert c.cost_s / ((n - 1) * c.clear_step_s) > budget / 100 * (1 - 1e-9)
