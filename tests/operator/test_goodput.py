"""The goodput ledger: wall time since creation is split into the steps kept and time lost by
cause, and the parts add up to the wall time."""

from __future__ import annotations

import pytest

from megatron_contract.job import Goodput
from megatron_operator.goodput import GoodputLedger


def _parts(g: Goodput) -> float:
    lost = g.lost_seconds
    return g.productive_seconds + sum(getattr(lost, f) for f in type(lost).model_fields)


def test_a_failure_and_its_recovery_are_filed_by_cause() -> None:
    ledger = GoodputLedger(created=0.0)
    ledger.observe(5.0, trained=False, step=None, step_time=None)  # pods starting
    ledger.observe(6.0, trained=True, step=0, step_time=None)  # the first plan trains
    ledger.observe(7.0, trained=True, step=2, step_time=0.4)  # two steps of 0.4 s
    ledger.failure_declared(8.0)  # the last step was seen at 7.0
    ledger.observe(9.0, trained=False, step=2, step_time=0.4)
    ledger.recovered(10.0, first_step_time=0.5)
    ledger.observe(11.0, trained=True, step=3, step_time=0.5)
    g = ledger.snapshot(11.0)
    assert g.wall_seconds == 11.0
    assert g.productive_seconds == pytest.approx(1.3)
    assert g.lost_seconds.waiting_for_capacity == pytest.approx(5.0)
    assert g.lost_seconds.detection == pytest.approx(1.0)
    assert g.lost_seconds.reconfiguration == pytest.approx(1.5)  # 8 -> 10, less the first step
    assert g.lost_seconds.other == pytest.approx(2.2)  # training time outside the steps
    assert g.ratio == pytest.approx(1.3 / 11, abs=1e-4)
    assert _parts(g) == pytest.approx(g.wall_seconds)


def test_steps_discarded_by_a_resume_from_an_older_step_are_redone_not_productive() -> None:
    ledger = GoodputLedger(created=0.0)
    ledger.observe(0.0, trained=True, step=0, step_time=None)
    ledger.observe(10.0, trained=True, step=10, step_time=0.5)  # 5 s of steps
    ledger.failure_declared(10.5)
    ledger.observe(12.0, trained=False, step=6, step_time=0.5)  # restored a checkpoint of step 6
    ledger.recovered(13.0, first_step_time=0.5)
    ledger.observe(20.0, trained=True, step=16, step_time=0.5)
    g = ledger.snapshot(20.0)
    assert g.lost_seconds.redone_steps == pytest.approx(2.0)  # steps 7..10 again
    assert g.productive_seconds == pytest.approx(5.0 - 2.0 + 5.0)
    assert _parts(g) == pytest.approx(20.0)


def test_checkpoint_stalls_count_the_longest_pod_once_per_save_and_new_pods_start_a_baseline() -> None:
    ledger = GoodputLedger(created=0.0)
    ledger.observe(1.0, trained=True, step=0, step_time=None, checkpoint_blocking={"a": 0.0, "b": 0.0})
    ledger.observe(2.0, trained=True, step=1, step_time=0.1, checkpoint_blocking={"a": 1.5, "b": 2.0})
    ledger.observe(3.0, trained=True, step=2, step_time=0.1, checkpoint_blocking={"a": 1.5, "b": 2.0, "c": 3.0})
    ledger.observe(4.0, trained=True, step=3, step_time=0.1, checkpoint_blocking={"a": 1.8, "b": 2.1, "c": 3.0})
    assert ledger.snapshot(4.0).lost_seconds.checkpoint_stalls == pytest.approx(2.0 + 0.3)


def test_a_new_operator_process_continues_from_the_status_and_files_the_gap_as_other() -> None:
    first = GoodputLedger(created=0.0)
    first.observe(0.0, trained=True, step=0, step_time=None)
    first.observe(10.0, trained=True, step=10, step_time=0.9)
    saved = first.snapshot(10.0)
    second = GoodputLedger.resume(0.0, saved)
    second.observe(15.0, trained=True, step=10, step_time=0.9)  # 5 s nobody observed
    g = second.snapshot(15.0)
    assert g.productive_seconds == pytest.approx(9.0)
    assert g.lost_seconds.other == pytest.approx(1.0 + 5.0)
    assert _parts(g) == pytest.approx(15.0)


