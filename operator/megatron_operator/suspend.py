"""Suspending a job with its work kept, and resuming it: the decisions, made purely.

Whoever wants a job's pods gone for a while (``spec.suspend``; a queue that preempts it) asks with a
:class:`SuspendRequest`; :func:`decide` (while the job has pods) and :func:`while_stopped` (once it
has none) say what happens, and :func:`reconcile.assess` carries it into its assessment. The policy
(docs/operations.md#suspend-and-resume):

- The plan in force trains: a plan of reason ``suspend`` names the same members and a step boundary
  ahead of the reported step (as a drain's move does, so that no step in flight is cut). Every member
  trains to it, enters the new epoch with the state it holds, and writes a distributed checkpoint of
  its step, published and then verified. Once a member reports it complete, every pod (workers and
  spares) is deleted and the Suspended condition is True, naming the step.
- Nothing was trained since the newest checkpoint (or at all): the pods are deleted at once.
- The plan in force is not training yet (a recovery, a resize, a growth or the start is under way,
  or the job waits for capacity): the job recovers first (pods are still created for it), then
  suspends as above. A member lost while the checkpoint is written is recovered the same way.
- The checkpoint fails, or is not complete within ``checkpoint.suspendTimeoutSeconds``: nothing is
  deleted (the pods hold the trained state), training stays paused, the condition and a Warning event
  say why; a failed save is tried again after :data:`RETRY_SECONDS`.
- The request withdrawn (``spec.suspend: false``): new pods are created, and once the spec's mesh is
  up (or the operator's full-mesh wait has passed) a plan of reason ``resume`` loads the checkpoint in
  every rank: the step count goes on from it, and the samples after it are consumed once.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from datetime import datetime

from megatron_contract.job import ConditionType, JobPhase, MegatronJobSpec, MegatronJobStatus
from megatron_contract.mesh import MeshPlan, PlanReason
from megatron_operator.planner import Outcome, PlanDecision, boundary_lead
from megatron_operator.status import Reason, condition

#: A suspension whose checkpoint failed makes its next attempt this long after the last one began.
RETRY_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class SuspendRequest:
    """Someone wants the job's pods stopped, its work kept in a checkpoint.

    Attributes:
        reason: the Suspended condition's reason once the pods are stopped (CamelCase), and its event's.
        message: who asks and why; the condition's messages start with it.
    """

    reason: str
    message: str


def requested(spec: MegatronJobSpec) -> SuspendRequest | None:
    """The request that ``spec.suspend`` makes, if it is set."""
    return SuspendRequest(Reason.JOB_SUSPENDED, "spec.suspend is true") if spec.suspend else None


class Stage(enum.StrEnum):
    """Where a suspension (or a resumption) stands."""

    WAIT = "wait"  # the plan in force does not train yet: the job recovers, then suspends
    SAVE = "save"  # a suspend plan is made now
    SAVING = "saving"  # the suspend plan's checkpoint is being written
    FAILED = "failed"  # it failed: the pods stay; tried again after RETRY_SECONDS
    TIMED_OUT = "timed-out"  # not complete within checkpoint.suspendTimeoutSeconds: the pods stay
    REFUSED = "refused"  # no spec.checkpoint to keep the state in: not carried out, the job trains on
    STOP = "stop"  # every pod is deleted now: the job is suspended
    STOPPED = "stopped"  # suspended: no pods
    RESUME = "resume"  # the request was withdrawn: new pods, then a resume plan


@dataclasses.dataclass(frozen=True)
class Suspension:
    """A suspension's decision for one pass.

    Attributes:
        stage: where it stands.
        condition: the Suspended condition to write (status, reason, message); None: as stored.
        step: for STOP and STOPPED, the checkpoint the job resumes from (None: nothing trained).
    """

    stage: Stage
    condition: tuple[bool, str, str] | None
    step: int | None = None

    @property
    def phase(self) -> JobPhase | None:
        """The job's phase while this stage lasts; None: the phase of the plan in force."""
        if self.stage in (Stage.STOP, Stage.STOPPED):
            return JobPhase.SUSPENDED
        if self.stage in (Stage.SAVE, Stage.SAVING, Stage.FAILED, Stage.TIMED_OUT):
            return JobPhase.SUSPENDING
        return None

    @property
    def warning(self) -> bool:
        """Whether the condition reports a suspension that could not write its checkpoint."""
        return self.stage in (Stage.FAILED, Stage.TIMED_OUT, Stage.REFUSED)


