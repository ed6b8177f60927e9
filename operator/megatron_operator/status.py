"""Status computation: the whole status from an observation, conditions in the metav1 shape.

Status is computed whole, compared with the old one and written once when it differs; fields
another version of the operator wrote are carried over unchanged. Ready,
Recovering, Failed and Succeeded are mutually exclusive: setting one True sets the others False
in the same write (as jobset's ``exclusiveConditions``). Degraded, SparesExhausted and
HostMemoryShort stand alone.
A condition keeps its ``lastTransitionTime`` until its status flips.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from typing import Any

from megatron_contract.job import (
    Condition,
    ConditionType,
    FailureRecord,
    JobPhase,
    MegatronJobStatus,
)
from megatron_contract.mesh import MeshPlan
from megatron_operator.per_plan import PerPlan


class Reason:
    """Reasons of conditions and events (CamelCase, as Kubernetes wants them)."""

    WAITING_FOR_PODS = "WaitingForPods"
    RECOVERING = "ReplacingFailedPods"
    GROWING = "GrowingMesh"
    RESIZING = "ResizingMesh"
    MIGRATING = "MigratingOffDrainedNodes"
    BELOW_MIN_REPLICAS = "BelowMinReplicas"
    MESH_SHRUNK = "MeshShrunk"
    FULL_MESH = "FullMesh"
    NO_SPARE_READY = "NoSpareReady"
    SPARES_READY = "SparesReady"
    NO_SPARES_REQUESTED = "NoSparesRequested"
    MAX_RECOVERIES = "MaxRecoveriesExceeded"
    RECOVERY_NOT_CONVERGING = "RecoveryNotConverging"
    STATE_LOST = "StateLost"
    TRAINING = "Training"  # Ready: every member committed a step of the plan in force
    WAITING_FOR_FIRST_STEP = "WaitingForFirstStep"
    CHECKPOINT_UNUSABLE = "CheckpointUnusable"
    INVALID_SPEC = "InvalidSpec"
    TRAINING_FINISHED = "TrainingFinished"
    NOT_FINISHED = "NotFinished"
    # The CreateFailed condition (and its Warning events): a child the operator cannot create.
    FAILED_CREATE_SECRET = "FailedCreateSecret"
    FAILED_CREATE_SERVICE = "FailedCreateService"
    FAILED_CREATE_DISRUPTION_BUDGET = "FailedCreatePodDisruptionBudget"
    FAILED_CREATE_POD = "FailedCreatePod"
    PODS_FAIL_AT_START = "PodsFailingAtStart"
    CHILDREN_CREATED = "ChildrenCreated"
    # The ReconcilePaused condition (and its events): the operator cannot trust the job's status
    # (skew.py); and a spec field this version does not know.
    STATUS_UNREADABLE = "StatusUnreadable"
    STATUS_BEHIND_AGENTS = "StatusBehindAgents"
    RECONCILE_RESUMED = "ReconcileResumed"
    SPEC_FIELDS_IGNORED = "SpecFieldsIgnored"
    # The QueueAdmitted condition of a job queued through Kueue (queueing.py), and its events.
    WAITING_FOR_QUEUE_ADMISSION = "WaitingForQueueAdmission"
    QUEUE_ADMITTED = "AdmittedByQueue"
    QUEUE_EVICTED = "EvictedByQueue"
    QUEUE_QUOTA_RELEASED = "QueueQuotaReleased"
    # The Suspended condition (and its events): spec.suspend (operator/megatron_operator/suspend.py).
    JOB_SUSPENDED = "JobSuspended"
    SUSPENDING = "Suspending"
    WAITING_TO_SUSPEND = "WaitingToSuspend"
    SUSPEND_CHECKPOINT_FAILED = "SuspendCheckpointFailed"
    SUSPEND_CHECKPOINT_TIMED_OUT = "SuspendCheckpointTimedOut"
    RESUMING = "Resuming"
    RESUMED = "Resumed"
    # The HostMemoryShort condition (host_memory.py), and its Warning event.
    HOST_MEMORY_SHORT = "HostMemoryShort"
    HOST_MEMORY_SUFFICIENT = "HostMemorySufficient"
    MEMORY_NOT_REQUESTED = "MemoryNotRequested"
    NO_BUDDY_COPIES = "NoBuddyCopies"
    # Events.
    PLAN_CREATED = "PlanCreated"
    PLAN_PUSHED = "PlanPushed"
    PLAN_PUSH_FAILED = "PlanPushFailed"
    POD_CREATED = "PodsCreated"
    PODS_RETIRED = "SurplusPodsDeleted"
    SPARE_PROMOTED = "SparePromoted"
    RECOVERED = "Recovered"
    ACCUSATION_IGNORED = "PeerReportIgnored"
    NODES_PARTITIONED = "NodesNotReadyTogether"
    PODS_MOVED_OFF_NODES = "PodsMovedOffDrainedNodes"
    DRAIN_WAITING = "NodeDrainWaiting"


EXCLUSIVE = (ConditionType.READY, ConditionType.RECOVERING, ConditionType.FAILED, ConditionType.SUCCEEDED)

_STATE_OF_PHASE = {
    JobPhase.PENDING: None,
    JobPhase.STARTING: None,
    JobPhase.RUNNING: ConditionType.READY,
    JobPhase.RECOVERING: ConditionType.RECOVERING,
    JobPhase.DEGRADED: ConditionType.RECOVERING,  # waiting for capacity is a recovery that cannot finish yet
    JobPhase.SUSPENDING: None,
    JobPhase.SUSPENDED: None,
    JobPhase.FAILED: ConditionType.FAILED,
    JobPhase.SUCCEEDED: ConditionType.SUCCEEDED,
}


@dataclasses.dataclass(frozen=True)
class Observation:
    """Everything the status is computed from."""

    phase: JobPhase
    reason: str
    message: str
    plan: MeshPlan | None
    replicas: int
    ready_workers: int
    spares_ready: int
    spares_wanted: int
    recoveries: int
    committed_epoch: int = 0
    recovery_epoch: int = 0
    last_recovery_duration: float | None = None
    last_failure: FailureRecord | None = None
    step: int | None = None
    checkpoint_step: int | None = None
    buddy_copy_step: int | None = None  # optimizer_sources.restore_point of the members' reports
    generation: int | None = None
    suspended: tuple[bool, str, str] | None = None  # the Suspended condition to set; None: as it was
    host_memory: tuple[bool, str, str] | None = None  # the HostMemoryShort condition to set; None: as it was


def set_condition(
    conditions: list[Condition],
    type_: ConditionType,
    status: bool,
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
) -> list[Condition]:
    """A copy of ``conditions`` with one condition set; its transition time moves only on a flip."""
    value = "True" if status else "False"
    old = next((c for c in conditions if c.type == type_.value), None)
    updated = Condition(
        type=type_.value,
        status=value,
        reason=reason,
        message=message,
        last_transition_time=old.last_transition_time if old is not None and old.status == value else now,
        observed_generation=generation,
    )
    if old is None:
        return [*conditions, updated]
    return [updated if c is old else c for c in conditions]


def condition(status: MegatronJobStatus, type_: ConditionType) -> Condition | None:
    """The condition of a type, if set."""
    return next((c for c in status.conditions if c.type == type_.value), None)


def compute_status(old: MegatronJobStatus, obs: Observation, now: datetime) -> MegatronJobStatus:
    """The whole new status from the old one and an observation."""
    conditions = list(old.conditions)
    state = _STATE_OF_PHASE[obs.phase]
    for type_ in EXCLUSIVE:
        if type_ is state:
            conditions = set_condition(conditions, type_, True, obs.reason, obs.message, now, obs.generation)
        elif type_ is ConditionType.READY:
            conditions = set_condition(conditions, type_, False, obs.reason, obs.message, now, obs.generation)
        elif condition(old, type_) is not None or type_ is ConditionType.RECOVERING:
            # Keep the last reason of a condition that turns False; it says what happened last.
            prev = condition(old, type_)
            reason = prev.reason if prev is not None and prev.status == "False" else obs.reason
            message = prev.message if prev is not None and prev.status == "False" else ""
            if type_ is ConditionType.RECOVERING and prev is None:
                reason, message = Reason.NOT_FINISHED, ""
            conditions = set_condition(conditions, type_, False, reason, message, now, obs.generation)

    dp = obs.plan.sizes.dp if obs.plan is not None else 0
    if obs.phase is JobPhase.DEGRADED:
        conditions = set_condition(
            conditions, ConditionType.DEGRADED, True, Reason.BELOW_MIN_REPLICAS, obs.message, now, obs.generation
        )
    elif obs.plan is not None and dp < obs.replicas:
        conditions = set_condition(
            conditions,
            ConditionType.DEGRADED,
            True,
            Reason.MESH_SHRUNK,
            f"training with {dp} of {obs.replicas} data-parallel replicas",
            now,
            obs.generation,
        )
    else:
        conditions = set_condition(conditions, ConditionType.DEGRADED, False, Reason.FULL_MESH, "", now, obs.generation)

    if obs.spares_wanted == 0:
        conditions = set_condition(
            conditions, ConditionType.SPARES_EXHAUSTED, False, Reason.NO_SPARES_REQUESTED, "", now, obs.generation
        )
    elif obs.spares_ready == 0:
        conditions = set_condition(
            conditions,
            ConditionType.SPARES_EXHAUSTED,
            True,
            Reason.NO_SPARE_READY,
            f"0 of {obs.spares_wanted} hot spares ready",
            now,
            obs.generation,
        )
    else:
        conditions = set_condition(
            conditions,
            ConditionType.SPARES_EXHAUSTED,
            False,
            Reason.SPARES_READY,
            f"{obs.spares_ready} of {obs.spares_wanted} hot spares ready",
            now,
            obs.generation,
        )

    if obs.suspended is not None:
        conditions = set_condition(conditions, ConditionType.SUSPENDED, *obs.suspended, now, obs.generation)
    if obs.host_memory is not None:
        conditions = set_condition(conditions, ConditionType.HOST_MEMORY_SHORT, *obs.host_memory, now, obs.generation)

    desired = len(obs.plan.members) if obs.plan is not None else 0
    terminal = obs.phase in (JobPhase.SUCCEEDED, JobPhase.FAILED)
    return MegatronJobStatus(
        # Fields written by another version of the operator are written back as read (an upgrade
        # or a rollback must not erase what the other version keeps there).
        **(old.model_extra or {}),
        phase=obs.phase,
        conditions=sorted(conditions, key=lambda c: c.type),
        observed_generation=obs.generation,
        mesh=obs.plan.mesh_label if obs.plan is not None else None,
        epoch=obs.plan.epoch if obs.plan is not None else 0,
        plan=obs.plan,
        desired_workers=desired,
        ready_workers=obs.ready_workers,
        ready=f"{obs.ready_workers}/{desired}",
        spares_ready=obs.spares_ready,
        recoveries=obs.recoveries,
        committed_epoch=obs.committed_epoch,
        recovery_epoch=obs.recovery_epoch,
        last_recovery_duration_seconds=obs.last_recovery_duration,
        last_failure=obs.last_failure,
        step=obs.step if obs.step is not None else old.step,
        checkpoint_step=max((s for s in (obs.checkpoint_step, old.checkpoint_step) if s is not None), default=None),
        buddy_copy_step=obs.buddy_copy_step,
        start_time=old.start_time or (now if obs.plan is not None else None),
        completion_time=old.completion_time or (now if terminal else None),
    )


def status_body(status: MegatronJobStatus) -> dict[str, Any]:
    """The status as written (whole, replacing the old one): camelCase, unset optionals left out.

    The plan, most of the body at scale (0.4-0.6 MB of JSON at 4096 pods), is dumped once per plan
    object: a status write makes the old and the new body, and a plan lives for many writes. Plans
    are never changed in place (a new plan is a new object); the dump is shared, read only."""
    plan = status.plan
    if plan is None:
        return status.to_wire()
    body = status.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"plan"})
    body["plan"] = _plan_wire(plan, None)
    return body


# The dump of the plan in force: a write made the old and new bodies, each dumping it.
_plan_wire: PerPlan[None, dict[str, Any]] = PerPlan(lambda plan, _: plan.to_wire())


def status_changed(old: MegatronJobStatus, new: MegatronJobStatus) -> bool:
    """Whether ``new`` differs from ``old`` in anything that would be written."""
    return status_body(old) != status_body(new)


# Progress (the committed step, the buddy copies' step, goodput) changes with every heartbeat, and
# every status write stores the whole object, the plan included (~650 kB at 4096 pods x 8 GPUs):
# written on its own, progress is held to this many bytes per second per job. With any other change
# it rides along. A small job's status (a few kB) is still written on every reconcile; the live step
# is in Prometheus.
PROGRESS_WRITE_BYTES_PER_SECOND = 64 * 1024


_PROGRESS_KEYS = ("step", "buddyCopyStep", "goodput")


def progress_only(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether status body ``new`` differs from ``old`` in the committed step, the buddy copies' step
    and goodput alone."""
    return all(old.get(k) == v for k, v in new.items() if k not in _PROGRESS_KEYS) and not (
        set(old) - set(new) - set(_PROGRESS_KEYS)
    )


def progress_write_gap(body: dict[str, Any]) -> float:
    """Seconds to wait after writing ``body`` before writing progress alone."""
    return len(json.dumps(body, separators=(",", ":"))) / PROGRESS_WRITE_BYTES_PER_SECOND
