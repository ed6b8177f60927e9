"""One controller per job: carries out what :func:`reconcile.assess` decides, in a safe order.

The order is what makes a restart safe: (1) a new plan is written to status before anything else
happens (the commit point: a restarted operator reads it back and never plans that epoch again);
(2) the plan is pushed to every member that does not hold it yet, in parallel (agents refuse an
epoch they already hold, so a second push after a restart is harmless); (3) failed pods are
deleted, pod serials are reserved on the job and new pods created (names never repeat, creates
are idempotent); (4) the status is recomputed and written once if it changed, and only then are
the events posted.

A job's controller runs as a kopf daemon: it wakes on every event of the job's pods, on node
changes, on agent reports that matter, and at least every few seconds to check heartbeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from megatron_contract import wire
from megatron_contract.agent import AgentReport
from megatron_contract.job import FailureRecord, JobPhase, MegatronJobSpec, MegatronJobStatus
from megatron_contract.mesh import MeshPlan, PlanReason
from megatron_operator import builders, kube, metrics
from megatron_operator.builders import JobRef
from megatron_operator.failures import Failure, PodFacts
from megatron_operator.heartbeats import HeartbeatBook
from megatron_operator.planner import Outcome
from megatron_operator.push import PlanPusher, PushOutcome
from megatron_operator.reconcile import AgentSignals, Assessment, assess, is_recovery, phase_of
from megatron_operator.settings import OperatorSettings
from megatron_operator.status import Observation, Reason, compute_status, status_body, status_changed

log = logging.getLogger(__name__)

EXPECTED_POD_SECONDS = 120.0  # a created pod not seen in the index by then is created again
PUSH_BACKOFF_MAX = 30.0


def _now() -> datetime:
    return datetime.now(UTC)


class JobController:
    """The in-memory side of one job: its token, failures seen, pods on their way, acknowledgements."""

    def __init__(
        self,
        job: JobRef,
        body: Any,
        settings: OperatorSettings,
        book: HeartbeatBook,
        pusher: PlanPusher,
        pods_of: Callable[[], list[PodFacts]],
        nodes: Callable[[], dict[str, str]],
    ) -> None:
        self.job = job
        self.body = body  # kopf's live view of the job
        self.settings = settings
        self.book = book
        self.pusher = pusher
        self.pods_of = pods_of
        self.nodes = nodes
        self.wake = asyncio.Event()
        self.token: str | None = None
        self.failed: dict[str, Failure] = {}
        self.expected: dict[str, float] = {}
        self.retired: set[str] = set()  # surplus pods this operator deleted (not failures)
        self.acked: set[str] = set()
        self.acked_epoch = 0
        self.push_due: dict[str, float] = {}
        self.push_backoff: dict[str, float] = {}
        self.waiting = False
        self.detected_at: float | None = None
        self.status = self._read_status(body)
        self.done = False
        self._labels = {"namespace": job.namespace, "job": job.name}

    # -- wiring ----------------------------------------------------------------------------------

    @staticmethod
    def _read_status(body: Any) -> MegatronJobStatus:
        raw = dict(body.get("status") or {})
        try:
            return MegatronJobStatus.model_validate(raw)
        except ValidationError as exc:
            log.warning("ignoring an unreadable status: %s", exc)
            return MegatronJobStatus()

    @property
    def plan(self) -> MeshPlan | None:
        """The plan in force."""
        return self.status.plan

    def accept_reports(self, reports: Iterable[AgentReport]) -> int:
        """Agent reports of this job (already stored in the book): wake for anything that matters."""
        plan = self.plan
        members = {m.pod for m in plan.members} if plan is not None else set()
        for report in reports:
            metrics.REPORTS.labels(**self._labels).inc()
            if report.failed_peers or not report.healthy:
                self.wake.set()
            if plan is None or report.pod not in members:
                continue
            if report.epoch >= plan.epoch:
                if report.pod not in self.acked and self.acked_epoch == plan.epoch:
                    self.acked.add(report.pod)
                    self.wake.set()
            else:
                # The agent is behind (it missed a push, or restarted): send the plan again now.
                self.acked.discard(report.pod)
                self.push_due[report.pod] = 0.0
                self.wake.set()
        return plan.epoch if plan is not None else 0

    # -- the loop ----------------------------------------------------------------------------------

    async def run(self, stopped: Any) -> None:
        """Reconcile until the job is deleted (``stopped``) or finished."""
        await self._setup()
        failures_in_a_row = 0
        while not stopped:
            self.wake.clear()
            if self.done:  # finished or invalid: nothing to do until the job is deleted
                await self._sleep(self.settings.resync_seconds)
                continue
            try:
                await self.reconcile_once()
                failures_in_a_row = 0
            except asyncio.CancelledError:
                raise
            except Exception:
                failures_in_a_row += 1
                log.exception("reconcile of %s/%s failed (%d in a row)", self.job.namespace, self.job.name,
                              failures_in_a_row)
            await self._sleep(min(2.0 ** failures_in_a_row, 30.0) if failures_in_a_row else self._idle())

    def _idle(self) -> float:
        try:
            spec = MegatronJobSpec.model_validate(self.body["spec"])
            heartbeat = spec.failure_detection.heartbeat_timeout_seconds / 4
        except (ValidationError, KeyError):
            heartbeat = self.settings.resync_seconds
        due = [t - time.monotonic() for t in self.push_due.values()]
        return max(0.05, min([self.settings.resync_seconds, heartbeat, *due]))

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout=seconds)

    async def _setup(self) -> None:
        self.token = await kube.ensure_secret(builders.build_secret(self.job, builders.new_token()))
        await kube.ensure_service(builders.build_service(self.job))

    def _crash_point(self, name: str) -> None:
        if self.settings.crash_at == name:
            log.warning("fault injection: killing the operator at %s", name)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    async def reconcile_once(self) -> None:
        """One pass: observe, decide, act, write status, post events."""
        try:
            spec = MegatronJobSpec.model_validate(self.body["spec"])
        except ValidationError as exc:
            await self._fail_invalid(exc)
            return
        generation = self.body.get("metadata", {}).get("generation")
        mono = time.monotonic()
        pods = self.pods_of()
        self.expected = {n: t for n, t in self.expected.items() if t > mono and n not in {p.name for p in pods}}
        plan = self.plan
        members = [m.pod for m in plan.members] if plan is not None else []
        watched = [p.name for p in pods if p.name not in self.failed]
        signals = AgentSignals(
            silent=self.book.missing(self.job.uid, watched, spec.failure_detection.heartbeat_timeout_seconds, mono),
            unhealthy=self.book.self_reported_failed(self.job.uid, watched),
            accusations=self.book.accusations(self.job.uid, plan.epoch) if plan is not None else (),
            completed_step=self.book.completed_step(self.job.uid, members),
            all_succeeded=self.book.succeeded(self.job.uid, members),
            checkpoint_unusable=self.book.checkpoint_unusable(self.job.uid),
        )
        a = assess(spec, self.job.uid, self.status, pods, self.nodes(), signals, self.failed, self.expected,
                   checkpoint_step=self._checkpoint_step(), retired=self.retired,
                   start_small=plan is None and self._age_seconds() >= self.settings.full_mesh_wait_seconds)
        assessed = time.monotonic()
        now = _now()
        for failure in a.failures:
            self.failed[failure.pod] = failure
            metrics.FAILURES.labels(**self._labels, reason=failure.reason.value).inc()
            if plan is not None and self.detected_at is None:
                self.detected_at = mono
        if a.failures:
            log.warning("%s/%s: failed pods: %s", self.job.namespace, self.job.name,
                        "; ".join(f"{f.pod} ({f.reason.value})" for f in a.failures))

        if a.terminal is not None:
            await self._terminate(a, spec, generation, now)
            return

        events: list[tuple[str, str, str]] = [("Warning", f.reason.value, f.message) for f in a.failures]
        last_failure = self.status.last_failure
        if a.failures:
            f = a.failures[-1]
            last_failure = FailureRecord(pod=f.pod, reason=f.reason.value, message=f.message, time=now)
        decision = a.decision
        recoveries = self.status.recoveries
        fresh = False  # a plan made in this pass
        if decision is not None and decision.outcome is Outcome.NEW_PLAN and decision.plan is not None:
            new_plan = decision.plan.model_copy(update={"created_at": now})
            if is_recovery(new_plan):
                recoveries += 1
            plan, fresh = new_plan, True
            self.waiting = False
            self.acked, self.acked_epoch = set(), new_plan.epoch
            self.push_due = {m.pod: 0.0 for m in new_plan.members}
            self.push_backoff = {}
            phase, reason = phase_of(new_plan, False, False, True)
            # (1) The commit point: the plan is in status before any pod or agent hears of it.
            await self._write_status(spec, a, plan, phase, reason, decision.message, recoveries, last_failure,
                                     generation, now, force=True)
            metrics.PLANS.labels(**self._labels, reason=new_plan.reason.value).inc()
            events.append(("Normal", Reason.PLAN_CREATED, f"epoch {new_plan.epoch}: {decision.message}"))
            for name in decision.promoted:
                if new_plan.reason is not PlanReason.INITIAL:
                    events.append(("Normal", Reason.SPARE_PROMOTED, f"spare {name} joins the mesh"))
            self._post(events)
            events = []
            log.info("%s/%s: plan epoch %d stored (%s); assess %.1f ms, status write %.1f ms",
                     self.job.namespace, self.job.name, new_plan.epoch, decision.message[:300],
                     (assessed - mono) * 1000, (time.monotonic() - assessed) * 1000)
            self._crash_point("plan-stored")
        elif decision is not None and decision.outcome is Outcome.WAIT and plan is not None:
            if not self.waiting:
                events.append(("Warning", Reason.BELOW_MIN_REPLICAS, decision.message))
            self.waiting = True

        # (2) push the plan in force to members that do not hold it yet: the trainers wait for it,
        # nothing else does, so it goes before any pod is deleted or created.
        if plan is not None:
            if self.acked_epoch != plan.epoch:
                # A restarted operator: it does not know who holds the plan; a second push is harmless.
                self.acked, self.acked_epoch = set(), plan.epoch
                self.push_due = {m.pod: 0.0 for m in plan.members}
            self._ack_from_heartbeats(plan)
            events.extend(await self._push(plan))
            if fresh:
                self._crash_point("plan-pushed")

        # (3) failed pods go; new pods come (names reserved first); labels follow the plan.
        await self._delete(a.delete)
        if a.retire:
            self.retired.update(a.retire)
            # The label first: an operator restarted before the pods are gone still knows them.
            await asyncio.gather(*(kube.patch_pod_labels(self.job.namespace, name,
                                                         builders.role_labels(wire.ROLE_RETIRED, None))
                                   for name in a.retire))
            await self._delete((name, False) for name in a.retire)
            events.append(("Normal", Reason.PODS_RETIRED, f"deleted surplus pods {', '.join(a.retire)}"))
        created = await self._create(spec, a.create_workers, a.create_spares, pods)
        if created:
            events.append(("Normal", Reason.POD_CREATED, f"created {', '.join(created)}"))
            self._crash_point("pods-created")
        if plan is not None:
            await self._sync_labels(plan, pods)

        # (4) status, then events.
        acknowledged = plan is not None and all(m.pod in self.acked for m in plan.members)
        phase, reason = phase_of(plan, acknowledged, self.waiting, bool(pods) or bool(self.expected))
        duration = self.status.last_recovery_duration_seconds
        recovered = (acknowledged and plan is not None and self.status.phase is JobPhase.RECOVERING
                     and is_recovery(plan))
        if acknowledged and plan is not None and not is_recovery(plan):
            self.detected_at = None
        if recovered and plan is not None:
            duration = self._recovery_seconds(now)
            metrics.RECOVERY_SECONDS.labels(**self._labels).observe(duration)
            self.detected_at = None
            events.append(("Normal", Reason.PLAN_ACKNOWLEDGED,
                           f"recovered: epoch {plan.epoch} held by all {len(plan.members)} members, "
                           f"{duration:.3f} s after the failure"))
        message = "" if plan is None else f"epoch {plan.epoch}, mesh {plan.mesh_label}"
        if phase is JobPhase.DEGRADED and decision is not None:
            message = decision.message
        await self._write_status(spec, a, plan, phase, reason, message, recoveries, last_failure, generation, now,
                                 duration=duration)
        self._post(events)

    # -- steps -------------------------------------------------------------------------------------

    def _recovery_seconds(self, now: datetime) -> float:
        if self.detected_at is not None:
            return max(0.0, time.monotonic() - self.detected_at)
        last = self.status.last_failure
        return max(0.0, (now - last.time).total_seconds()) if last is not None else 0.0

    def _age_seconds(self) -> float:
        """Seconds since the job was created (0 when the API server gave no timestamp)."""
        created = self.body.get("metadata", {}).get("creationTimestamp")
        if not created:
            return 0.0
        return max(0.0, (_now() - datetime.fromisoformat(created.replace("Z", "+00:00"))).total_seconds())

    def _checkpoint_step(self) -> int | None:
        """Newest complete checkpoint: from the agents, or from status after an operator restart."""
        steps = (self.book.checkpoint_step(self.job.uid), self.status.checkpoint_step)
        return max((s for s in steps if s is not None), default=None)

    def _ack_from_heartbeats(self, plan: MeshPlan) -> None:
        epochs = self.book.epochs(self.job.uid)
        for m in plan.members:
            if epochs.get(m.pod, 0) >= plan.epoch:
                self.acked.add(m.pod)

    async def _push(self, plan: MeshPlan) -> list[tuple[str, str, str]]:
        mono = time.monotonic()
        due = {m.pod for m in plan.members if m.pod not in self.acked and self.push_due.get(m.pod, 0.0) <= mono}
        if not due or self.token is None:
            return []
        start = time.monotonic()
        outcomes: list[PushOutcome] = await self.pusher.push(plan, self.token, due)
        metrics.PUSH_SECONDS.labels(**self._labels).observe(time.monotonic() - start)
        log.info("%s/%s: pushed epoch %d to %d members in %.1f ms", self.job.namespace, self.job.name, plan.epoch,
                 len(outcomes), (time.monotonic() - start) * 1000)
        failed = []
        for o in outcomes:
            if o.result.delivered:
                self.acked.add(o.pod)
                self.push_due.pop(o.pod, None)
                self.push_backoff.pop(o.pod, None)
            else:
                backoff = min(PUSH_BACKOFF_MAX, self.push_backoff.get(o.pod, 0.25) * 2)
                self.push_backoff[o.pod] = backoff
                self.push_due[o.pod] = time.monotonic() + backoff
                failed.append(o)
        events: list[tuple[str, str, str]] = []
        delivered = len(outcomes) - len(failed)
        if delivered:
            events.append(("Normal", Reason.PLAN_PUSHED,
                           f"epoch {plan.epoch} pushed to {delivered} members in {time.monotonic() - start:.3f} s"))
        if failed:
            sample = "; ".join(f"{o.pod}: {o.detail}" for o in failed[:3])
            log.info("%s/%s: push of epoch %d failed for %d members (%s)", self.job.namespace, self.job.name,
                     plan.epoch, len(failed), sample)
            if any(self.push_backoff.get(o.pod, 0) >= 4 for o in failed):
                events.append(("Warning", Reason.PLAN_PUSH_FAILED,
                               f"epoch {plan.epoch} not delivered to {len(failed)} members: {sample}"))
        return events

    async def _delete(self, doomed: Iterable[tuple[str, bool]]) -> None:
        await asyncio.gather(*(kube.delete_pod(self.job.namespace, name, force=force) for name, force in doomed))

    async def _create(self, spec: MegatronJobSpec, workers: int, spares: int, pods: list[PodFacts]) -> list[str]:
        count = workers + spares
        if count <= 0:
            return []
        floor = max([p.serial for p in pods] + [-1]) + 1
        start = await kube.reserve_serials(self.job.namespace, self.job.name, count, floor)
        bodies = [
            builders.build_pod(self.job, spec, serial=start + i,
                               role=wire.ROLE_WORKER if i < workers else wire.ROLE_SPARE,
                               operator_url=self.settings.url)
            for i in range(count)
        ]
        deadline = time.monotonic() + EXPECTED_POD_SECONDS
        for body in bodies:
            self.expected[body["metadata"]["name"]] = deadline
        await asyncio.gather(*(kube.create_pod(b) for b in bodies))
        return [b["metadata"]["name"] for b in bodies]

    async def _sync_labels(self, plan: MeshPlan, pods: list[PodFacts]) -> None:
        replica_of = {m.pod: plan.sizes.coords_of(m.ranks[0]).dp for m in plan.members}
        patches = []
        for p in pods:
            if p.deleting or p.name in self.failed or p.name in self.retired or p.role == wire.ROLE_RETIRED:
                continue
            role = wire.ROLE_WORKER if p.name in replica_of else wire.ROLE_SPARE
            replica = str(replica_of[p.name]) if p.name in replica_of else None
            if p.role != role or p.replica != replica:
                patches.append(kube.patch_pod_labels(self.job.namespace, p.name, builders.role_labels(
                    role, replica_of.get(p.name))))
        if patches:
            await asyncio.gather(*patches)

    async def _write_status(
        self,
        spec: MegatronJobSpec,
        a: Assessment,
        plan: MeshPlan | None,
        phase: JobPhase,
        reason: str,
        message: str,
        recoveries: int,
        last_failure: FailureRecord | None,
        generation: int | None,
        now: datetime,
        *,
        duration: float | None = None,
        force: bool = False,
    ) -> None:
        members = {m.pod for m in plan.members} if plan is not None else set()
        step = self.book.completed_step(self.job.uid, members)
        obs = Observation(
            phase=phase,
            reason=reason,
            message=message,
            plan=plan,
            replicas=spec.replicas,
            ready_workers=a.ready_workers,
            spares_ready=a.spares_ready,
            spares_wanted=spec.spares,
            recoveries=recoveries,
            last_recovery_duration=duration if duration is not None else self.status.last_recovery_duration_seconds,
            last_failure=last_failure,
            step=step,
            checkpoint_step=self._checkpoint_step(),
            generation=generation,
        )
        new = compute_status(self.status, obs, now)
        if not force and not status_changed(self.status, new):
            return
        await kube.write_status(self.job.namespace, self.job.name, status_body(new))
        self.status = new
        self._export(new, spec)

    def _export(self, status: MegatronJobStatus, spec: MegatronJobSpec) -> None:
        metrics.EPOCH.labels(**self._labels).set(status.epoch)
        metrics.DP.labels(**self._labels).set(status.plan.sizes.dp if status.plan else 0)
        metrics.SPARES_READY.labels(**self._labels).set(status.spares_ready)
        metrics.READY_WORKERS.labels(**self._labels).set(status.ready_workers)
        for phase in JobPhase:
            metrics.PHASE.labels(**self._labels, phase=phase.value).set(1 if phase is status.phase else 0)

    def _post(self, events: list[tuple[str, str, str]]) -> None:
        for type_, reason, message in events:
            kube.post_event(self.body, type_, reason, message)

    async def _terminate(self, a: Assessment, spec: MegatronJobSpec, generation: int | None, now: datetime) -> None:
        assert a.terminal is not None
        if self.status.phase is not a.terminal.phase:
            await self._write_status(spec, a, self.plan, a.terminal.phase, a.terminal.reason, a.terminal.message,
                                     self.status.recoveries, self.status.last_failure, generation, now, force=True)
            kind = "Warning" if a.terminal.phase is JobPhase.FAILED else "Normal"
            self._post([(kind, a.terminal.reason, a.terminal.message)])
            log.warning("%s/%s: %s (%s)", self.job.namespace, self.job.name, a.terminal.phase.value,
                        a.terminal.message)
        await self._delete(a.delete)
        if not a.delete:
            self.done = True

    async def _fail_invalid(self, exc: ValidationError) -> None:
        message = "; ".join(e["msg"] for e in exc.errors())[:2000]
        if self.status.phase is not JobPhase.FAILED:
            obs = Observation(phase=JobPhase.FAILED, reason=Reason.INVALID_SPEC, message=message, plan=None,
                              replicas=0, ready_workers=0, spares_ready=0, spares_wanted=0, recoveries=0)
            new = compute_status(self.status, obs, _now())
            await kube.write_status(self.job.namespace, self.job.name, status_body(new))
            self.status = new
            self._post([("Warning", Reason.INVALID_SPEC, message)])
        self.done = True
