"""One controller per job: carries out what :func:`reconcile.assess` decides, in a safe order.

The order is what makes a restart safe: (1) a new plan is written to status before anything else
happens (the commit point: a restarted operator reads it back and never plans that epoch again);
(2) the plan is pushed to every member that does not hold it yet, in parallel (agents refuse an
epoch they already hold, so a second push after a restart is harmless); (3) failed pods are
deleted, pod serials are reserved on the job and new pods created (names never repeat, creates
are idempotent); (4) the status is recomputed and written once if it changed, and only then are
the events posted.

A job's controller runs as a kopf daemon: it wakes on every event of the job's pods, on node
changes (half a second later: a burst of them wakes one pass), on agent reports that matter, and at
least every few seconds to check heartbeats. A pass decides without an await, holding the event loop
(80-250 ms at 4096 pods): a plan's log line says what woke its pass and how long it waited.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from megatron_contract.agent import AgentReport
from megatron_contract.compat import validate_ignoring_unknown
from megatron_contract.job import ConditionType, FailureRecord, JobPhase, MegatronJobSpec, MegatronJobStatus
from megatron_contract.mesh import MeshPlan, PlanReason
from megatron_operator import gc_pauses, kube, metrics, optimizer_sources, queueing, skew, suspend
from megatron_operator.builders import JobRef
from megatron_operator.child_keeper import ChildKeeper
from megatron_operator.delivery import PlanDelivery
from megatron_operator.failures import Failure, PodFacts
from megatron_operator.goodput import GoodputLedger
from megatron_operator.heartbeats import HeartbeatBook
from megatron_operator.host_memory import host_memory_condition
from megatron_operator.planner import Outcome, Placement
from megatron_operator.push import PlanPusher
from megatron_operator.queueing import Gate, QueueGate, Verdict
from megatron_operator.reconcile import AgentSignals, Assessment, assess, is_recovery, phase_of, recovery_open
from megatron_operator.settings import OperatorSettings
from megatron_operator.status import (
    Observation,
    Reason,
    compute_status,
    condition,
    set_condition,
    status_body,
)
from megatron_operator.status_writer import StatusWriter
from megatron_operator.suspend import Stage, SuspendRequest
from megatron_operator.token import derive_token

log = logging.getLogger(__name__)

# Nodes cut off together (a partition, a control-plane outage) turn NotReady one by one over some
# seconds, and come back one by one: a node fails its pods only after it has been NotReady for the
# grace, and for the hold after a partition was seen node state alone fails no pod (heartbeats that
# stop still do). Kubernetes reports a node NotReady only after 40 s without its lease; 5 s more
# costs little, and most failures are seen sooner by the trainers or the pod status.
NODE_NOT_READY_GRACE_SECONDS = 5.0
PARTITION_HOLD_SECONDS = 30.0


def _now() -> datetime:
    return datetime.now(UTC)


def _waited(p: _Pass) -> str:
    """How a pass came to run, for its plan's log line: what woke it how long before it began, and
    whether a pass before it was still running then (the time a failure waited behind it)."""
    if p.woken is None:
        return "on its timer"
    waited = f"woken by {p.why} {(p.mono - p.woken) * 1000:.1f} ms before"
    if p.after is not None and p.after > p.woken:
        waited += f" (behind a pass that ran {(p.after - p.woken) * 1000:.1f} ms more)"
    return waited


def _created(body: Any) -> float:
    """The job's creation time (Unix seconds); now when the object has none (a test's bare body)."""
    stamp = (body.get("metadata") or {}).get("creationTimestamp")
    try:
        return datetime.fromisoformat(str(stamp)).timestamp() if stamp else time.time()
    except ValueError:
        return time.time()


@dataclasses.dataclass
class _EpochReports:
    """What the reports of one epoch's members said so far. Every report asks (thousands of members,
    a report each every heartbeat interval): the members' names are not gathered from the plan for
    each one, and only the last member's first step wakes the job, not every step before it."""

    epoch: int
    members: frozenset[str]
    stepped: set[str] = dataclasses.field(default_factory=set)  # reported a step of the epoch


@dataclasses.dataclass
class _Pass:
    """What one reconcile pass knows, and what it has decided so far."""

    spec: MegatronJobSpec
    generation: int | None
    mono: float  # when the pass began
    pods: list[PodFacts]
    plan: MeshPlan | None  # the plan in force: a new one once this pass made it
    now: datetime = dataclasses.field(default_factory=lambda: _now())
    woken: float | None = None  # when its wake-up call came (None: on its timer)
    why: str = "timer"  # what woke it
    after: float | None = None  # when the pass before it ended
    observed: float = 0.0  # monotonic time the agents' reports were read
    assessed: float = 0.0  # monotonic time the assessment was made
    fresh: bool = False  # the plan was made in this pass
    stale_plan: bool = False  # a resumed job's plan names pods long gone: push it to nobody
    events: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    last_failure: FailureRecord | None = None
    recoveries: int = 0
    recovery_epoch: int = 0
    members: list[str] = dataclasses.field(init=False)  # of the plan in force when the pass began

    def __post_init__(self) -> None:
        self.members = [m.pod for m in self.plan.members] if self.plan is not None else []


