"""Suspending and resuming a job (``reconcile.assess`` with a suspension asked for; ``suspend.py``), pure.

Scenarios: a training job asked to suspend gets a ``suspend`` plan for the same members (a new
epoch, every rank keeping its state) at a step boundary ahead of the reported step, grows nothing
and creates no pod; once a member reports the checkpoint complete every pod, spares included, is
retired and the job is Suspended naming the step; a failed checkpoint keeps the pods (the condition
says SuspendCheckpointFailed) and is tried again after the retry delay, one not complete within
checkpoint.suspendTimeoutSeconds says SuspendCheckpointTimedOut; a member lost while the checkpoint
is written is recovered first; a recovery in flight is let finish (WaitingToSuspend); a job with
nothing trained since its checkpoint, or not started at all, stops at once; a suspended job keeps
no pod and creates none; withdrawn, it creates the spec's pods (as workers) without counting the
old members as failed, and once they are warm a ``resume`` plan loads the checkpoint in every rank;
withdrawn before the pods stopped, the members join again with their state in a ``resume`` plan; the
Suspended condition and the phases follow.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from operator_factories import JOB_UID, ROLE_SPARE, make_pod, make_spec

from megatron_contract.job import ConditionType, JobPhase, MegatronJobSpec, MegatronJobStatus
from megatron_contract.mesh import MeshPlan, PlanReason, StateSourceKind
from megatron_operator.failures import PodFacts
from megatron_operator.planner import Outcome
from megatron_operator.reconcile import AgentSignals, Assessment, assess, phase_of
from megatron_operator.status import Observation, Reason, compute_status
from megatron_operator.suspend import RETRY_SECONDS, Stage, SuspendRequest, stopped

NOW = datetime(2026, 1, 1, tzinfo=UTC)
NODES = {f"gpu-{i}": "True" for i in range(6)}
ASKED = SuspendRequest(Reason.JOB_SUSPENDED, "spec.suspend is true")
CHECKPOINTED = {"checkpoint": {"path": "/ckpt", "suspend_timeout_seconds": 300}}


def _pods(*roles: str, start: int = 0) -> list[PodFacts]:
    return [
        PodFacts.of(make_pod(f"job-{i}", role=role, index=i, ip=f"127.64.0.{i + 1}", node=f"gpu-{i}"))
        for i, role in enumerate(roles, start)
    ]


def _training() -> tuple[MegatronJobSpec, MegatronJobStatus, list[PodFacts]]:
    """Two workers and a spare, training in epoch 1 at step 40 (checkpoint of step 30)."""
    spec = make_spec(replicas=2, spares=1, **CHECKPOINTED)
    pods = _pods("worker", "worker", ROLE_SPARE)
    first = assess(spec, JOB_UID, MegatronJobStatus(), pods[:2], NODES, AgentSignals(), {})
    assert first.plan is not None
    plan = first.plan.model_copy(update={"created_at": NOW})
    status = MegatronJobStatus(
        phase=JobPhase.RUNNING, plan=plan, epoch=1, committed_epoch=1, step=40, checkpoint_step=30
    )
    return spec, status, pods


def _assess(
    spec: MegatronJobSpec,
    status: MegatronJobStatus,
    pods: list[PodFacts],
    *,
    asked: SuspendRequest | None = ASKED,
    now: datetime = NOW,
    **signals: object,
) -> Assessment:
    got = AgentSignals(**{"completed_step": 40, "step_seconds": 0.5, **signals})  # type: ignore[arg-type]
    return assess(
        spec, JOB_UID, status, pods, NODES, got, {}, checkpoint_step=status.checkpoint_step, suspend=asked, now=now
    )


def _saving() -> tuple[MegatronJobSpec, MegatronJobStatus, list[PodFacts], MeshPlan]:
    """The job above once its suspend plan (epoch 2) is in force."""
    spec, status, pods = _training()
    a = _assess(spec, status, pods)
    assert a.plan is not None and a.plan.reason is PlanReason.SUSPEND
    plan = a.plan.model_copy(update={"created_at": NOW})
    status = status.model_copy(update={"plan": plan, "epoch": 2, "phase": JobPhase.SUSPENDING})
    return spec, status, pods, plan


def _suspended(step: int = 44) -> tuple[MegatronJobSpec, MegatronJobStatus, MeshPlan]:
    """The job above, stopped after its checkpoint of ``step``."""
    spec, status, pods, plan = _saving()
    a = _assess(spec, status, pods, suspend_outcome=(step, None))
    assert a.suspension is not None and a.suspension.condition is not None
    obs = Observation(
        phase=JobPhase.SUSPENDED,
        reason=Reason.JOB_SUSPENDED,
        message="",
        plan=plan,
        replicas=2,
        ready_workers=0,
        spares_ready=0,
        spares_wanted=1,
        recoveries=0,
        committed_epoch=1,
        step=40,
        checkpoint_step=step,
        suspended=a.suspension.condition,
    )
    return spec, compute_status(status, obs, NOW), plan


def test_a_training_job_gets_a_suspend_plan_for_the_same_members_at_a_boundary_ahead() -> None:
    spec, status, pods = _training()
    a = _assess(spec, status, pods)
    assert a.decision is not None and a.decision.outcome is Outcome.NEW_PLAN
    plan = a.plan
    assert plan is not None and plan.reason is PlanReason.SUSPEND and plan.epoch == 2
    assert [m.pod for m in plan.members] == ["job-0", "job-1"]  # the spare is not brought in
    assert plan.resume_step > 40 and plan.source_kinds() == {StateSourceKind.SELF}
    assert a.create_workers == a.create_spares == 0 and a.retire == () and a.failures == ()
    assert a.suspension is not None and a.suspension.stage is Stage.SAVE
    assert a.suspension.condition == (
        False,
        Reason.SUSPENDING,
        f"spec.suspend is true: the members write a checkpoint at step {plan.resume_step} (or the step they hold)",
    )
    assert phase_of(plan, False, False, True) == (JobPhase.SUSPENDING, Reason.SUSPENDING)


def test_a_suspension_grows_nothing_even_below_replicas() -> None:
    spec, status, pods = _training()
    spec = spec.model_copy(update={"replicas": 3})  # room to grow into the spare
    a = _assess(spec, status, pods)
    assert a.plan is not None and a.plan.reason is PlanReason.SUSPEND and len(a.plan.members) == 2


def test_the_pods_go_once_the_checkpoint_is_complete_and_the_condition_names_its_step() -> None:
    spec, status, pods, plan = _saving()
    waiting = _assess(spec, status, pods)
    assert waiting.suspension is not None and waiting.suspension.stage is Stage.SAVING
    assert waiting.retire == () and waiting.decision is not None and waiting.decision.outcome is Outcome.UNCHANGED

    done = _assess(spec, status, pods, suspend_outcome=(plan.resume_step, None))
    assert done.suspension is not None and done.suspension.stage is Stage.STOP
    assert done.suspension.step == plan.resume_step
    assert sorted(done.retire) == ["job-0", "job-1", "job-2"] and done.failures == ()
    assert done.create_workers == done.create_spares == 0
    value, reason, message = done.suspension.condition or (False, "", "")
    assert value and reason == Reason.JOB_SUSPENDED
    assert f"checkpoint of step {plan.resume_step} written and verified" in message
    assert done.suspension.phase is JobPhase.SUSPENDED


def test_a_failed_checkpoint_keeps_the_pods_and_is_tried_again_after_the_delay() -> None:
    spec, status, pods, plan = _saving()
    failed = _assess(spec, status, pods, suspend_outcome=(None, "step 44: OSError: disk full"))
    assert failed.suspension is not None and failed.suspension.stage is Stage.FAILED and failed.suspension.warning
    assert failed.retire == () and failed.decision is not None and failed.decision.outcome is Outcome.UNCHANGED
    value, reason, message = failed.suspension.condition or (True, "", "")
    assert not value and reason == Reason.SUSPEND_CHECKPOINT_FAILED and "disk full" in message

    later = NOW + timedelta(seconds=RETRY_SECONDS + 1)
    again = _assess(spec, status, pods, now=later, suspend_outcome=(None, "step 44: OSError: disk full"))
    assert again.suspension is not None and again.suspension.stage is Stage.SAVE
    assert again.plan is not None and again.plan.reason is PlanReason.SUSPEND and again.plan.epoch == plan.epoch + 1
    assert again.plan.source_kinds() == {StateSourceKind.SELF} and again.retire == ()


def test_a_checkpoint_past_the_timeout_is_said_and_the_pods_stay() -> None:
    spec, status, pods, _ = _saving()
    late = _assess(spec, status, pods, now=NOW + timedelta(seconds=301))
    assert late.suspension is not None and late.suspension.stage is Stage.TIMED_OUT and late.suspension.warning
    assert late.retire == () and late.suspension.condition is not None
    assert late.suspension.condition[1] == Reason.SUSPEND_CHECKPOINT_TIMED_OUT


def test_a_member_lost_while_the_checkpoint_is_written_is_recovered_first() -> None:
    spec, status, pods, _ = _saving()
    gone = [pods[1], pods[2]]  # job-0 was deleted
    a = _assess(spec, status, gone)
    assert a.suspension is not None and a.suspension.stage is Stage.WAIT
    assert a.plan is not None and a.plan.reason is PlanReason.REPLACE and "job-2" in [m.pod for m in a.plan.members]
    assert a.suspension.condition is not None and a.suspension.condition[1] == Reason.WAITING_TO_SUSPEND


def test_a_recovery_in_flight_is_let_finish_before_the_suspension() -> None:
    spec, status, pods = _training()
    assert status.plan is not None
    replace = status.plan.model_copy(update={"epoch": 2, "reason": PlanReason.REPLACE, "resume_step": 40})
    status = status.model_copy(update={"plan": replace, "epoch": 2, "committed_epoch": 1, "recoveries": 1})
    a = _assess(spec, status, pods)
    assert a.suspension is not None and a.suspension.stage is Stage.WAIT
    assert a.decision is not None and a.decision.outcome is Outcome.UNCHANGED and a.retire == ()
    assert a.suspension.condition is not None and a.suspension.condition[1] == Reason.WAITING_TO_SUSPEND


def test_a_job_with_nothing_trained_since_its_checkpoint_stops_at_once() -> None:
    spec, status, pods = _training()
    assert status.plan is not None
    fresh = status.plan.model_copy(update={"epoch": 2, "resume_step": 30, "reason": PlanReason.RESUME})
    status = status.model_copy(update={"plan": fresh, "epoch": 2, "committed_epoch": 1, "step": 30})
    a = _assess(spec, status, pods, completed_step=None)
    assert a.suspension is not None and a.suspension.stage is Stage.STOP and a.suspension.step == 30
    assert sorted(a.retire) == ["job-0", "job-1", "job-2"]


def test_a_job_not_started_creates_no_pod_while_suspended() -> None:
    spec = make_spec(replicas=2, spares=1, **CHECKPOINTED)
    pending = _pods("worker")  # created before the request
    a = _assess(spec, MegatronJobStatus(), pending, completed_step=None)
    assert a.suspension is not None and a.suspension.stage is Stage.STOPPED and a.suspension.step is None
    assert a.create_workers == a.create_spares == 0 and a.retire == ("job-0",) and a.decision is None
    assert a.suspension.phase is JobPhase.SUSPENDED


def test_a_suspended_job_keeps_no_pod() -> None:
    spec, status, _ = _suspended()
    assert stopped(status) and status.phase is JobPhase.SUSPENDED
    cond = next(c for c in status.conditions if c.type == ConditionType.SUSPENDED)
    assert cond.status == "True" and "step 44" in cond.message
    leftover = _pods(ROLE_SPARE)
    a = _assess(spec, status, leftover, completed_step=None)
    assert a.suspension is not None and a.suspension.stage is Stage.STOPPED and a.suspension.condition is None
    assert a.retire == ("job-0",) and a.create_workers == a.create_spares == 0 and a.failures == ()


def test_resuming_creates_the_pods_then_a_resume_plan_loads_the_checkpoint() -> None:
    spec, status, plan = _suspended()
    a = _assess(spec, status, [], asked=None, completed_step=None)
    assert a.suspension is not None and a.suspension.stage is Stage.RESUME
    assert (a.create_workers, a.create_spares) == (2, 1) and a.failures == () and a.decision is None
    assert a.suspension.condition is not None and a.suspension.condition[:2] == (False, Reason.RESUMING)

    fresh = _pods("worker", "worker", ROLE_SPARE, start=3)
    b = _assess(spec, status, fresh, asked=None, completed_step=None)
    new = b.plan
    assert new is not None and new.reason is PlanReason.RESUME and new.epoch == plan.epoch + 1
    assert [m.pod for m in new.members] == ["job-3", "job-4"] and b.failures == ()
    assert new.default_source is StateSourceKind.CHECKPOINT and new.default_checkpoint_step == 44
    assert new.resume_step == 44 and new.sizes.dp == 2
    assert b.suspension is not None and b.suspension.condition is not None
    assert b.suspension.condition[:2] == (False, Reason.RESUMED)
    assert phase_of(new, False, False, True) == (JobPhase.STARTING, Reason.RESUMING)


def test_a_resuming_job_is_still_stopped_until_its_plan_is_made() -> None:
    _, status, plan = _suspended()
    obs = Observation(
        phase=JobPhase.PENDING,
        reason=Reason.RESUMING,
        message="",
        plan=plan,
        replicas=2,
        ready_workers=0,
        spares_ready=0,
        spares_wanted=1,
        recoveries=0,
        suspended=(False, Reason.RESUMING, "resuming"),
    )
    resuming = compute_status(status, obs, NOW)
    assert stopped(resuming)
    made = compute_status(resuming, Observation(**{**obs.__dict__, "suspended": (False, Reason.RESUMED, "x")}), NOW)
    assert not stopped(made)


def test_a_suspension_withdrawn_before_the_pods_stop_trains_on_with_the_same_members() -> None:
    spec, status, pods, plan = _saving()
    a = _assess(spec, status, pods, asked=None)
    new = a.plan
    assert new is not None and new.reason is PlanReason.RESUME and new.epoch == plan.epoch + 1
    assert [m.pod for m in new.members] == ["job-0", "job-1"] and new.source_kinds() == {StateSourceKind.SELF}
    assert new.resume_step == plan.resume_step and a.retire == ()
    assert a.suspension is not None and a.suspension.condition is not None
    assert a.suspension.condition[:2] == (False, Reason.RESUMED)
