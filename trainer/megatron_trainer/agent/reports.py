"""What the agent tells the operator and a human debugging the pod.

The heartbeat's :class:`AgentReport`, the ``GET /v1/state`` document built on it, the failures
held until an acknowledged report carried them, and the gauges that summarise the same view. Plain
functions of the agent, so the report has one definition whichever path asks for it.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from megatron_contract.agent import AgentReport, PeerFailure, WorkerState
from megatron_trainer.channel import Progress, ReplicaSteps

if TYPE_CHECKING:
    from megatron_trainer.agent.agent import Agent

MAX_PENDING_FAILURES = 64  # AgentReport.failed_peers holds at most this many
MAX_REPLICA_STEPS = 4  # AgentReport.replica_steps holds at most this many


class PendingFailures:
    """Failures of this pod's own workers or reported peers, until an acknowledged report carried them."""

    def __init__(self) -> None:
        self.items: list[PeerFailure] = []

    def add(self, failure: PeerFailure) -> bool:
        """Hold a failure, stamped now; False when one of the same epoch, rank and pod is held."""
        failure = failure.model_copy(update={"detected_at": datetime.now(UTC)})
        key = (failure.epoch, failure.rank, failure.pod)
        if any((f.epoch, f.rank, f.pod) == key for f in self.items):
            return False
        self.items = [*self.items, failure][-MAX_PENDING_FAILURES:]
        return True

    def acknowledge(self, report: AgentReport) -> None:
        """Drop the failures ``report`` carried (by identity: a report holds the same objects)."""
        delivered = {id(f) for f in report.failed_peers}
        self.items = [f for f in self.items if id(f) not in delivered]


def member_progress(agent: Agent) -> list[Progress]:
    """The last step of each local worker in the held epoch."""
    return [
        h.progress
        for h in agent.supervisor.workers.values()
        if h.progress is not None and h.progress.epoch == agent.epoch
    ]


def pod_replica_steps(agent: Agent) -> list[int]:
    """The steps of which this pod holds complete buddy copies in the held epoch
    (``AgentReport.replica_steps``): those every local worker of the plan says it holds."""
    plan = agent.plan
    member = plan.member(agent.settings.pod_name) if plan is not None else None
    if member is None:
        return []
    held = [
        h.replica_steps if h.alive else None
        for h in agent.supervisor.workers.values()
        if h.local_rank < len(member.ranks)
    ]
    return common_replica_steps(agent.epoch, held, len(member.ranks))


def common_replica_steps(epoch: int, held: list[ReplicaSteps | None], workers: int) -> list[int]:
    """The steps that each of ``workers`` workers holds copies of in ``epoch``, newest first: none
    unless every one of them said which it holds in that epoch (the operator takes a step the pod
    reports as held for every rank of the pod)."""
    if len(held) < workers:
        return []
    common: set[int] | None = None
    for message in held:
        if message is None or message.epoch != epoch:
            return []
        common = set(message.steps) if common is None else common & set(message.steps)
    return sorted(common or (), reverse=True)[:MAX_REPLICA_STEPS]


def build_report(agent: Agent) -> AgentReport:
    """The heartbeat as of now; the pod speaks for its slowest worker."""
    progress = member_progress(agent)
    slowest = min(progress, key=lambda p: p.step) if progress else None
    suspend = agent.checkpoints.suspend_outcome_of(agent.epoch)
    return AgentReport(
        job_uid=agent.settings.job_uid,
        pod=agent.settings.pod_name,
        epoch=agent.epoch,
        state=agent.state,
        healthy=agent.healthy,
        step=slowest.step if slowest else None,
        consumed_samples=slowest.consumed_samples if slowest else None,
        loss=slowest.loss if slowest else None,
        step_time_seconds=slowest.step_time_seconds if slowest else None,
        tokens_per_second=slowest.tokens_per_second if slowest else None,
        workers=[
            WorkerState(
                local_rank=h.local_rank,
                pid=h.pid,
                rank=agent.rank_of(h),
                alive=h.alive,
                step=h.progress.step if h.progress is not None else None,
            )
            for h in sorted(agent.supervisor.workers.values(), key=lambda h: h.local_rank)
        ],
        # The same objects as the pending failures: acknowledgement clears exactly these.
        failed_peers=list(agent.failures.items),
        checkpoint_step=agent.checkpoints.step,
        replica_steps=pod_replica_steps(agent),
        checkpoint_blocking_seconds=agent.checkpoints.blocking_seconds(),
        checkpoint_rejected=agent.checkpoints.rejected,
        checkpoint_unusable=agent.checkpoints.unusable,
        suspend_step=suspend[1] if suspend is not None else None,
        suspend_error=suspend[2] if suspend is not None else None,
        sent_at=datetime.now(UTC),
    )


def state_document(agent: Agent) -> dict[str, Any]:
    """What ``GET /v1/state`` returns: the report plus what a human debugging the pod wants."""
    doc = build_report(agent).to_wire()
    plan = agent.plan
    doc["ranks"] = (m.ranks if (m := plan.member(agent.settings.pod_name)) else []) if plan else []
    doc["member"] = bool(doc["ranks"])
    doc["operatorEpoch"] = agent.operator_epoch
    doc["rendezvous"] = {
        "host": agent.rendezvous.address,
        "port": agent.rendezvous.port,
        "running": agent.rendezvous.running,
    }
    doc["workers"] = [
        {
            **w,
            "phase": h.phase.value,
            "generation": h.generation,
            "exitCode": h.exit_code,
            "killReason": h.kill_reason,
            "secondsSinceLastMessage": round(time.monotonic() - h.last_seen, 3),
        }
        for w, h in zip(
            doc.get("workers", []),
            sorted(agent.supervisor.workers.values(), key=lambda h: h.local_rank),
            strict=True,
        )
    ]
    last_recovery = agent.events.last_recovery
    if last_recovery is not None:
        doc["lastRecovery"] = {
            "epoch": last_recovery.epoch,
            "phases": last_recovery.phases,
            "instants": last_recovery.instants,
        }
    doc["uptimeSeconds"] = round(time.monotonic() - agent.started_at, 3)
    return doc


def refresh_metrics(agent: Agent) -> None:
    """Set the gauges that follow the pod's state, epoch, live workers and slowest step."""
    metrics = agent.metrics
    metrics.set_state(agent.state)
    metrics.epoch.set(agent.epoch)
    metrics.workers_alive.set(sum(1 for h in agent.supervisor.workers.values() if h.alive))
    progress = member_progress(agent)
    if progress:
        metrics.step.set(min(p.step for p in progress))