def stopped(status: MegatronJobStatus) -> bool:
    """Whether a suspension stopped the job's pods and no resume plan has been made since: the
    Suspended condition is True, or False because the job is resuming."""
    cond = condition(status, ConditionType.SUSPENDED)
    return cond is not None and (cond.status == "True" or cond.reason == Reason.RESUMING)


def _resumes_from(step: int | None) -> str:
    return f"the checkpoint of step {step}" if step is not None else "the start (no step was trained)"


def _stop(request: SuspendRequest, step: int | None, how: str) -> Suspension:
    return Suspension(
        Stage.STOP,
        (True, request.reason, f"{request.message}: {how}; every pod deleted; resumes from {_resumes_from(step)}"),
        step,
    )


def decide(
    request: SuspendRequest,
    spec: MegatronJobSpec,
    status: MegatronJobStatus,
    decision: PlanDecision,
    *,
    outcome: tuple[int | None, str | None],
    checkpoint_step: int | None,
    reported_step: int | None,
    step_seconds: float | None,
    settling: bool,
    now: datetime,
    replan: Callable[[int | None], PlanDecision],
) -> tuple[Suspension, PlanDecision]:
    """What a suspension does now to a job that has a plan and pods; returns the suspension and the
    decision that replaces the planner's (``decision``, for the plan in force ``status.plan``).

    Args:
        request: the suspension asked for.
        spec: the job's spec.
        status: its status.
        decision: the planner's decision for the pods as they are (no spare brought in: a suspension
            grows nothing); a plan it makes replaces lost members.
        outcome: what the members of a suspend plan in force said of its checkpoint: (step once complete,
            why it failed).
        checkpoint_step: the newest complete checkpoint.
        reported_step: the steps every member reported completed.
        step_seconds: the fastest recent step.
        settling: the operator has not heard from every running pod yet: no plan is made.
        now: the time (a suspend plan's age is told from its creation time).
        replan: a plan for the same members (a new epoch) resuming at the given step.
    """
    plan = status.plan
    assert plan is not None
    if plan.reason is PlanReason.SUSPEND:
        return _saving(request, spec, plan, decision, outcome, reported_step, settling, now, replan)
    trained = max(status.step or 0, plan.resume_step)
    if status.committed_epoch < plan.epoch and trained <= (checkpoint_step or 0):
        how = "no step was trained since that checkpoint" if checkpoint_step else "no step was trained"
        return _stop(request, checkpoint_step, how), PlanDecision(Outcome.UNCHANGED, plan)
    if spec.checkpoint is None:  # spec.suspend cannot be set without it; another asker can ask
        message = (
            f"{request.message}: the job has no spec.checkpoint, so its trained state cannot be kept; "
            "the pods stay (training goes on)"
        )
        return Suspension(Stage.REFUSED, (False, Reason.SUSPEND_CHECKPOINT_FAILED, message)), decision
    if decision.outcome is Outcome.UNCHANGED and status.committed_epoch >= plan.epoch and not settling:
        boundary = (reported_step or plan.resume_step) + boundary_lead(spec, step_seconds)
        made = _as_suspend(replan(boundary), boundary)
        if made is not None:
            message = f"{request.message}: the members write a checkpoint at step {boundary} (or the step they hold)"
            return Suspension(Stage.SAVE, (False, Reason.SUSPENDING, message)), made
    why = decision.message or f"epoch {plan.epoch} ({plan.reason.value}) is not training yet"
    message = f"{request.message}: suspends once the plan in force trains ({why})"
    return Suspension(Stage.WAIT, (False, Reason.WAITING_TO_SUSPEND, message[:2000])), decision


