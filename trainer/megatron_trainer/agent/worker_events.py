"""What the workers tell the agent, and what it does about it.

The supervisor's callbacks: a worker's messages (Hello, status, progress, checkpoints, phase
times, failed collectives, buddy copies held), its hang and its exit, and the restart that follows
within the pod's budget. Each moves the worker's phase, updates what the pod reports, and wakes the
heartbeat when the operator must hear at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

from megatron_contract.agent import AgentState, PeerFailure
from megatron_contract.mesh import PlanReason
from megatron_trainer.agent.lifecycle import LifecycleError, WorkerPhase
from megatron_trainer.agent.metrics import split_phase_times
from megatron_trainer.agent.supervisor import WorkerHandle
from megatron_trainer.channel import (
    Alive,
    CheckpointProblem,
    CheckpointSaved,
    CollectiveFailed,
    CopyInterval,
    Hello,
    PhaseTimes,
    Progress,
    ReplicaSteps,
    ToAgent,
    WorkerStatus,
)

if TYPE_CHECKING:
    from megatron_trainer.agent.agent import Agent

log = logging.getLogger(__name__)

_STATUS_PHASE = {
    "spare": WorkerPhase.SPARE,
    "training": WorkerPhase.TRAINING,
    "reconfiguring": WorkerPhase.RECONFIGURING,
    "succeeded": WorkerPhase.SUCCEEDED,
    "failed": WorkerPhase.FAILED,
}


@dataclasses.dataclass
class LastRecovery:
    """Phases of the newest reconfiguration a local worker reported."""

    epoch: int
    phases: dict[str, float]  # durations in seconds
    instants: dict[str, float] = dataclasses.field(default_factory=dict)  # e.g. detected_at_unix


def move(handle: WorkerHandle, phase: WorkerPhase) -> None:
    """Move a worker's phase; a transition the table forbids is logged, not raised (a late message)."""
    try:
        handle.move_to(phase)
    except LifecycleError as err:
        log.warning("worker %d: %s (ignored)", handle.local_rank, err)