class _Wake(asyncio.Event):
    """The controller's wake-up call: when it first came since the last pass began, and why. A plan's
    log line says how long its pass waited, and what woke the passes since the plan before."""

    def __init__(self) -> None:
        super().__init__()
        self.since: float | None = None
        self.why = TIMER
        self._soon: asyncio.TimerHandle | None = None

    def set(self, why: str = "other") -> None:
        if self.since is None:
            self.since, self.why = time.monotonic(), why
        super().set()

    def set_soon(self, why: str, delay: float) -> None:
        """Set in ``delay`` seconds, unless already set or due: the calls of a burst wake one pass."""
        if not self.is_set() and self._soon is None:
            self._soon = asyncio.get_running_loop().call_later(delay, self._due, why)

    def _due(self, why: str) -> None:
        self._soon = None
        self.set(why)

    def clear(self) -> None:
        """The pass about to begin reads everything that happened so far: a call due later is void."""
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        self.since, self.why = None, TIMER
        super().clear()


#: What woke a pass (``_Wake.set``'s ``why``); a pass nothing woke ran on its timer.
TIMER = "timer"


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
        token_key: bytes | None = None,
        node_labels: Callable[[str], Mapping[str, str]] | None = None,
        draining: Callable[[], Collection[str]] | None = None,
        workload_of: Callable[[], Mapping[str, Any] | None] | None = None,
    ) -> None:
        self.job = job
        self.body = body  # kopf's live view of the job
        self.settings = settings
        self.book = book
        self.pusher = pusher
        self.pods_of = pods_of
        self.nodes = nodes
        self.node_labels = node_labels or (lambda _: {})
        self.draining = draining or (lambda: ())
        self.drain_waiting: str | None = None  # the last "drain waits" said, so it is said once
        # Kueue (queueing.py): the job's Workload as watched, and what it allows this pass.
        self.queue = QueueGate(job, workload_of or (lambda: None))
        self.gate: Gate | None = None
        # Where the job's pods run (node, failure domain), kept a while after a pod is gone: a failed
        # pod's replacement is taken from another domain (planner.py).
        self.node_of: dict[str, str] = {}
        self.placement: dict[str, Placement] = {}
        self.wake = _Wake()
        self._woken: float | None = None  # the wake-up call the pass under way answers
        self._pass_ended: float | None = None
        self._why = TIMER
        self.passes: collections.Counter[str] = collections.Counter()  # since the last plan, by what woke them
        self.token: str | None = None
        self.failed: dict[str, Failure] = {}
        self.waiting = False
        self.partitioned = False
        self.partition_until = 0.0  # monotonic time until which node state alone fails no pod
        self.down_since: dict[str, float] = {}  # node -> when this controller first saw it not Ready
        self.doubted: set[tuple[int, str, str | None, int | None]] = set()  # accusations already logged
        self.detected_at: float | None = None
        self.started = time.monotonic()
        self.settling = True  # until every running pod reported (or a few heartbeat intervals passed)
        # A status this version cannot trust is never written and never planned from (skew.py).
        self.status, self.hold = skew.read_status(body.get("status"))
        self._announced: skew.Hold | None = None
        self._ignored_fields: list[str] = []  # spec fields this version does not know, last announced
        self.done = False
        self._labels = metrics.job_labels(job.namespace, job.name)
        self.delivery = PlanDelivery(job, book, self._labels)
        self.writer = StatusWriter(job, book, self._labels, GoodputLedger.resume(_created(body), self.status.goodput))
        self.token_key = token_key  # the job's token is derived from it (token.py)
        self.resume_started: float | None = None  # monotonic time a suspended job was asked to resume
        self.children = ChildKeeper(job, settings, book, nodes, self._spec, lambda: self.token)
        self._heard = _EpochReports(0, frozenset())

    # -- wiring ----------------------------------------------------------------------------------

    def _spec(self, announce: bool = False) -> MegatronJobSpec:
        """The spec without the fields this version does not know (a newer client wrote them and a
        newer CRD kept them): a running job must not fail for them. ``announce``: say which, once."""
        spec, ignored = validate_ignoring_unknown(MegatronJobSpec, self.body["spec"])
        if announce and ignored and ignored != self._ignored_fields:
            text = (
                f"this operator version does not know {', '.join(ignored)} (written for a newer version): "
                "ignored, the job runs as if unset"
            )
            log.warning("%s/%s: %s", self.job.namespace, self.job.name, text)
            self._post([("Warning", Reason.SPEC_FIELDS_IGNORED, text)])
        if announce:
            self._ignored_fields = ignored
        return spec

    @property
    def plan(self) -> MeshPlan | None:
        """The plan in force."""
        return self.status.plan

    def suspend_request(self, spec: MegatronJobSpec) -> SuspendRequest | None:
        """Whether the job's pods are to stop with its work kept, and why: ``spec.suspend``, or Kueue
        not admitting the job's Workload (not yet, or not any more: an eviction)."""
        return suspend.requested(spec) or queueing.suspend_request(self.gate)

    def accept_reports(self, reports: Iterable[AgentReport]) -> int:
        """Agent reports of this job (already stored in the book): wake for anything that matters."""
        plan = self.plan
        if plan is not None and self._heard.epoch != plan.epoch:
            self._heard = _EpochReports(plan.epoch, frozenset(m.pod for m in plan.members))
        members, stepped = self._heard.members, self._heard.stepped
        for report in reports:
            metrics.REPORTS.labels(**self._labels).inc()
            if report.failed_peers or not report.healthy or report.suspend_step is not None or report.suspend_error:
                self.wake.set("report")  # a failure to act on, or a suspension's checkpoint written (or not)
            if plan is None or report.pod not in members:
                continue
            if report.epoch > plan.epoch:
                self.wake.set("report")  # the status is behind this agent: the next pass holds (skew.py)
            elif self.delivery.reported(report.pod, report.epoch, plan):
                self.wake.set("report")  # it is behind: push again now
            if report.epoch == plan.epoch and report.step is not None and self.status.committed_epoch < plan.epoch:
                stepped.add(report.pod)
                if len(stepped) >= len(members):
                    self.wake.set("report")  # every member stepped in this epoch: the job trains again
        return plan.epoch if plan is not None else 0

    # -- the loop ----------------------------------------------------------------------------------

    async def run(self, stopped: Any) -> None:
        """Reconcile until the job is deleted (``stopped``) or finished."""
        set_up = False
        failures_in_a_row = 0
        while not stopped:
            self._woken = self.wake.since
            self._why = self.wake.why
            self.passes[self._why] += 1
            self.wake.clear()
            if self.done:  # finished or invalid: nothing to do until the job is deleted
                await self._sleep(self.settings.resync_seconds)
                continue
            try:
                if await self._held():  # a status it cannot trust: hands off the job (skew.py)
                    await self._sleep(self.settings.resync_seconds)
                    continue
                if not set_up:
                    await self._setup()
                    set_up = True
                started = time.monotonic()
                try:
                    await self.reconcile_once()
                finally:
                    self._pass_ended = time.monotonic()
                metrics.RECONCILE_SECONDS.labels(**self._labels).observe(self._pass_ended - started)
                failures_in_a_row = 0
            except asyncio.CancelledError:
                raise
            except Exception:
                failures_in_a_row += 1
                log.exception(
                    "reconcile of %s/%s failed (%d in a row)", self.job.namespace, self.job.name, failures_in_a_row
                )
            await self._sleep(min(2.0**failures_in_a_row, 30.0) if failures_in_a_row else self._idle())

    def _idle(self) -> float:
        try:
            spec = self._spec()
            heartbeat = spec.failure_detection.heartbeat_timeout_seconds / 4
        except (ValidationError, KeyError):
            heartbeat = self.settings.resync_seconds
        now = time.monotonic()
        due = self.delivery.due_in(now)
        if self.settling:
            due.append(0.25)  # listening for the first reports: look again soon
        retries = self.children.retry_delays(now)
        retries += [
            t + NODE_NOT_READY_GRACE_SECONDS - now
            for t in self.down_since.values()
            if t + NODE_NOT_READY_GRACE_SECONDS > now
        ]
        return max(0.05, min([self.settings.resync_seconds, heartbeat, *due, *retries]))

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout=seconds)

    async def _setup(self) -> None:
        # Derived, never read back: the same after a restart, and the Secret can always be recreated.
        if self.token_key is not None:
            self.token = derive_token(self.token_key, self.job.uid)
        await self.children.ensure([], pods_wanted=False)
        await self._report_children()

    # -- a status the operator cannot trust (skew.py) ----------------------------------------------

    async def _held(self) -> bool:
        """Whether this pass must leave the job alone: its status cannot be read, or it is behind
        the agents. A hold ends once the status as stored now (another version, or a person, may
        have rewritten it) can be read and records the agents' epoch."""
        if self.hold is None:
            self.hold = skew.behind_agents(self._agent_epochs(), self.status.epoch)
            if self.hold is None:
                return False
        else:
            status, hold = skew.read_status(self.body.get("status"))
            hold = hold or skew.behind_agents(self._agent_epochs(), status.epoch)
            if hold is None:
                await self._resume(status)
                return False
            self.hold = hold
        await self._announce_hold(self.hold)
        return True

    def _agent_epochs(self) -> dict[str, int]:
        """The epoch held by the agent of each pod still there: from its reports within the
        heartbeat timeout, and from a push it refused."""
        live = {p.name for p in self.pods_of() if not p.deleting}
        try:
            max_age = self._spec().failure_detection.heartbeat_timeout_seconds
        except (ValidationError, KeyError):
            max_age = self.settings.resync_seconds
        fresh = set(self.book.fresh(self.job.uid, live, max_age, time.monotonic()))
        epochs = {pod: epoch for pod, epoch in self.book.epochs(self.job.uid).items() if pod in fresh}
        epochs.update(self.delivery.live_ahead(live))
        return epochs

    async def _announce_hold(self, hold: skew.Hold) -> None:
        """An error in the log and a Warning event once per reason and message; the condition
        ``ReconcilePaused=True`` written (into the conditions as stored) until it says so."""
        if hold != self._announced:
            log.error("%s/%s: not acting on the job: %s", self.job.namespace, self.job.name, hold.message)
            self._post([("Warning", hold.reason, hold.message)])
            self._announced = hold
        generation = self.body.get("metadata", {}).get("generation")
        conditions = skew.paused_conditions(self.body.get("status"), hold, _now(), generation)
        if conditions is not None:
            await kube.write_conditions(self.job.namespace, self.job.name, conditions)

    async def _resume(self, status: MegatronJobStatus) -> None:
        """Act on the job again, from its status as stored now."""
        message = f"the job's status can be read and records the agents' epoch ({status.epoch})"
        log.warning("%s/%s: acting on the job again: %s", self.job.namespace, self.job.name, message)
        paused = condition(status, ConditionType.RECONCILE_PAUSED)
        if paused is not None and paused.status == "True":
            generation = self.body.get("metadata", {}).get("generation")
            conditions = set_condition(
                status.conditions,
                ConditionType.RECONCILE_PAUSED,
                False,
                Reason.RECONCILE_RESUMED,
                message,
                _now(),
                generation,
            )
            status = status.model_copy(update={"conditions": sorted(conditions, key=lambda c: c.type)})
            await kube.write_status(self.job.namespace, self.job.name, status_body(status))
            self._post([("Normal", Reason.RECONCILE_RESUMED, message)])
        self.status = status
        self.hold = self._announced = None
        self.delivery.ahead.clear()
        self.writer.goodput = GoodputLedger.resume(_created(self.body), status.goodput)

    def _crash_point(self, name: str) -> None:
        if self.settings.crash_at == name:
            log.warning("fault injection: killing the operator at %s", name)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)

    async def reconcile_once(self) -> None:
        """One pass: observe, decide, act, write status, post events."""
        try:
            spec = self._spec(announce=True)
        except ValidationError as exc:
            await self._fail_invalid(exc)
            return
        self.pusher.prepare(spec.replicas)  # its push processes ready by the first plan (push.py)
        p = _Pass(spec, self.body.get("metadata", {}).get("generation"), time.monotonic(), self.pods_of(), self.plan)
        p.woken, p.after, p.why = self._woken, self._pass_ended, self._why
        p.last_failure, p.recoveries, p.recovery_epoch = (
            self.status.last_failure,
            self.status.recoveries,
            self.status.recovery_epoch,
        )
        signals = self._observe(p)
        p.observed = time.monotonic()
        # Reports may have come since the pass began (a restarted operator hears its first ones
        # now): a status behind the agents is caught before anything is planned from it (skew.py).
        hold = skew.behind_agents(self._agent_epochs(), self.status.epoch)
        if hold is not None:
            self.hold = hold
            await self._announce_hold(hold)
            return
        self.gate = await self.queue.gate(self.body, spec)
        await self._note_queue(self.gate, p.generation)
        a = self._assess(p, signals)
        if a.terminal is not None:
            await self._terminate(a, spec, p.generation, p.now)
            return
        if self.gate is not None and self.gate.verdict is Verdict.EVICTED:
            a = await self._yield_to_queue(a, spec, p.pods, p.now)
        if a.suspension is not None and a.suspension.stage in (Stage.STOP, Stage.STOPPED):
            await self._stop(a, spec, p.generation, p.now)
            return
        # A suspended job being resumed: the plan in force names pods long gone, told nothing.
        p.stale_plan = a.suspension is not None and a.suspension.stage is Stage.RESUME and suspend.stopped(self.status)
        p.events = [("Warning", f.reason.value, f.message) for f in a.failures]
        p.events.extend(self._note_doubts(a))
        p.events.extend(self._suspension_events(a))  # before any status write changes the condition
        if a.failures:
            f = a.failures[-1]
            p.last_failure = FailureRecord(pod=f.pod, reason=f.reason.value, message=f.message, time=p.now)
        await self._commit_plan(a, p)
        if p.plan is not None and not p.stale_plan and not await self._deliver(p):
            self._post(p.events)
            return
        await self._change_pods(a, p)
        await self._settle(a, p)
        if p.fresh:
            gc_pauses.collect_young()  # between failures, not inside the next one's pass

    def _observe(self, p: _Pass) -> AgentSignals:
        """What the agents' reports say about the pods this pass sees; whether the controller still
        waits to hear from every running pod."""
        seen = {q.name for q in p.pods}  # once: a set per item made each pass quadratic (4096 pods: 0.1-1 s)
        self.children.expected = {n: t for n, t in self.children.expected.items() if t > p.mono and n not in seen}
        watched = [q.name for q in p.pods if q.name not in self.failed]
        fd = p.spec.failure_detection
        uid, mono, plan, members = self.job.uid, p.mono, p.plan, p.members
        fresh_age = min(fd.heartbeat_timeout_seconds, max(3 * fd.heartbeat_interval_seconds, 1.0))
        signals = AgentSignals(
            silent=self.book.missing(uid, watched, fd.heartbeat_timeout_seconds, mono),
            unhealthy=self.book.self_reported_failed(uid, watched),
            accusations=self.book.accusations(uid, plan.epoch) if plan is not None else (),
            completed_step=self.book.completed_step(uid, members),
            step_seconds=self.book.step_seconds(uid, members),
            finished=self.book.finished(uid, [m for m in members if m not in self.failed], p.spec.training.train_iters),
            warm=self.book.warm(uid, watched, fresh_age, mono),
            fresh=self.book.fresh(uid, watched, fresh_age, mono),
            quiet=set(watched) - set(self.book.fresh(uid, watched, 2 * fd.heartbeat_interval_seconds, mono)),
            checkpoint_unusable=self.book.checkpoint_unusable(uid),
            # Only the distributed optimizer's shards have host copies (a dict of every pod per pass).
            copy_steps=(
                self.book.replica_steps(uid, plan.epoch)
                if plan is not None and p.spec.training.optimizer.distributed
                else {}
            ),
            suspend_outcome=(
                self.book.suspend_outcome(uid, members, plan.epoch)
                if plan is not None and plan.reason is PlanReason.SUSPEND
                else (None, None)
            ),
        )
        # A restarted operator has heard from nobody: the first heartbeat intervals, it waits for
        # the running pods' reports before planning around them.
        settling = mono - self.started < fresh_age and any(
            self.book.last(uid, q.name) is None for q in p.pods if q.phase == "Running" and not q.deleting
        )
        if self.settling and not settling:
            log.info(
                "%s/%s: heard from every running pod (or waited %.1f s): plans may change the mesh now",
                self.job.namespace,
                self.job.name,
                fresh_age,
            )
        self.settling = settling
        return signals

    def _assess(self, p: _Pass, signals: AgentSignals) -> Assessment:
        """Decide (reconcile.assess), and note the failures it found."""
        spec, mono = p.spec, p.mono
        nodes = self.nodes()
        self._place(spec, p.pods, p.members)
        request = self.suspend_request(spec)
        p.now = _now()
        resuming = request is None and suspend.stopped(self.status)
        if not resuming:
            self.resume_started = None
        elif self.resume_started is None:
            self.resume_started = mono
        wait = self.settings.full_mesh_wait_seconds
        a = assess(
            spec,
            self.job.uid,
            self.status,
            p.pods,
            nodes,
            signals,
            self.failed,
            self.children.expected,
            checkpoint_step=self._checkpoint_step(),
            retired=self.children.retired,
            start_small=(p.plan is None and self._age_seconds() >= wait)
            or (self.resume_started is not None and mono - self.resume_started >= wait),
            settling=self.settling,
            partition_hold=mono < self.partition_until,
            recently_down=self._recently_down(nodes, mono),
            placement=self.placement,
            draining=self.draining(),
            suspend=request,
            now=p.now,
        )
        if a.partition is not None:
            self.partition_until = mono + PARTITION_HOLD_SECONDS
        p.assessed = time.monotonic()
        for failure in a.failures:
            self.failed[failure.pod] = failure
            metrics.FAILURES.labels(**self._labels, reason=failure.reason.value).inc()
            if p.plan is not None and self.detected_at is None and failure.pod in p.members:
                self.detected_at = mono
                self.writer.goodput.failure_declared(time.time())
        if a.failures:
            log.warning(
                "%s/%s: failed pods: %s",
                self.job.namespace,
                self.job.name,
                "; ".join(f"{f.pod} ({f.reason.value})" for f in a.failures),
            )
        return a

    async def _commit_plan(self, a: Assessment, p: _Pass) -> None:
        """(1) The commit point: a new plan is in status before any pod or agent hears of it."""
        decision = a.decision
        if decision is not None and decision.outcome is Outcome.WAIT and p.plan is not None:
            if not self.waiting:
                p.events.append(("Warning", Reason.BELOW_MIN_REPLICAS, decision.message))
            self.waiting = True
        if decision is None or decision.outcome is not Outcome.NEW_PLAN or decision.plan is None:
            return
        new_plan = decision.plan.model_copy(update={"created_at": p.now})
        if is_recovery(new_plan) and not recovery_open(self.status):
            p.recoveries += 1  # a new incident; plans made while one is under way belong to it
            p.recovery_epoch = new_plan.epoch
        p.plan, p.fresh, p.stale_plan = new_plan, True, False
        self.waiting = False
        self.delivery.new_plan(new_plan)
        phase, reason = phase_of(new_plan, False, False, True)
        await self._write_status(
            p.spec,
            a,
            new_plan,
            phase,
            reason,
            decision.message,
            p.recoveries,
            p.last_failure,
            p.generation,
            p.now,
            force=True,
            recovery_epoch=p.recovery_epoch,
            suspended=a.suspension.condition if a.suspension is not None else None,
        )
        metrics.PLANS.labels(**self._labels, reason=new_plan.reason.value).inc()
        p.events.append(("Normal", Reason.PLAN_CREATED, f"epoch {new_plan.epoch}: {decision.message}"))
        for name in decision.promoted:
            if new_plan.reason is not PlanReason.INITIAL:
                p.events.append(("Normal", Reason.SPARE_PROMOTED, f"spare {name} joins the mesh"))
        self._post(p.events)
        p.events = []
        log.info(
            "%s/%s: plan epoch %d stored (%s); %s, reports read %.1f ms, assess %.1f ms, status write %.1f ms; "
            "passes since the plan before: %s",
            self.job.namespace,
            self.job.name,
            new_plan.epoch,
            decision.message[:300],
            _waited(p),
            (p.observed - p.mono) * 1000,
            (p.assessed - p.observed) * 1000,
            (time.monotonic() - p.assessed) * 1000,
            ", ".join(f"{why} {n}" for why, n in self.passes.most_common()),
        )
        self.passes.clear()
        self._crash_point("plan-stored")

    async def _deliver(self, p: _Pass) -> bool:
        """(2) Push the plan in force to members that do not hold it yet: the trainers wait for it,
        nothing else does, so it goes before any pod is deleted or created. False when an agent
        holds a newer epoch than the status: then no pod is touched (the next pass holds)."""
        assert p.plan is not None
        self.delivery.adopt(p.plan)
        p.events.extend(await self.delivery.push(p.plan, self.token, self.pusher))
        if p.fresh:
            self._crash_point("plan-pushed")
        return not self.delivery.ahead

    async def _change_pods(self, a: Assessment, p: _Pass) -> None:
        """(3) Failed pods go; new pods come (names reserved first); labels follow the plan."""
        await self.children.delete(a.delete)
        if a.retire:
            await self.children.retire(a.retire)
            p.events.append(("Normal", Reason.PODS_RETIRED, f"deleted surplus pods {', '.join(a.retire)}"))
        if a.moved_off:
            # Deleted by us rather than left to the drain: the budget refuses evicting a worker, and
            # a spare's replacement should not wait for the drain's next retry.
            await self.children.retire(a.moved_off)
            p.events.append(
                ("Normal", Reason.PODS_MOVED_OFF_NODES, f"deleted {', '.join(a.moved_off)}: their nodes are draining")
            )
        if a.drain_waiting != self.drain_waiting:
            self.drain_waiting = a.drain_waiting
            if a.drain_waiting is not None:
                log.warning("%s/%s: %s", self.job.namespace, self.job.name, a.drain_waiting)
                p.events.append(("Warning", Reason.DRAIN_WAITING, a.drain_waiting[:1024]))
        created = await self._create(p.spec, a.create_workers, a.create_spares, p.pods)
        if created:
            p.events.append(("Normal", Reason.POD_CREATED, f"created {', '.join(created)}"))
            self._crash_point("pods-created")
        if p.plan is not None and not p.stale_plan:
            await self.children.sync_labels(p.plan, p.pods, self.status.committed_epoch, self.failed)

    async def _settle(self, a: Assessment, p: _Pass) -> None:
        """(4) Status, then events. The job trains again when every member committed a step of the
        plan in force; that, not the plan's delivery, ends a recovery."""
        plan = p.plan
        committed_epoch = self.status.committed_epoch
        duration = self.status.last_recovery_duration_seconds
        if plan is not None and committed_epoch < plan.epoch:
            trained_at = self.book.committed(self.job.uid, [m.pod for m in plan.members], plan.epoch)
            if trained_at is not None:
                committed_epoch = plan.epoch
                if self.detected_at is not None or is_recovery(plan):
                    duration = self._recovery_seconds(p.now, trained_at)
                    self.writer.goodput.recovered(
                        time.time() - (time.monotonic() - trained_at),
                        self.writer.step_time([m.pod for m in plan.members]),
                    )
                    metrics.RECOVERY_SECONDS.labels(**self._labels).observe(duration)
                    p.events.append(
                        (
                            "Normal",
                            Reason.RECOVERED,
                            f"recovered: every one of the {len(plan.members)} members of epoch {plan.epoch} "
                            f"committed a training step, {duration:.3f} s after the failure",
                        )
                    )
                self.detected_at = None
        trained = plan is not None and committed_epoch >= plan.epoch
        phase, reason = phase_of(plan, trained, self.waiting, bool(p.pods) or bool(self.children.expected))
        message = "" if plan is None else f"epoch {plan.epoch}, mesh {plan.mesh_label}"
        if phase is JobPhase.DEGRADED and a.decision is not None:
            message = a.decision.message
        if p.stale_plan:
            phase = JobPhase.STARTING if p.pods or self.children.expected else JobPhase.PENDING
            reason, message = Reason.RESUMING, ""
        elif a.suspension is not None and a.suspension.phase is not None:
            phase = a.suspension.phase
            if a.suspension.condition is not None and a.suspension.warning:
                reason = a.suspension.condition[1]
        await self._write_status(
            p.spec,
            a,
            plan,
            phase,
            reason,
            message,
            p.recoveries,
            p.last_failure,
            p.generation,
            p.now,
            duration=duration,
            committed_epoch=committed_epoch,
            suspended=a.suspension.condition if a.suspension is not None else None,
        )
        self._post(p.events)

    async def _note_queue(self, gate: Gate | None, generation: int | None) -> None:
        """The ``QueueAdmitted`` condition of a queued job follows its Workload's verdict (written,
        and said in an event, when it changes)."""
        if gate is None:
            return
        value, reason = queueing.admitted_condition(gate)
        old = condition(self.status, ConditionType.QUEUE_ADMITTED)
        if old is not None and (old.status == "True") == value and old.reason == reason:
            return
        conditions = set_condition(
            self.status.conditions, ConditionType.QUEUE_ADMITTED, value, reason, gate.message[:2000], _now(), generation
        )
        new = self.status.model_copy(update={"conditions": sorted(conditions, key=lambda c: c.type)})
        await kube.write_status(self.job.namespace, self.job.name, status_body(new))
        self.status = new
        log.info("%s/%s: Kueue: %s (%s)", self.job.namespace, self.job.name, reason, gate.message[:300])
        if gate.verdict is not Verdict.PENDING:
            self._post([("Normal" if value else "Warning", reason, gate.message)])

    async def _yield_to_queue(
        self, a: Assessment, spec: MegatronJobSpec, pods: list[PodFacts], now: datetime
    ) -> Assessment:
        """Kueue evicted the job: its suspension (a checkpoint, then no pod) is under way. If it
        cannot write its checkpoint in time, the pods stop without it (Kueue wants the quota back);
        once none is left the quota is given back."""
        assert self.gate is not None
        limit = spec.checkpoint.suspend_timeout_seconds if spec.checkpoint is not None else 0.0
        forced = queueing.forced_stop(self.gate, a.suspension, limit, now, self._checkpoint_step())
        if forced is not None:
            live = tuple(p.name for p in pods if not p.deleting)
            log.warning("%s/%s: %s", self.job.namespace, self.job.name, forced.condition[2] if forced.condition else "")
            return dataclasses.replace(a, suspension=forced, retire=live, delete=())
        stopped = a.suspension is not None and a.suspension.stage is Stage.STOPPED
        if stopped and not pods and await self.queue.release():
            self._post(
                [("Normal", Reason.QUEUE_QUOTA_RELEASED, "the job's pods are gone: its Workload's quota is given back")]
            )
        return a

    def _suspension_events(self, a: Assessment) -> list[tuple[str, str, str]]:
        """An event when the Suspended condition is to change (its status or reason): Warning when
        the suspension could not write its checkpoint."""
        if a.suspension is None or a.suspension.condition is None:
            return []
        value, reason, message = a.suspension.condition
        old = condition(self.status, ConditionType.SUSPENDED)
        if old is not None and (old.status == "True") == value and old.reason == reason:
            return []
        return [("Warning" if a.suspension.warning else "Normal", reason, message[:1024])]

    async def _stop(self, a: Assessment, spec: MegatronJobSpec, generation: int | None, now: datetime) -> None:
        """A suspension stops the job: the status says so first (a restarted operator then deletes
        whatever pod is left instead of missing it), then every pod goes, workers and spares alike,
        labelled retired: their going is no failure."""
        assert a.suspension is not None
        events = self._suspension_events(a)
        stored = condition(self.status, ConditionType.SUSPENDED)
        if a.suspension.condition is not None:
            reason = a.suspension.condition[1]
        else:
            reason = stored.reason if stored is not None else Reason.JOB_SUSPENDED
        await self._write_status(
            spec,
            a,
            self.plan,
            JobPhase.SUSPENDED,
            reason,
            "",
            self.status.recoveries,
            self.status.last_failure,
            generation,
            now,
            suspended=a.suspension.condition,
        )
        await self.children.delete(a.delete)
        if a.retire:
            await self.children.retire(a.retire)
            events.append(("Normal", Reason.PODS_RETIRED, f"deleted {', '.join(a.retire)}: the job is suspended"))
        if events:
            log.info("%s/%s: %s", self.job.namespace, self.job.name, "; ".join(e[2] for e in events)[:500])
        self._post(events)

    def _place(self, spec: MegatronJobSpec, pods: list[PodFacts], members: list[str]) -> None:
        """Note where each pod runs; forget pods gone from both the index and the plan in force."""
        for pod in pods:
            if pod.node is not None:
                self.node_of[pod.name] = pod.node
        keep = {p.name for p in pods} | set(members)
        self.node_of = {name: node for name, node in self.node_of.items() if name in keep}
        # A node's domain is read now, not when the pod was seen: labels change (a node moved).
        key = spec.failure_domain.topology_key
        # Once per node, not per pod (an index lookup each: thousands of pods share hundreds of nodes).
        domain = {node: self.node_labels(node).get(key) if key else None for node in set(self.node_of.values())}
        self.placement = {name: Placement(node, domain[node]) for name, node in self.node_of.items()}

    def _recently_down(self, nodes: dict[str, str], mono: float) -> set[str]:
        """Nodes NotReady for less than NODE_NOT_READY_GRACE_SECONDS (as this controller saw them):
        nodes cut off together flip one by one, and the partition rule must see them together
        before the first one fails its pods."""
        for name, ready in nodes.items():
            if ready == "True":
                self.down_since.pop(name, None)
            else:
                self.down_since.setdefault(name, mono)
        return {name for name, since in self.down_since.items() if mono - since < NODE_NOT_READY_GRACE_SECONDS}

    def _note_doubts(self, a: Assessment) -> list[tuple[str, str, str]]:
        """Log, count and announce (once each) accusations not acted on, and a partition."""
        events: list[tuple[str, str, str]] = []
        for acc in a.doubted:
            key = (acc.epoch, acc.reporter, acc.pod, acc.rank)
            if key in self.doubted:
                continue
            self.doubted.add(key)
            metrics.ACCUSATIONS_IGNORED.labels(**self._labels).inc()
            accused = acc.pod or f"rank {acc.rank}"
            text = (
                f"{acc.reporter} reported {accused} failed in epoch {acc.epoch} ({acc.reason[:200]}); "
                "not acted on: not a member of the epoch, or not corroborated (its agent still reports, "
                "nobody else accuses it)"
            )
            log.warning("%s/%s: %s", self.job.namespace, self.job.name, text)
            events.append(("Warning", Reason.ACCUSATION_IGNORED, text))
        if a.partition is not None and not self.partitioned:
            log.warning("%s/%s: %s", self.job.namespace, self.job.name, a.partition)
            events.append(("Warning", Reason.NODES_PARTITIONED, a.partition))
        self.partitioned = a.partition is not None
        return events

    # -- steps -------------------------------------------------------------------------------------

    def _recovery_seconds(self, now: datetime, trained_at: float) -> float:
        """Failure detected -> the report that completed the first committed step (monotonic);
        after an operator restart the detection time is the last failure's record."""
        if self.detected_at is not None:
            return max(0.0, trained_at - self.detected_at)
        last = self.status.last_failure
        return max(0.0, (now - last.time).total_seconds() - (time.monotonic() - trained_at)) if last else 0.0

    def _age_seconds(self) -> float:
        """Seconds since the job was created (0 when the API server gave no timestamp)."""
        created = self.body.get("metadata", {}).get("creationTimestamp")
        if not created:
            return 0.0
        return max(0.0, (_now() - datetime.fromisoformat(created.replace("Z", "+00:00"))).total_seconds())

    def _buddy_copy_step(self, plan: MeshPlan | None, members: set[str]) -> int | None:
        """How far back losing one member would go at worst, by the buddy copies (status.buddyCopyStep)."""
        if plan is None or plan.optimizer_state is None or not plan.optimizer_state.buddies:
            return None
        return optimizer_sources.restore_point(self.book.replica_steps(self.job.uid, plan.epoch), members)

    def _checkpoint_step(self) -> int | None:
        """Newest complete checkpoint: from the agents, or from status after an operator restart."""
        steps = (self.book.checkpoint_step(self.job.uid), self.status.checkpoint_step)
        return max((s for s in steps if s is not None), default=None)

    async def _create(self, spec: MegatronJobSpec, workers: int, spares: int, pods: list[PodFacts]) -> list[str]:
        """Create what is missing (child_keeper.py), then say whether the job's children fail."""
        generation = self.body.get("metadata", {}).get("generation")
        created = await self.children.create(
            spec, workers, spares, pods, self.failed, generation, self.gate, first_mesh=self.plan is None
        )
        await self._report_children()
        return created

    async def _report_children(self) -> None:
        """Write the ``CreateFailed`` condition when it changes, and say why in an event."""
        change = self.children.create_failed(self.status)
        if change is None:
            return
        failing, reason, message = change
        generation = self.body.get("metadata", {}).get("generation")
        conditions = set_condition(
            self.status.conditions, ConditionType.CREATE_FAILED, failing, reason, message, _now(), generation
        )
        new = self.status.model_copy(update={"conditions": sorted(conditions, key=lambda c: c.type)})
        await kube.write_status(self.job.namespace, self.job.name, status_body(new))
        self.status = new
        if failing:
            self._post([("Warning", reason, message)])
        else:
            self._post([("Normal", Reason.CHILDREN_CREATED, "every child of the job is created again")])

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
        committed_epoch: int | None = None,
        recovery_epoch: int | None = None,
        force: bool = False,
        suspended: tuple[bool, str, str] | None = None,
    ) -> None:
        members = {m.pod for m in plan.members} if plan is not None else set()
        step = self.book.completed_step(self.job.uid, members)
        if phase is JobPhase.SUCCEEDED:  # every member trained the last step; reports may lag it
            step = spec.training.train_iters
        short = condition(self.status, ConditionType.HOST_MEMORY_SHORT)
        host_memory = host_memory_condition(spec, short, optimizer_sources.in_memory_restore(spec))
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
            committed_epoch=self.status.committed_epoch if committed_epoch is None else committed_epoch,
            recovery_epoch=self.status.recovery_epoch if recovery_epoch is None else recovery_epoch,
            last_recovery_duration=duration if duration is not None else self.status.last_recovery_duration_seconds,
            last_failure=last_failure,
            step=step,
            checkpoint_step=self._checkpoint_step(),
            buddy_copy_step=self._buddy_copy_step(plan, members),
            generation=generation,
            suspended=suspended,
            host_memory=host_memory,
        )
        self.status = await self.writer.write(self.status, obs, members, now, force)
        if host_memory is not None and host_memory[0] and (short is None or short.status != "True"):
            self._post([("Warning", host_memory[1], host_memory[2])])  # once per turn to True

    def _post(self, events: list[tuple[str, str, str]]) -> None:
        for type_, reason, message in events:
            kube.post_event(self.body, type_, reason, message)

    async def _terminate(self, a: Assessment, spec: MegatronJobSpec, generation: int | None, now: datetime) -> None:
        assert a.terminal is not None
        if self.status.phase is not a.terminal.phase:
            await self._write_status(
                spec,
                a,
                self.plan,
                a.terminal.phase,
                a.terminal.reason,
                a.terminal.message,
                self.status.recoveries,
                self.status.last_failure,
                generation,
                now,
                force=True,
            )
            kind = "Warning" if a.terminal.phase is JobPhase.FAILED else "Normal"
            self._post([(kind, a.terminal.reason, a.terminal.message)])
            log.warning("%s/%s: %s (%s)", self.job.namespace, self.job.name, a.terminal.phase.value, a.terminal.message)
        await self.children.delete(a.delete)
        if not a.delete:
            self.done = True

    async def _fail_invalid(self, exc: ValidationError) -> None:
        message = "; ".join(e["msg"] for e in exc.errors())[:2000]
        if self.status.phase is not JobPhase.FAILED:
            obs = Observation(
                phase=JobPhase.FAILED,
                reason=Reason.INVALID_SPEC,
                message=message,
                plan=None,
                replicas=0,
                ready_workers=0,
                spares_ready=0,
                spares_wanted=0,
                recoveries=0,
            )
            new = compute_status(self.status, obs, _now())
            await kube.write_status(self.job.namespace, self.job.name, status_body(new))
            self.status = new
            self._post([("Warning", Reason.INVALID_SPEC, message)])
        self.done = True