def _saving(
    request: SuspendRequest,
    spec: MegatronJobSpec,
    plan: MeshPlan,
    decision: PlanDecision,
    outcome: tuple[int | None, str | None],
    reported_step: int | None,
    settling: bool,
    now: datetime,
    replan: Callable[[int | None], PlanDecision],
) -> tuple[Suspension, PlanDecision]:
    """A suspend plan is in force: stop once its checkpoint is complete; recover a lost member;
    say so when the checkpoint failed or takes too long, and try a failed one again later."""
    step, error = outcome
    if step is not None:
        return _stop(request, step, f"checkpoint of step {step} written and verified"), PlanDecision(
            Outcome.UNCHANGED, plan
        )
    if decision.lost or decision.outcome is Outcome.WAIT:
        message = f"{request.message}: a member was lost while the checkpoint was written; recovering first"
        return Suspension(Stage.WAIT, (False, Reason.WAITING_TO_SUSPEND, message)), decision
    if decision.outcome is Outcome.NEW_PLAN:  # every member abandoned the epoch's join: join again
        made = _as_suspend(decision, plan.resume_step)
        if made is not None:
            return Suspension(Stage.SAVE, (False, Reason.SUSPENDING, f"{request.message}: {made.message}")), made
    age = (now - plan.created_at).total_seconds() if plan.created_at is not None else 0.0
    if error is not None:
        if age >= RETRY_SECONDS and not settling:
            made = _as_suspend(replan(reported_step), plan.resume_step)
            if made is not None:
                message = f"{request.message}: the last checkpoint failed ({error[:500]}); trying again"
                return Suspension(Stage.SAVE, (False, Reason.SUSPENDING, message)), made
        message = (
            f"{request.message}: the checkpoint failed: {error[:1500]}. The pods stay, holding the trained state "
            f"(training paused); tried again {RETRY_SECONDS:.0f} s after the last attempt began"
        )
        return Suspension(Stage.FAILED, (False, Reason.SUSPEND_CHECKPOINT_FAILED, message)), decision
    timeout = spec.checkpoint.suspend_timeout_seconds if spec.checkpoint is not None else 0.0
    if age > timeout:
        message = (
            f"{request.message}: the checkpoint of epoch {plan.epoch} is not complete after {age:.0f} s "
            f"(checkpoint.suspendTimeoutSeconds {timeout:g}); the pods stay, holding the trained state"
        )
        return Suspension(Stage.TIMED_OUT, (False, Reason.SUSPEND_CHECKPOINT_TIMED_OUT, message)), decision
    message = f"{request.message}: writing a checkpoint of step {plan.resume_step} (or the step the members hold)"
    return Suspension(Stage.SAVING, (False, Reason.SUSPENDING, message)), decision


def _as_suspend(decision: PlanDecision, boundary: int) -> PlanDecision | None:
    """The planner's new plan for the same members turned into a suspend plan (None when it lost a
    member or made none)."""
    if decision.outcome is not Outcome.NEW_PLAN or decision.plan is None or decision.lost:
        return None
    plan = decision.plan.model_copy(update={"reason": PlanReason.SUSPEND})
    message = f"suspend: the members of mesh {plan.mesh_label} write a checkpoint at step {boundary} and stop"
    return dataclasses.replace(decision, plan=plan, message=message)


def while_stopped(request: SuspendRequest | None, status: MegatronJobStatus, checkpoint_step: int | None) -> Suspension:
    """A job whose pods a suspension stopped: it stays so while asked (its pods, should any be left,
    are deleted), and resumes when the request is withdrawn."""
    if request is None:
        message = f"resuming from {_resumes_from(checkpoint_step)}: new pods are created"
        return Suspension(Stage.RESUME, (False, Reason.RESUMING, message), checkpoint_step)
    cond = condition(status, ConditionType.SUSPENDED)
    if cond is not None and cond.status == "True":
        return Suspension(Stage.STOPPED, None, checkpoint_step)
    message = f"{request.message}: no pods; resumes from {_resumes_from(checkpoint_step)}"
    return Suspension(Stage.STOPPED, (True, request.reason, message), checkpoint_step)


def resumed(message: str) -> Suspension:
    """The resume plan (or, for a job suspended before it started, its first plan) is made."""
    return Suspension(Stage.RESUME, (False, Reason.RESUMED, message))
