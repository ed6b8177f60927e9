"""The agent: one per pod. Holds the plan, drives the workers, answers the control port.

Everything runs on one asyncio loop, so the agent's state needs no locks: worker messages,
exits, plan pushes and heartbeats are handled one at a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from megatron_contract.agent import AgentReport, AgentState, PeerFailure, WorkerState
from megatron_contract.mesh import MeshPlan, PlanReason
from megatron_trainer.agent.heartbeat import HeartbeatSender
from megatron_trainer.agent.lifecycle import LifecycleError, WorkerPhase, pod_state
from megatron_trainer.agent.metrics import AgentMetrics, split_phase_times
from megatron_trainer.agent.plan_acceptance import PlanRejected, check_epoch, parse_plan
from megatron_trainer.agent.rendezvous_host import RendezvousHost
from megatron_trainer.agent.settings import AgentSettings
from megatron_trainer.agent.supervisor import WorkerHandle, WorkerSupervisor, worker_environment
from megatron_trainer.channel import (
    Alive,
    Assign,
    CheckpointProblem,
    CheckpointSaved,
    CollectiveFailed,
    Hello,
    PhaseTimes,
    Progress,
    ToAgent,
    WorkerStatus,
)

log = logging.getLogger(__name__)

MAX_PENDING_FAILURES = 64  # AgentReport.failed_peers holds at most this many

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


class Agent:
    """The pod's agent. :meth:`start`, then :meth:`wait` for the exit code, then :meth:`stop`."""

    def __init__(self, settings: AgentSettings, environ: Mapping[str, str] | None = None) -> None:
        self.settings = settings
        self.metrics = AgentMetrics()
        self.plan: MeshPlan | None = None
        self.operator_epoch: int | None = None
        self.last_recovery: LastRecovery | None = None
        self.started_at = time.monotonic()
        # Failures of this pod's own workers or reported peers, until an acknowledged report carried them.
        self.pending_failures: list[PeerFailure] = []
        self.checkpoint_step: int | None = None  # newest complete checkpoint a local worker saved
        # Training time blocked starting saves: the longest local worker per save, for the newest saves
        # (step -> seconds; local workers report the same save one after another), and older ones summed.
        self.checkpoint_blocking: dict[int, float] = {}
        self.checkpoint_blocking_older = 0.0
        self.checkpoint_rejected: str | None = None  # the last checkpoint a restore rejected, and why
        self.checkpoint_unusable: str | None = None  # a restore that gave up (two rejections)
        # The checkpoint a suspend plan asked for: (epoch, step once complete, why it failed).
        self.suspend_outcome: tuple[int, int | None, str | None] | None = None
        # A worker that replaces a dead one must not join the epoch its predecessor broke.
        self._broken_epoch = 0
        self._restarts = 0
        self._recorded_phase_epochs: set[int] = set()
        self._done: asyncio.Future[int] | None = None
        self._stopping = False
        self.supervisor = WorkerSupervisor(
            settings.worker_command,
            worker_environment(os.environ if environ is None else environ, settings.spec_json, settings.pod_name),
            settings.hang_timeout_seconds,
            on_message=self._on_worker_message,
            on_exit=self._on_worker_exit,
            checkpoint_interval_steps=settings.spec.checkpoint.interval_steps if settings.spec.checkpoint else None,
            checkpoint_grace_seconds=settings.checkpoint_save_grace_seconds,
        )
        self.rendezvous = RendezvousHost(settings.pod_ip, settings.rendezvous_port)
        self.heartbeat: HeartbeatSender | None = None
        if settings.report_url:
            self.heartbeat = HeartbeatSender(
                settings.report_url,
                settings.token,
                settings.heartbeat_interval_seconds,
                build_report=self.report,
                on_acknowledged=self._on_report_acknowledged,
                metrics=self.metrics,
            )

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """Epoch of the held plan; 0 before the first."""
        return self.plan.epoch if self.plan is not None else 0

    @property
    def state(self) -> AgentState:
        """The pod's state, derived from its workers' phases."""
        return pod_state(h.phase for h in self.supervisor.workers.values())

    @property
    def healthy(self) -> bool:
        """False once a worker failed (until a restarted one is back)."""
        return self.state is not AgentState.FAILED

    async def start(self) -> None:
        """Spawn the workers, start the store (in a thread: it imports torch) and the background loops.

        Raises:
            OSError: when the rendezvous port cannot be bound.
        """
        self._done = asyncio.get_running_loop().create_future()
        store = asyncio.create_task(asyncio.to_thread(self.rendezvous.start)) if self.settings.host_rendezvous else None
        for local_rank in range(self.settings.gpus_per_pod):
            await self.supervisor.spawn(local_rank)
        self.supervisor.start_watchdog(self._on_worker_hung)
        if self.heartbeat is not None:
            self.heartbeat.start()
        else:
            log.warning("no operator URL configured: heartbeats are off")
        self._refresh_metrics()
        if store is not None:
            await store

    async def wait(self) -> int:
        """Wait until the agent is done; its process exit code (0: succeeded or asked to stop)."""
        assert self._done is not None, "start() first"
        return await self._done

    def request_stop(self, reason: str, code: int = 0) -> None:
        """End the agent (signal, job done, unrecoverable failure)."""
        if self._done is not None and not self._done.done():
            log.info("agent stopping: %s", reason)
            self._done.set_result(code)

    async def stop(self) -> None:
        """Shut the workers down, send a last report, close everything."""
        self._stopping = True
        await self.supervisor.shutdown("agent stopping", self.settings.shutdown_grace_seconds)
        if self.heartbeat is not None:
            await self.heartbeat.send_once()
            await self.heartbeat.close()
        self.rendezvous.stop()

    # -- plans -----------------------------------------------------------------------------------

    def accept_plan(self, body: bytes) -> dict[str, Any]:
        """Take a plan pushed by the operator (token and size were checked by the server).

        Raises:
            PlanRejected: 400 invalid, 409 stale epoch or finished pod, 503 failed pod.
        """
        plan = parse_plan(body, job_uid=self.settings.job_uid, gpus_per_pod=self.settings.gpus_per_pod)
        check_epoch(plan, self.epoch)
        state = self.state
        if state is AgentState.SUCCEEDED:
            raise PlanRejected(409, "this pod has finished training")
        if state is AgentState.FAILED:
            raise PlanRejected(503, "this pod has failed and is not restarting its workers")
        self.plan = plan
        member = plan.member(self.settings.pod_name)
        log.info(
            "accepted plan epoch %d (%s, mesh %s, resume at step %d): %s",
            plan.epoch,
            plan.reason.value,
            plan.mesh_label,
            plan.resume_step,
            f"ranks {member.ranks}" if member else "not a member, spare",
        )
        for handle in self.supervisor.workers.values():
            if handle.hello and handle.alive:
                self._assign(handle)
        self._refresh_metrics()
        return {"epoch": plan.epoch, "member": member is not None, "state": self.state.value}

    def _assign(self, handle: WorkerHandle) -> None:
        """Forward the held plan to one worker and move it to the phase the plan implies."""
        plan = self.plan
        if plan is None or (handle.generation > 0 and plan.epoch <= self._broken_epoch):
            return
        if handle.send(Assign(plan=plan, pod=self.settings.pod_name)):
            member = plan.member(self.settings.pod_name) is not None
            self._move(handle, WorkerPhase.RECONFIGURING if member else WorkerPhase.SPARE)

    def rank_of(self, handle: WorkerHandle) -> int | None:
        """Global rank of a worker in the held plan, or None when its pod is not a member."""
        member = self.plan.member(self.settings.pod_name) if self.plan is not None else None
        return member.ranks[handle.local_rank] if member is not None else None

    # -- worker events ---------------------------------------------------------------------------

    def _move(self, handle: WorkerHandle, phase: WorkerPhase) -> None:
        try:
            handle.move_to(phase)
        except LifecycleError as err:
            log.warning("worker %d: %s (ignored)", handle.local_rank, err)

    def _on_worker_message(self, handle: WorkerHandle, message: ToAgent) -> None:
        if isinstance(message, Alive):
            handle.last_alive = message  # several a second: nothing else to update
            return
        if isinstance(message, Hello):
            handle.hello = True
            log.info("worker %d ready (pid %d)", message.local_rank, message.pid)
            self._move(handle, WorkerPhase.SPARE)
            self._assign(handle)
        elif isinstance(message, WorkerStatus):
            stale = message.state == "training" and message.epoch and message.epoch < self.epoch
            if not stale:
                self._move(handle, _STATUS_PHASE[message.state])
            if message.state in ("succeeded", "failed"):
                log.info("worker %d %s: %s", handle.local_rank, message.state, message.detail)
        elif isinstance(message, Progress):
            self._on_progress(handle, message)
        elif isinstance(message, CheckpointSaved):
            if message.blocking_seconds is not None:
                before = self.checkpoint_blocking.get(message.step, 0.0)
                self.checkpoint_blocking[message.step] = max(before, message.blocking_seconds)
                while len(self.checkpoint_blocking) > 4:
                    self.checkpoint_blocking_older += self.checkpoint_blocking.pop(min(self.checkpoint_blocking))
            if self._suspending(message.epoch):
                self.suspend_outcome = (message.epoch, message.step, None)
                if self.heartbeat is not None:
                    self.heartbeat.send_soon()  # the operator stops the pods on it
            # Complete for the whole world once any rank reports it (save ends with a barrier).
            if self.checkpoint_step is None or message.step > self.checkpoint_step:
                self.checkpoint_step = message.step
                log.info("checkpoint of step %d complete (epoch %d)", message.step, message.epoch)
        elif isinstance(message, CheckpointProblem):
            self._on_checkpoint_problem(handle, message)
        elif isinstance(message, PhaseTimes):
            self._on_phase_times(handle, message)
        elif isinstance(message, CollectiveFailed):
            self._on_collective_failed(handle, message)
        self._refresh_metrics()
        if self.state is AgentState.SUCCEEDED:
            self.request_stop("every worker finished training")

    def _on_progress(self, handle: WorkerHandle, progress: Progress) -> None:
        if progress.epoch != self.epoch:
            return  # a step of an epoch the agent no longer holds: liveness only
        first = handle.progress is None or handle.progress.epoch != progress.epoch
        if handle.phase is not WorkerPhase.TRAINING:
            self._move(handle, WorkerPhase.TRAINING)
        handle.progress = progress
        if first and self.heartbeat is not None:
            self.heartbeat.send_soon()  # the epoch's first committed step: the operator ends a recovery on it
        if handle.local_rank == self._reporting_rank():
            self.metrics.step_time.observe(progress.step_time_seconds)
            self.metrics.last_step_time.set(progress.step_time_seconds)
            self.metrics.tokens_per_second.set(progress.tokens_per_second)
            self.metrics.loss.set(progress.loss)
            self.metrics.consumed_samples.set(progress.consumed_samples)

    def _reporting_rank(self) -> int:
        """The local worker whose loss and throughput speak for the pod: the lowest live one."""
        return min((h.local_rank for h in self.supervisor.workers.values() if h.alive), default=0)

    def _on_checkpoint_problem(self, handle: WorkerHandle, message: CheckpointProblem) -> None:
        log.warning(
            "worker %d: checkpoint of step %d %s (epoch %d): %s",
            handle.local_rank,
            message.step,
            message.kind,
            message.epoch,
            message.detail,
        )
        if message.kind == "failed" and self._suspending(message.epoch):
            self.suspend_outcome = (message.epoch, None, f"step {message.step}: {message.detail}"[:1024])
            if self.heartbeat is not None:
                self.heartbeat.send_soon()
        if message.kind == "rejected":
            self.checkpoint_rejected = f"step {message.step}: {message.detail}"[:1024]
        elif message.kind == "unusable":
            self.checkpoint_unusable = message.detail[:1024]

    def _suspending(self, epoch: int) -> bool:
        """Whether ``epoch`` is the held plan's and that plan suspends the job."""
        return self.plan is not None and self.plan.epoch == epoch and self.plan.reason is PlanReason.SUSPEND

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
        initial = (
            self.plan is not None
            and self.plan.epoch == message.epoch
            and self.plan.reason in (PlanReason.INITIAL, PlanReason.RESUME)
        )
        if not initial:
            self.metrics.observe_phases(durations)

    def _on_collective_failed(self, handle: WorkerHandle, message: CollectiveFailed) -> None:
        self.metrics.collective_failures.inc()
        pod = message.peer_pod
        if pod is None and message.peer_rank is not None and self.plan is not None and message.epoch == self.epoch:
            pod = self.plan.pod_of_rank().get(message.peer_rank)
        log.warning(
            "worker %d: collective failed in epoch %d (peer rank %s, pod %s): %s",
            handle.local_rank,
            message.epoch,
            message.peer_rank,
            pod,
            message.reason,
        )
        if handle.phase in (WorkerPhase.TRAINING, WorkerPhase.RECONFIGURING):
            self._move(handle, WorkerPhase.RECONFIGURING)
        self._report_failure(
            PeerFailure(epoch=message.epoch, rank=message.peer_rank, pod=pod, reason=message.reason[:1024])
        )

    def _on_worker_hung(self, handle: WorkerHandle, silent_seconds: float) -> None:
        self.metrics.worker_kills.labels(reason="hung").inc()
        self.supervisor.kill(
            handle,
            f"hung: silent for {silent_seconds:.1f}s while {handle.phase.value} "
            f"(limit {self._silence_limit(handle):g}s)",
        )

    def _silence_limit(self, handle: WorkerHandle) -> float:
        if handle.phase is WorkerPhase.TRAINING:
            return self.supervisor.allowed_silence(handle)
        return self.supervisor.hang_timeout_seconds

    def _on_worker_exit(self, handle: WorkerHandle) -> None:
        if self.supervisor.workers.get(handle.local_rank) is not handle:
            return
        succeeded = handle.exit_code == 0 and handle.phase is WorkerPhase.SUCCEEDED
        self.metrics.worker_exits.labels(
            outcome="succeeded" if succeeded else ("killed" if handle.kill_reason else "failed")
        ).inc()
        if self._stopping:
            self._refresh_metrics()
            return
        if succeeded:
            self._refresh_metrics()
            if self.state is AgentState.SUCCEEDED:
                self.request_stop("every worker finished training")
            return
        self._move(handle, WorkerPhase.FAILED)
        reason = handle.kill_reason or f"worker exited with code {handle.exit_code}"
        self._report_failure(
            PeerFailure(
                epoch=self.epoch,
                rank=self.rank_of(handle),
                pod=self.settings.pod_name,
                reason=f"local rank {handle.local_rank}: {reason}"[:1024],
            )
        )
        self._broken_epoch = max(self._broken_epoch, self.epoch)
        if self._restarts < self.settings.worker_max_restarts:
            self._restarts += 1
            self.metrics.worker_restarts.inc()
            asyncio.get_running_loop().create_task(self._restart(handle))
        else:
            self._refresh_metrics()
            # The pod is lost to the job: say so at once, then end so Kubernetes sees the failure.
            self.request_stop(f"worker {handle.local_rank} failed ({reason}) and no restart is left", code=1)
        self._refresh_metrics()

    async def _restart(self, handle: WorkerHandle) -> None:
        log.warning(
            "restarting worker %d (restart %d of %d)",
            handle.local_rank,
            self._restarts,
            self.settings.worker_max_restarts,
        )
        if self.heartbeat is not None:
            # Tell the operator before the fresh worker makes the pod look healthy again.
            await self.heartbeat.send_once()
        try:
            await self.supervisor.spawn(handle.local_rank, generation=handle.generation + 1)
        except OSError as err:
            log.error("cannot restart worker %d: %s", handle.local_rank, err)
            self.request_stop(f"cannot restart worker {handle.local_rank}", code=1)
        self._refresh_metrics()

    # -- reports ---------------------------------------------------------------------------------

    def _report_failure(self, failure: PeerFailure) -> None:
        failure = failure.model_copy(update={"detected_at": datetime.now(UTC)})
        key = (failure.epoch, failure.rank, failure.pod)
        if any((f.epoch, f.rank, f.pod) == key for f in self.pending_failures):
            return
        self.pending_failures = [*self.pending_failures, failure][-MAX_PENDING_FAILURES:]
        if self.heartbeat is not None:
            self.heartbeat.send_soon()

    def _on_report_acknowledged(self, report: AgentReport, operator_epoch: int | None) -> None:
        delivered = {id(f) for f in report.failed_peers}
        self.pending_failures = [f for f in self.pending_failures if id(f) not in delivered]
        if operator_epoch is not None:
            if operator_epoch > self.epoch and operator_epoch != self.operator_epoch:
                log.warning("the operator is at epoch %d, this agent holds %d", operator_epoch, self.epoch)
            self.operator_epoch = operator_epoch

    def _member_progress(self) -> list[Progress]:
        return [
            h.progress
            for h in self.supervisor.workers.values()
            if h.progress is not None and h.progress.epoch == self.epoch
        ]

    def report(self) -> AgentReport:
        """The heartbeat as of now."""
        progress = self._member_progress()
        slowest = min(progress, key=lambda p: p.step) if progress else None
        suspend = self.suspend_outcome if self.suspend_outcome and self.suspend_outcome[0] == self.epoch else None
        return AgentReport(
            job_uid=self.settings.job_uid,
            pod=self.settings.pod_name,
            epoch=self.epoch,
            state=self.state,
            healthy=self.healthy,
            step=slowest.step if slowest else None,
            consumed_samples=slowest.consumed_samples if slowest else None,
            loss=slowest.loss if slowest else None,
            step_time_seconds=slowest.step_time_seconds if slowest else None,
            tokens_per_second=slowest.tokens_per_second if slowest else None,
            workers=[
                WorkerState(
                    local_rank=h.local_rank,
                    pid=h.pid,
                    rank=self.rank_of(h),
                    alive=h.alive,
                    step=h.progress.step if h.progress is not None else None,
                )
                for h in sorted(self.supervisor.workers.values(), key=lambda h: h.local_rank)
            ],
            # The same objects as pending_failures: acknowledgement clears exactly these.
            failed_peers=list(self.pending_failures),
            checkpoint_step=self.checkpoint_step,
            checkpoint_blocking_seconds=(
                self.checkpoint_blocking_older + sum(self.checkpoint_blocking.values())
                if self.checkpoint_blocking
                else None
            ),
            checkpoint_rejected=self.checkpoint_rejected,
            checkpoint_unusable=self.checkpoint_unusable,
            suspend_step=suspend[1] if suspend is not None else None,
            suspend_error=suspend[2] if suspend is not None else None,
            sent_at=datetime.now(UTC),
        )

    def state_document(self) -> dict[str, Any]:
        """What ``GET /v1/state`` returns: the report plus what a human debugging the pod wants."""
        doc = self.report().to_wire()
        doc["ranks"] = (m.ranks if (m := self.plan.member(self.settings.pod_name)) else []) if self.plan else []
        doc["member"] = bool(doc["ranks"])
        doc["operatorEpoch"] = self.operator_epoch
        doc["rendezvous"] = {
            "host": self.rendezvous.address,
            "port": self.rendezvous.port,
            "running": self.rendezvous.running,
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
                sorted(self.supervisor.workers.values(), key=lambda h: h.local_rank),
                strict=True,
            )
        ]
        if self.last_recovery is not None:
            doc["lastRecovery"] = {
                "epoch": self.last_recovery.epoch,
                "phases": self.last_recovery.phases,
                "instants": self.last_recovery.instants,
            }
        doc["uptimeSeconds"] = round(time.monotonic() - self.started_at, 3)
        return doc

    def _refresh_metrics(self) -> None:
        self.metrics.set_state(self.state)
        self.metrics.epoch.set(self.epoch)
        self.metrics.workers_alive.set(sum(1 for h in self.supervisor.workers.values() if h.alive))
        progress = self._member_progress()
        if progress:
            self.metrics.step.set(min(p.step for p in progress))
