"""Status computation (``megatron_operator.status``), pure.

Scenarios: Ready, Recovering, Failed and Succeeded are exclusive and flip together; a condition
keeps its lastTransitionTime until its status flips; Degraded says why (shrunk mesh or below
minReplicas); SparesExhausted follows the ready spares; mesh, epoch, ready counts and completion
time are filled in; an unchanged observation writes nothing; a change of the step alone is
progress, written no more often than the status's size allows; so is the buddy copies' step, whose
distance from the step the operator exports (a series only while every member holds a copy).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from operator_factories import JOB_UID, make_pod_refs, make_spec
from prometheus_client import REGISTRY

from megatron_contract.job import JobPhase, MegatronJobStatus
from megatron_operator import kube, metrics, status_writer
from megatron_operator.builders import JobRef
from megatron_operator.goodput import GoodputLedger
from megatron_operator.heartbeats import HeartbeatBook
from megatron_operator.planner import plan_mesh
from megatron_operator.status import (
    PROGRESS_WRITE_BYTES_PER_SECOND,
    Observation,
    Reason,
    compute_status,
    progress_only,
    progress_write_gap,
    status_body,
    status_changed,
)
from megatron_operator.status_writer import StatusWriter

T0 = datetime(2026, 1, 1, tzinfo=UTC)
SPEC = make_spec(replicas=2, spares=1)
PLAN = plan_mesh(SPEC, JOB_UID, make_pod_refs(2), [], [], None).plan


def _obs(phase: JobPhase, reason: str = "R", **kw: object) -> Observation:
    base: dict[str, object] = dict(
        phase=phase,
        reason=reason,
        message="m",
        plan=PLAN,
        replicas=2,
        ready_workers=2,
        spares_ready=1,
        spares_wanted=1,
        recoveries=0,
    )
    base.update(kw)
    return Observation(**base)  # type: ignore[arg-type]


def _conds(status: MegatronJobStatus) -> dict[str, tuple[str, str, datetime]]:
    return {c.type: (c.status, c.reason, c.last_transition_time) for c in status.conditions}


def test_exclusive_conditions_flip_together() -> None:
    running = compute_status(MegatronJobStatus(), _obs(JobPhase.RUNNING, Reason.TRAINING), T0)
    c = _conds(running)
    assert c["Ready"][0] == "True" and c["Recovering"][0] == "False"
    recovering = compute_status(running, _obs(JobPhase.RECOVERING, Reason.RECOVERING), T0 + timedelta(seconds=5))
    c = _conds(recovering)
    assert c["Ready"][0] == "False" and c["Recovering"][0] == "True"
    assert c["Ready"][2] == c["Recovering"][2] == T0 + timedelta(seconds=5)
    failed = compute_status(recovering, _obs(JobPhase.FAILED, Reason.MAX_RECOVERIES), T0 + timedelta(seconds=9))
    c = _conds(failed)
    assert c["Failed"][:2] == ("True", Reason.MAX_RECOVERIES)
    assert c["Ready"][0] == c["Recovering"][0] == "False"
    assert failed.completion_time == T0 + timedelta(seconds=9)


def test_transition_time_moves_only_on_a_flip() -> None:
    first = compute_status(MegatronJobStatus(), _obs(JobPhase.RUNNING), T0)
    again = compute_status(first, _obs(JobPhase.RUNNING, ready_workers=1), T0 + timedelta(seconds=30))
    assert _conds(again)["Ready"][2] == T0
    assert again.ready == "1/2"


def test_degraded_says_why() -> None:
    shrunk_plan = plan_mesh(SPEC, JOB_UID, make_pod_refs(2)[1:], [], ["p0"], PLAN).plan
    shrunk = compute_status(MegatronJobStatus(), _obs(JobPhase.RUNNING, plan=shrunk_plan), T0)
    assert _conds(shrunk)["Degraded"][:2] == ("True", Reason.MESH_SHRUNK)
    waiting = compute_status(shrunk, _obs(JobPhase.DEGRADED, Reason.BELOW_MIN_REPLICAS), T0)
    assert _conds(waiting)["Degraded"][:2] == ("True", Reason.BELOW_MIN_REPLICAS)
    full = compute_status(waiting, _obs(JobPhase.RUNNING), T0)
    assert _conds(full)["Degraded"][:2] == ("False", Reason.FULL_MESH)


def test_spares_exhausted() -> None:
    none = compute_status(MegatronJobStatus(), _obs(JobPhase.RUNNING, spares_ready=0), T0)
    assert _conds(none)["SparesExhausted"][:2] == ("True", Reason.NO_SPARE_READY)
    some = compute_status(none, _obs(JobPhase.RUNNING, spares_ready=1), T0)
    assert _conds(some)["SparesExhausted"][0] == "False"
    unwanted = compute_status(none, _obs(JobPhase.RUNNING, spares_ready=0, spares_wanted=0), T0)
    assert _conds(unwanted)["SparesExhausted"][:2] == ("False", Reason.NO_SPARES_REQUESTED)


def test_fields_and_no_op() -> None:
    status = compute_status(MegatronJobStatus(), _obs(JobPhase.RUNNING, recoveries=3, step=42), T0)
    assert (status.mesh, status.epoch, status.desired_workers, status.spares_ready, status.recoveries, status.step) == (
        "2x1x1",
        1,
        2,
        1,
        3,
        42,
    )
    assert status.start_time == T0 and status.completion_time is None
    assert not status_changed(status, compute_status(status, _obs(JobPhase.RUNNING, recoveries=3, step=42), T0))
    assert status_changed(status, compute_status(status, _obs(JobPhase.RUNNING, recoveries=4, step=42), T0))


def test_a_step_alone_is_progress_and_its_writes_are_spaced_by_the_status_size() -> None:
    status = compute_status(MegatronJobStatus(), _obs(JobPhase.RUNNING, step=42), T0)
    later = compute_status(status, _obs(JobPhase.RUNNING, step=43), T0 + timedelta(seconds=2))
    assert status_changed(status, later) and progress_only(status_body(status), status_body(later))
    # Anything else that changes is written at once, the step with it.
    recovering = compute_status(status, _obs(JobPhase.RECOVERING, step=43), T0 + timedelta(seconds=2))
    for other in (
        recovering,
        compute_status(status, _obs(JobPhase.RUNNING, step=42, spares_ready=0), T0),
        compute_status(status, _obs(JobPhase.RUNNING, step=42, checkpoint_step=40), T0),
    ):
        assert not progress_only(status_body(status), status_body(other))
        assert not progress_only(status_body(other), status_body(status))
    # The gap grows with the object: a plan of 4096 pods waits seconds, a small job a fraction of one.
    small = progress_write_gap(status_body(status))
    big_plan = plan_mesh(make_spec(replicas=4096, spares=1), JOB_UID, make_pod_refs(4096), [], [], None).plan
    big = compute_status(MegatronJobStatus(), _obs(JobPhase.RUNNING, plan=big_plan, replicas=4096, step=1), T0)
    assert small < 0.2 < 2.0 < progress_write_gap(status_body(big))
    assert progress_write_gap({"x": "y" * PROGRESS_WRITE_BYTES_PER_SECOND}) > 1.0


def test_the_writer_holds_progress_alone_for_the_gap_after_its_last_write(monkeypatch: pytest.MonkeyPatch) -> None:
    written: list[dict[str, object]] = []

    async def write_status(namespace: str, name: str, body: dict[str, object]) -> None:
        written.append(body)

    monkeypatch.setattr(kube, "write_status", write_status)
    clock = [100.0]
    monkeypatch.setattr(status_writer.time, "monotonic", lambda: clock[0])
    labels = metrics.job_labels("ns", "job")
    writer = StatusWriter(JobRef("job", "ns", JOB_UID), HeartbeatBook(), labels, GoodputLedger.resume(0.0, None))

    def write(old: MegatronJobStatus, step: int, force: bool = False) -> MegatronJobStatus:
        return asyncio.run(writer.write(old, _obs(JobPhase.RUNNING, step=step), [], T0, force))

    first = write(MegatronJobStatus(), 1)
    gap = progress_write_gap(written[-1])
    assert len(written) == 1 and 0 < gap < 1
    assert write(first, 2) is first and len(written) == 1  # progress alone, within the gap: held
    assert write(first, 2, force=True).step == 2 and len(written) == 2  # a forced write always goes
    clock[0] += gap * 0.9
    assert write(first, 3) is first and len(written) == 2  # the gap counts from the last write
    clock[0] += gap * 0.2
    assert write(first, 3).step == 3 and len(written) == 3


def test_the_buddy_copies_step_is_progress_and_its_lag_is_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    async def write_status(namespace: str, name: str, body: dict[str, object]) -> None:
        pass

    monkeypatch.setattr(kube, "write_status", write_status)
    labels = metrics.job_labels("ns", "copies")
    writer = StatusWriter(JobRef("copies", "ns", JOB_UID), HeartbeatBook(), labels, GoodputLedger.resume(0.0, None))

    def lag() -> float | None:
        return REGISTRY.get_sample_value("megatron_operator_buddy_copy_lag_steps", labels)

    def write(old: MegatronJobStatus, step: int, copies: int | None) -> MegatronJobStatus:
        obs = _obs(JobPhase.RUNNING, step=step, buddy_copy_step=copies)
        return asyncio.run(writer.write(old, obs, [], T0, True))

    try:
        status = write(MegatronJobStatus(), 42, 40)
        assert status.buddy_copy_step == 40 and status_body(status)["buddyCopyStep"] == 40 and lag() == 2
        later = compute_status(status, _obs(JobPhase.RUNNING, step=43, buddy_copy_step=42), T0)
        assert progress_only(status_body(status), status_body(later))  # it moves with every refresh
        assert write(status, 43, 44).buddy_copy_step == 44 and lag() == 0  # copies ahead of the reports
        # A new epoch: no complete copy on every member yet, the field and the series are gone.
        status = write(status, 44, None)
        assert "buddyCopyStep" not in status_body(status) and lag() is None
    finally:
        metrics.forget_job("ns", "copies")
