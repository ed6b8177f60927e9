"""The agent: one per pod. Holds the plan, drives the workers, answers the control port.

Everything runs on one asyncio loop, so the agent's state needs no locks: worker messages,
exits, plan pushes and heartbeats are handled one at a time. The agent coordinates; what the
workers say is handled in :mod:`.worker_events`, what the pod reports is built in :mod:`.reports`,
and checkpoint outcomes are kept in :mod:`.checkpoints`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from megatron_contract.agent import AgentReport, AgentState, PeerFailure
from megatron_contract.mesh import MeshPlan
from megatron_trainer.agent import reports
from megatron_trainer.agent.checkpoints import CheckpointRecord
from megatron_trainer.agent.heartbeat import HeartbeatSender
from megatron_trainer.agent.lifecycle import WorkerPhase, pod_state
from megatron_trainer.agent.metrics import AgentMetrics
from megatron_trainer.agent.plan_acceptance import PlanRejected, check_epoch, parse_plan
from megatron_trainer.agent.rendezvous_host import RendezvousHost
from megatron_trainer.agent.settings import AgentSettings
from megatron_trainer.agent.supervisor import WorkerHandle, WorkerSupervisor, worker_environment
from megatron_trainer.agent.worker_events import WorkerEvents, move
from megatron_trainer.channel import Assign

log = logging.getLogger(__name__)


class Agent:
    """The pod's agent. :meth:`start`, then :meth:`wait` for the exit code, then :meth:`stop`."""

    def __init__(self, settings: AgentSettings, environ: Mapping[str, str] | None = None) -> None:
        self.settings = settings
        self.metrics = AgentMetrics()
        self.plan: MeshPlan | None = None
        self.operator_epoch: int | None = None
        self.started_at = time.monotonic()
        self.failures = reports.PendingFailures()
        self.checkpoints = CheckpointRecord()
        # A worker that replaces a dead one must not join the epoch its predecessor broke.
        self.broken_epoch = 0
        self.stopping = False
        self._done: asyncio.Future[int] | None = None
        self.events = WorkerEvents(self)
        self.supervisor = WorkerSupervisor(
            settings.worker_command,
            worker_environment(os.environ if environ is None else environ, settings.spec_json, settings.pod_name),
            settings.hang_timeout_seconds,
            on_message=self.events.on_message,
            on_exit=self.events.on_exit,
            checkpoint_interval_steps=settings.spec.checkpoint.interval_steps if settings.spec.checkpoint else None,
            checkpoint_grace_seconds=settings.checkpoint_save_grace_seconds,
            synchronous_saves=not settings.spec.checkpoint.async_save if settings.spec.checkpoint else True,
            final_step=settings.spec.training.train_iters,
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
        self.supervisor.start_watchdog(self.events.on_hung)
        if self.heartbeat is not None:
            self.heartbeat.start()
        else:
            log.warning("no operator URL configured: heartbeats are off")
        self.refresh_metrics()
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
        self.stopping = True
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
        copies = plan.optimizer_state
        if copies is None or not copies.buddies:
            self.metrics.buddy_copy_interval.set(0)
        elif copies.replica_cost_percent is None:  # under a budget the workers say what they agreed on
            self.metrics.buddy_copy_interval.set(copies.replica_interval_steps)
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
                self.assign(handle)
        self.refresh_metrics()
        return {"epoch": plan.epoch, "member": member is not None, "state": self.state.value}

    def assign(self, handle: WorkerHandle) -> None:
        """Forward the held plan to one worker and move it to the phase the plan implies."""
        plan = self.plan
        if plan is None or (handle.generation > 0 and plan.epoch <= self.broken_epoch):
            return
        if handle.send(Assign(plan=plan, pod=self.settings.pod_name)):
            member = plan.member(self.settings.pod_name) is not None
            move(handle, WorkerPhase.RECONFIGURING if member else WorkerPhase.SPARE)

    def rank_of(self, handle: WorkerHandle) -> int | None:
        """Global rank of a worker in the held plan, or None when its pod is not a member."""
        member = self.plan.member(self.settings.pod_name) if self.plan is not None else None
        return member.ranks[handle.local_rank] if member is not None else None

    # -- reports ---------------------------------------------------------------------------------

    def report_failure(self, failure: PeerFailure) -> None:
        """Hold a failure for the next report and send that report at once."""
        if self.failures.add(failure) and self.heartbeat is not None:
            self.heartbeat.send_soon()

    def _on_report_acknowledged(self, report: AgentReport, operator_epoch: int | None) -> None:
        self.failures.acknowledge(report)
        if operator_epoch is not None:
            if operator_epoch > self.epoch and operator_epoch != self.operator_epoch:
                log.warning("the operator is at epoch %d, this agent holds %d", operator_epoch, self.epoch)
            self.operator_epoch = operator_epoch

    def report(self) -> AgentReport:
        """The heartbeat as of now."""
        return reports.build_report(self)

    def state_document(self) -> dict[str, Any]:
        """What ``GET /v1/state`` returns: the report plus what a human debugging the pod wants."""
        return reports.state_document(self)

    def refresh_metrics(self) -> None:
        """Bring the state, epoch, workers and step gauges up to date."""
        reports.refresh_metrics(self)