def test_a_failure_during_a_recovery_belongs_to_it() -> None:
    ledger = GoodputLedger(created=0.0)
    ledger.observe(0.0, trained=True, step=0, step_time=None)
    ledger.observe(2.0, trained=True, step=4, step_time=0.5)
    ledger.failure_declared(3.0)
    ledger.failure_declared(4.0)  # a second pod lost while the first recovery runs
    ledger.recovered(6.0, first_step_time=0.5)
    g = ledger.snapshot(6.0)
    assert g.lost_seconds.detection == pytest.approx(1.0)
    assert g.lost_seconds.reconfiguration == pytest.approx(2.5)
    assert _parts(g) == pytest.approx(6.0)


def test_steps_done_before_the_last_member_reported_move_out_of_waiting() -> None:
    ledger = GoodputLedger(created=0.0)
    ledger.observe(2.0, trained=False, step=None, step_time=None)
    ledger.observe(5.0, trained=False, step=0, step_time=None)  # some members trained, not all reported
    ledger.observe(6.0, trained=True, step=3, step_time=1.0)  # three steps of 1 s, mostly while "waiting"
    g = ledger.snapshot(6.0)
    assert g.productive_seconds == pytest.approx(3.0)
    assert g.lost_seconds.waiting_for_capacity == pytest.approx(3.0)
    assert _parts(g) == pytest.approx(6.0)


def test_productive_time_never_exceeds_the_time_there_was() -> None:
    """Steps counted at the latest step's duration over-count when many arrive at once after a slow
    one; a ratio above 1 once failed the status model and every reconcile after it (CI)."""
    ledger = GoodputLedger(created=0.0)
    ledger.observe(0.0, trained=True, step=0, step_time=None)
    ledger.observe(2.0, trained=True, step=40, step_time=0.5)  # 40 steps "of 0.5 s" in 2 s
    g = ledger.snapshot(2.0)
    assert g.ratio <= 1.0 and g.productive_seconds <= g.wall_seconds
    assert _parts(g) == pytest.approx(2.0)


def test_steps_over_counted_while_training_never_eat_the_waiting_or_the_reconfiguration() -> None:
    """Steps are counted at the slowest member's latest step time: on a loaded machine that runs
    above the mean, and a CI run's ledger moved all of its waiting and reconfiguration into training
    to make room (ratio 0.9955, reconfiguration 0 after a recovery). Over-counts while training are
    taken off the productive time; only a plan's first steps move time out of waiting."""
    ledger = GoodputLedger(created=0.0)
    ledger.observe(4.0, trained=False, step=None, step_time=None)  # pods starting
    ledger.observe(5.0, trained=True, step=0, step_time=None)  # 4 -> 5 filed as training
    step, now = 0, 5.0
    for _ in range(4):  # 2.5 s between passes: 25 steps of 0.1 s, the latest "0.13 s"
        step, now = step + 25, now + 2.5
        ledger.observe(now, trained=True, step=step, step_time=0.13)
    ledger.failure_declared(now + 0.2)
    ledger.recovered(now + 1.7, first_step_time=0.3)
    ledger.observe(now + 1.7, trained=True, step=step + 1, step_time=0.3)
    for _ in range(2):
        step, now = step + 25, now + 2.5
        ledger.observe(now + 1.7, trained=True, step=step + 1, step_time=0.13)
    g = ledger.snapshot(now + 1.7)
    assert g.lost_seconds.waiting_for_capacity == pytest.approx(4.0)
    assert g.lost_seconds.reconfiguration == pytest.approx(1.5 - 0.3)
    assert 0 < g.ratio < 1
    assert _parts(g) == pytest.approx(g.wall_seconds)