class WorkerEvents:
    """The agent's answers to its workers; holds the restarts spent and the recoveries counted."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self.restarts = 0
        self.last_recovery: LastRecovery | None = None
        self._recorded_phase_epochs: set[int] = set()

    def _send_soon(self) -> None:
        if self._agent.heartbeat is not None:
            self._agent.heartbeat.send_soon()

    def _suspending(self, epoch: int) -> bool:
        """Whether ``epoch`` is the held plan's and that plan suspends the job."""
        plan = self._agent.plan
        return plan is not None and plan.epoch == epoch and plan.reason is PlanReason.SUSPEND

    # -- messages --------------------------------------------------------------------------------

    def on_message(self, handle: WorkerHandle, message: ToAgent) -> None:
        """Act on one message of a worker, then refresh the gauges; stop once every worker finished."""
        agent = self._agent
        if isinstance(message, Alive):
            handle.last_alive = message  # several a second: nothing else to update
            return
        if isinstance(message, Hello):
            handle.hello = True
            log.info("worker %d ready (pid %d)", message.local_rank, message.pid)
            move(handle, WorkerPhase.SPARE)
            agent.assign(handle)
        elif isinstance(message, WorkerStatus):
            stale = message.state == "training" and message.epoch and message.epoch < agent.epoch
            if not stale:
                move(handle, _STATUS_PHASE[message.state])
            if message.state in ("succeeded", "failed"):
                log.info("worker %d %s: %s", handle.local_rank, message.state, message.detail)
        elif isinstance(message, Progress):
            self._on_progress(handle, message)
        elif isinstance(message, ReplicaSteps):
            handle.replica_steps = message  # its epoch is checked when a report is built
        elif isinstance(message, CopyInterval):
            if message.epoch == agent.epoch:
                agent.metrics.buddy_copy_interval.set(message.interval)
                agent.metrics.buddy_copy_cost.set(message.cost_ratio)
            log.info(
                "worker %d: buddy copies every %d steps in epoch %d (it needed %d; a refresh costs %.4f s, a step "
                "%.4f s)",
                handle.local_rank,
                message.interval,
                message.epoch,
                message.proposed,
                message.refresh_cost_seconds,
                message.clear_step_seconds,
            )
        elif isinstance(message, CheckpointSaved):
            if agent.checkpoints.saved(message, suspending=self._suspending(message.epoch)):
                self._send_soon()
        elif isinstance(message, CheckpointProblem):
            self._on_checkpoint_problem(handle, message)
        elif isinstance(message, PhaseTimes):
            self._on_phase_times(handle, message)
        elif isinstance(message, CollectiveFailed):
            self._on_collective_failed(handle, message)
        agent.refresh_metrics()
        if agent.state is AgentState.SUCCEEDED:
            agent.request_stop("every worker finished training")

    def _on_progress(self, handle: WorkerHandle, progress: Progress) -> None:
        agent = self._agent
        if progress.epoch != agent.epoch:
            return  # a step of an epoch the agent no longer holds: liveness only
        first = handle.progress is None or handle.progress.epoch != progress.epoch
        if handle.phase is not WorkerPhase.TRAINING:
            move(handle, WorkerPhase.TRAINING)
        handle.progress = progress
        if first:
            self._send_soon()  # the epoch's first committed step: the operator ends a recovery on it
        if handle.local_rank == self._reporting_rank():
            agent.metrics.step_time.observe(progress.step_time_seconds)
            agent.metrics.last_step_time.set(progress.step_time_seconds)
            agent.metrics.tokens_per_second.set(progress.tokens_per_second)
            agent.metrics.loss.set(progress.loss)
            agent.metrics.consumed_samples.set(progress.consumed_samples)

    def _reporting_rank(self) -> int:
        """The local worker whose loss and throughput speak for the pod: the lowest live one."""
        return min((h.local_rank for h in self._agent.supervisor.workers.values() if h.alive), default=0)

    def _on_checkpoint_problem(self, handle: WorkerHandle, message: CheckpointProblem) -> None:
        log.warning(
            "worker %d: checkpoint of step %d %s (epoch %d): %s",
            handle.local_rank,
            message.step,
            message.kind,
            message.epoch,
            message.detail,
        )
        if self._agent.checkpoints.problem(message, suspending=self._suspending(message.epoch)):
            self._send_soon()

    def _on_phase_times(self, handle: WorkerHandle, message: PhaseTimes) -> None:
        durations, instants = split_phase_times(message.phases)
        log.info(
            "worker %d reconfigured into epoch %d: %s",
            handle.local_rank,
            message.epoch,
            ", ".join(f"{k} {v:.3f}s" for k, v in durations.items()),
        )
        # Every local worker times the same reconfiguration; count it once, by the first report.
        if message.epoch in self._recorded_phase_epochs:
            return
        self._recorded_phase_epochs.add(message.epoch)
        self.last_recovery = LastRecovery(epoch=message.epoch, phases=durations, instants=instants)
        plan = self._agent.plan
        initial = (
            plan is not None and plan.epoch == message.epoch and plan.reason in (PlanReason.INITIAL, PlanReason.RESUME)
        )
        if not initial:
            self._agent.metrics.observe_phases(durations)

    def _on_collective_failed(self, handle: WorkerHandle, message: CollectiveFailed) -> None:
        agent = self._agent
        agent.metrics.collective_failures.inc()
        pod = message.peer_pod
        if pod is None and message.peer_rank is not None and agent.plan is not None and message.epoch == agent.epoch:
            pod = agent.plan.pod_of_rank().get(message.peer_rank)
        log.warning(
            "worker %d: collective failed in epoch %d (peer rank %s, pod %s): %s",
            handle.local_rank,
            message.epoch,
            message.peer_rank,
            pod,
            message.reason,
        )
        if handle.phase in (WorkerPhase.TRAINING, WorkerPhase.RECONFIGURING):
            move(handle, WorkerPhase.RECONFIGURING)
        agent.report_failure(
            PeerFailure(epoch=message.epoch, rank=message.peer_rank, pod=pod, reason=message.reason[:1024])
        )

    # -- hangs, exits and restarts ---------------------------------------------------------------

    def on_hung(self, handle: WorkerHandle, silent_seconds: float) -> None:
        """Kill a worker the supervisor found silent for too long; its exit is handled as a failure."""
        self._agent.metrics.worker_kills.labels(reason="hung").inc()
        # The phase of its last Alive says which limit applied (a data read or a save is allowed
        # the hang timeout: supervisor.stopped_silence).
        alive = handle.last_alive
        last = f", last alive in {alive.phase}" if alive is not None and alive.phase else ""
        self._agent.supervisor.kill(
            handle,
            f"hung: silent for {silent_seconds:.1f}s while {handle.phase.value}{last} "
            f"(limit {self._silence_limit(handle):g}s)",
        )

    def _silence_limit(self, handle: WorkerHandle) -> float:
        if handle.phase is WorkerPhase.TRAINING:
            return self._agent.supervisor.allowed_silence(handle)
        return self._agent.supervisor.hang_timeout_seconds

    def on_exit(self, handle: WorkerHandle) -> None:
        """Count a worker's exit; a failure is reported, then restarted while the budget lasts."""
        agent = self._agent
        if agent.supervisor.workers.get(handle.local_rank) is not handle:
            return
        succeeded = handle.exit_code == 0 and handle.phase is WorkerPhase.SUCCEEDED
        agent.metrics.worker_exits.labels(
            outcome="succeeded" if succeeded else ("killed" if handle.kill_reason else "failed")
        ).inc()
        if agent.stopping:
            agent.refresh_metrics()
            return
        if succeeded:
            agent.refresh_metrics()
            if agent.state is AgentState.SUCCEEDED:
                agent.request_stop("every worker finished training")
            return
        move(handle, WorkerPhase.FAILED)
        reason = handle.kill_reason or f"worker exited with code {handle.exit_code}"
        agent.report_failure(
            PeerFailure(
                epoch=agent.epoch,
                rank=agent.rank_of(handle),
                pod=agent.settings.pod_name,
                reason=f"local rank {handle.local_rank}: {reason}"[:1024],
            )
        )
        agent.broken_epoch = max(agent.broken_epoch, agent.epoch)
        if self.restarts < agent.settings.worker_max_restarts:
            self.restarts += 1
            agent.metrics.worker_restarts.inc()
            asyncio.get_running_loop().create_task(self._restart(handle))
        else:
            agent.refresh_metrics()
            # The pod is lost to the job: say so at once, then end so Kubernetes sees the failure.
            agent.request_stop(f"worker {handle.local_rank} failed ({reason}) and no restart is left", code=1)
        agent.refresh_metrics()

    async def _restart(self, handle: WorkerHandle) -> None:
        agent = self._agent
        log.warning(
            "restarting worker %d (restart %d of %d)",
            handle.local_rank,
            self.restarts,
            agent.settings.worker_max_restarts,
        )
        if agent.heartbeat is not None:
            # Tell the operator before the fresh worker makes the pod look healthy again.
            await agent.heartbeat.send_once()
        try:
            await agent.supervisor.spawn(handle.local_rank, generation=handle.generation + 1)
        except OSError as err:
            log.error("cannot restart worker %d: %s", handle.local_rank, err)
            agent.request_stop(f"cannot restart worker {handle.local_rank}", code=1)
        agent.refresh_metrics()
