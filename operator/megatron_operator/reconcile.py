"""Desired versus actual, decided purely: which pods failed, what plan, which pods to create or delete.

:func:`assess` looks at one job (its spec and status, the pods in the operator's index, node
readiness and what the agents said) and returns an :class:`Assessment`. The controller carries it
out; nothing here talks to the API server or the agents, so every rule has a fast unit test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime

from megatron_contract import wire
from megatron_contract.job import JobPhase, MegatronJobSpec, MegatronJobStatus
from megatron_contract.mesh import MeshPlan, PlanReason, StateSourceKind
from megatron_operator import optimizer_sources
from megatron_operator import suspend as suspension
from megatron_operator.failures import Failure, FailureReason, PodFacts, PodHealth, classify_pod
from megatron_operator.heartbeats import Accusation
from megatron_operator.planner import (
    Outcome,
    Placement,
    PlanDecision,
    PodRef,
    boundary_lead,
    plan_mesh,
    plan_resume,
)
from megatron_operator.status import Reason
from megatron_operator.suspend import Stage, SuspendRequest, Suspension


@dataclasses.dataclass(frozen=True)
class AgentSignals:
    """What the agents said, distilled from the heartbeat book for one job."""

    silent: Sequence[str] = ()  # pods whose heartbeats stopped past the deadline
    unhealthy: Sequence[str] = ()  # pods whose own agent reports failure
    accusations: Sequence[Accusation] = ()  # failed peers reported for the current epoch
    completed_step: int | None = None  # steps every reporting member completed (a count)
    step_seconds: float | None = None  # the fastest step the members reported lately
    finished: bool = False  # training finished (HeartbeatBook.finished)
    # Pods whose agent reported recently that its workers are warm and hold no rank: the only pods
    # a plan may bring in (None: not known, every running pod qualifies; unit tests of other rules).
    warm: Collection[str] | None = None
    # Pods whose agent reported recently, freshest first: where a plan's rendezvous store may live.
    fresh: Sequence[str] = ()
    # Pods whose agent has been quiet for more than two heartbeat intervals: an accusation of one
    # of them is corroborated.
    quiet: Collection[str] = ()
    checkpoint_unusable: str | None = None  # a worker's restore gave up: no checkpoint passed verification
    # With the distributed optimizer, by pod: the steps of the complete host copies of optimizer
    # shards it holds in the epoch in force (the planner's ``copy_steps``).
    copy_steps: Mapping[str, Collection[int]] = dataclasses.field(default_factory=dict)
    # What the members of a suspend plan in force said of its checkpoint: (its step once complete, why it failed).
    suspend_outcome: tuple[int | None, str | None] = (None, None)


@dataclasses.dataclass(frozen=True)
class Terminal:
    """The job ends: its phase, the reason and message of the condition."""

    phase: JobPhase
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Assessment:
    """What should happen to a job now.

    Attributes:
        failures: pods newly found failed (events and lastFailure are made from these).
        failed: every pod known failed (new and old); none of them trains again.
        decision: the planner's decision, None when the planner was not asked (waiting for the
            first pods, finishing, or terminal).
        create_workers: worker pods to create (only before the first plan).
        create_spares: spare pods to create (replenishing the pool, growing back).
        delete: pods to delete, with whether to skip the grace period (their kubelet is gone).
        retire: healthy pods to delete because the job has more than it needs (not failures).
        terminal: set when the job succeeds or fails now (or already has).
        ready_workers: members of the plan in force after the decision that are running.
        spares_ready: running pods outside that plan whose workers are warm.
        doubted: accusations not acted on: implausible (the reporter and the accused share no
            group of the epoch) or uncorroborated (the accused still reports, alone accused).
        partition: set when most of the job's nodes are NotReady at once: no pod is failed for
            its node's state alone, and this says so.
        moved_off: pods on draining nodes that hold no rank any more (spares, or members whose
            ranks moved and trained elsewhere): deleted, which lets a drain's eviction end.
        drain_waiting: why members on a draining node stay where they are for now (too few pods
            without them, or their state exists nowhere else); the drain waits (the job's
            PodDisruptionBudget refuses their eviction).
        suspension: set while a suspension is asked for or the job resumes from one (suspend.py);
            at its STOP and STOPPED stages ``retire`` names every pod left.
    """

    failures: tuple[Failure, ...]
    failed: frozenset[str]
    decision: PlanDecision | None
    create_workers: int = 0
    create_spares: int = 0
    delete: tuple[tuple[str, bool], ...] = ()
    retire: tuple[str, ...] = ()
    terminal: Terminal | None = None
    ready_workers: int = 0
    spares_ready: int = 0
    doubted: tuple[Accusation, ...] = ()
    partition: str | None = None
    moved_off: tuple[str, ...] = ()
    drain_waiting: str | None = None
    suspension: Suspension | None = None

    @property
    def plan(self) -> MeshPlan | None:
        """The plan in force after this assessment (new, or the previous one when unchanged)."""
        return self.decision.plan if self.decision is not None else None


def _detect(
    pods: Sequence[PodFacts],
    health: Mapping[str, tuple[PodHealth, Failure | None]],
    plan: MeshPlan | None,
    signals: AgentSignals,
    known: Mapping[str, Failure],
) -> tuple[list[Failure], list[Accusation]]:
    found: dict[str, Failure] = {}
    doubted: list[Accusation] = []

    def note(f: Failure) -> None:
        if f.pod not in known and f.pod not in found:
            found[f.pod] = f

    for pod in pods:
        failure = health[pod.name][1]
        if failure is not None:
            note(failure)
    if plan is not None:
        present = {p.name for p in pods}
        for member in plan.members:
            if member.pod not in present:
                note(Failure(member.pod, FailureReason.POD_DELETED, f"pod {member.pod} of the mesh is gone"))
        for accused, acc in _credible_accusations(plan, signals, doubted):
            note(Failure(accused, FailureReason.PEER_REPORTED, f"{acc.reporter} reports: {acc.reason}"[:1024]))
    for name in signals.silent:
        note(Failure(name, FailureReason.HEARTBEAT_MISSING, f"no heartbeat from the agent of {name}"))
    for name in signals.unhealthy:
        note(Failure(name, FailureReason.AGENT_REPORTED, f"the agent of {name} reports failure"))
    return list(found.values()), doubted


def _abandoned(plan: MeshPlan, signals: AgentSignals, failed: Collection[str]) -> bool:
    """Every member reported a failed collective (or join) in the epoch and none is to blame: the
    epoch cannot go on (each member waits for the next plan), so it is planned again."""
    members = {m.pod for m in plan.members}
    reporters = {a.reporter for a in signals.accusations if a.epoch == plan.epoch}
    return bool(members) and members <= reporters and not members & set(failed)


def _credible_accusations(
    plan: MeshPlan, signals: AgentSignals, doubted: list[Accusation]
) -> list[tuple[str, Accusation]]:
    """Accusations worth a failure: plausible and corroborated; the others go to ``doubted``.

    Any pod holding the job's token can name any other pod, so one word is not enough to delete a
    healthy peer. Plausible: reporter and accused are both members of the epoch, so they share
    its world group (every collective of the epoch runs in a subgroup of it). Corroborated: the
    accused's own agent has gone quiet, or a second member accuses it too.
    """
    members = {m.pod for m in plan.members}
    pod_of_rank = plan.pod_of_rank()
    by_accused: dict[str, list[Accusation]] = {}
    for acc in signals.accusations:
        if acc.epoch != plan.epoch:
            continue
        accused = acc.pod or (pod_of_rank.get(acc.rank) if acc.rank is not None else None)
        if accused is None or accused == acc.reporter:
            continue
        if accused not in members or acc.reporter not in members:
            doubted.append(acc)
            continue
        by_accused.setdefault(accused, []).append(acc)
    credible = []
    quiet = set(signals.quiet)
    for accused, accs in by_accused.items():
        if accused in quiet or len({a.reporter for a in accs}) >= 2:
            credible.append((accused, accs[0]))
        else:
            doubted.extend(accs)
    return credible


def assess(
    spec: MegatronJobSpec,
    job_uid: str,
    status: MegatronJobStatus,
    pods: Sequence[PodFacts],
    node_ready: Mapping[str, str],
    signals: AgentSignals,
    known_failures: Mapping[str, Failure],
    expected: Collection[str] = (),
    checkpoint_step: int | None = None,
    retired: Collection[str] = (),
    start_small: bool = False,
    settling: bool = False,
    partition_hold: bool = False,
    recently_down: Collection[str] = (),
    placement: Mapping[str, Placement] | None = None,
    draining: Collection[str] = (),
    suspend: SuspendRequest | None = None,
    now: datetime | None = None,
) -> Assessment:
    """Decide what a job needs now.

    Args:
        spec: the job's spec.
        job_uid: the job's UID.
        status: the job's current status (its plan is the plan in force).
        pods: the job's pods, from the operator's index.
        node_ready: Ready status by node name.
        signals: what the agents said.
        known_failures: pods already declared failed (by name; names are never re-used).
        expected: pods created but not yet in the index (they count towards the pool).
        checkpoint_step: newest complete checkpoint, when known.
        retired: pods this operator deleted as surplus (also known by their role label); their
            going is no failure.
        start_small: the job waited long enough for its full mesh; start with the pods that run.
        settling: the operator has only just started watching this job and some running pods
            have not reported yet: a new plan waits for them (at most a few heartbeat intervals),
            or it would shrink past spares that are warm but not heard from yet.
        partition_hold: a partition was seen a moment ago: nodes that are still NotReady while the
            others come back fail no pod for it.
        recently_down: nodes NotReady for less than a grace: they count for the partition rule
            but fail no pod yet (nodes cut off together flip one by one).
        placement: node and failure domain of the job's pods, by name, failed and gone ones
            included when known: a failed pod is replaced from another domain when possible.
        draining: nodes being drained (cordoned, or tainted NoExecute): their pods leave the job
            without a failure. A member's ranks move to a spare (or the mesh shrinks around it) with
            the state taken from its data-parallel peers (or the newest checkpoint where no peer
            holds it), in a plan of reason ``migrate``; where its state exists nowhere else, it
            stays and the drain waits.
        suspend: someone asks for the job's pods to stop with its work kept (suspend.py); while
            asked, no pod is created unless a recovery needs it, and the mesh neither grows nor moves.
        now: the time (a suspension's age is told from its plan's creation time).
    """
    now = now or datetime.now(UTC)
    retired = set(retired) | {p.name for p in pods if p.role == wire.ROLE_RETIRED}
    if retired:
        pods = [p for p in pods if p.name not in retired]
        signals = dataclasses.replace(
            signals,
            silent=[n for n in signals.silent if n not in retired],
            unhealthy=[n for n in signals.unhealthy if n not in retired],
        )
    plan = status.plan
    if status.phase in (JobPhase.SUCCEEDED, JobPhase.FAILED):
        return _wind_down(status, pods, plan, known_failures)
    resuming: Suspension | None = None
    if suspension.stopped(status) or (suspend is not None and plan is None):
        resuming = suspension.while_stopped(suspend, status, checkpoint_step)
        if resuming.stage is Stage.STOPPED:
            # Suspended: no pod, none created; one still there (a pod the stop raced) goes.
            return Assessment(
                failures=(),
                failed=frozenset(known_failures),
                decision=PlanDecision(Outcome.UNCHANGED, plan) if plan is not None else None,
                retire=tuple(p.name for p in pods if not p.deleting),
                suspension=resuming,
            )
        if plan is not None:
            return _resume(
                spec, job_uid, status, pods, node_ready, signals, known_failures, expected, checkpoint_step,
                start_small, resuming,
            )  # fmt: skip
        # Suspended before its first plan: it starts as any new job.

    settled = {n: "True" if n in recently_down else ready for n, ready in node_ready.items()}
    health = {p.name: classify_pod(p, settled) for p in pods}
    partition = _partition(pods, node_ready)
    if partition is not None or partition_hold:
        # Most nodes NotReady at once is the control plane's or the network's trouble, not the
        # GPUs' (Kubernetes itself stops evicting then): no failure from node state alone.
        for pod in pods:
            failure = health[pod.name][1]
            if failure is not None and failure.reason is FailureReason.NODE_NOT_READY:
                health[pod.name] = classify_pod(pod, {})  # as if its node were Ready
    failures, doubted = _detect(pods, health, plan, signals, known_failures)
    members = [m.pod for m in plan.members] if plan is not None else []
    # A pod on a draining node that holds no rank is going anyway: its end (a former member's
    # workers lose their peers once the mesh has moved on) is no failure.
    draining = set(draining)
    going = {p.name for p in pods if p.node in draining and p.name not in members}
    failures = [f for f in failures if f.pod not in going]
    failed = frozenset(known_failures) | {f.pod for f in failures}

    if signals.checkpoint_unusable is not None:
        # Two checkpoints failed verification (worker/checkpoint.py); a new plan would restore
        # them again and fail again: stop and say why.
        unusable = Terminal(JobPhase.FAILED, Reason.CHECKPOINT_UNUSABLE, signals.checkpoint_unusable)
        return _wind_down(
            status,
            pods,
            plan,
            {**known_failures, **{f.pod: f for f in failures}},
            terminal=unusable,
            failures=tuple(failures),
        )

    if plan is not None and (
        signals.finished or all(health.get(m, (None,))[0] is PodHealth.SUCCEEDED for m in members)
    ):
        done = Terminal(JobPhase.SUCCEEDED, Reason.TRAINING_FINISHED, f"trained {spec.training.train_iters} steps")
        return _wind_down(status, pods, plan, known_failures, terminal=done, failures=tuple(failures))

    pool = _Pool.of(pods, health, failed, signals, draining if suspend is None else ())
    verdict = _next_plan(
        spec, job_uid, status, pool, signals, failures, failed, known_failures, pods, health,
        checkpoint_step=checkpoint_step, start_small=start_small, settling=settling, placement=placement,
        suspend=suspend, resuming=resuming, now=now,
    )  # fmt: skip
    if verdict.early is not None:
        return verdict.early
    decision, suspending, resuming = verdict.decision, verdict.suspending, verdict.resuming
    if resuming is not None and decision is not None and decision.outcome is Outcome.NEW_PLAN:
        resuming = suspension.resumed(decision.message)
    changes = _pod_changes(
        spec, status, pool, pods, health, failed, {**known_failures, **{f.pod: f for f in failures}}, expected,
        decision, suspending,
    )  # fmt: skip
    in_force = decision.plan if decision is not None and decision.plan is not None else plan
    member_names = {m.pod for m in in_force.members} if in_force is not None else set()
    ready_names = {p.name for p in pool.ready}
    return Assessment(
        failures=tuple(failures),
        failed=failed,
        decision=decision,
        create_workers=changes.create_workers,
        create_spares=changes.create_spares,
        delete=changes.delete,
        retire=changes.retire,
        ready_workers=len(member_names & ready_names),
        spares_ready=len((ready_names & pool.warm) - member_names - pool.leaving),
        doubted=tuple(doubted),
        partition=partition,
        moved_off=changes.moved_off,
        drain_waiting=verdict.drain_waiting,
        suspension=suspending or resuming,
    )


@dataclasses.dataclass(frozen=True)
class _Pool:
    """The job's pods that may hold ranks, as this assessment sees them."""

    alive: list[PodFacts]  # not failed, not being deleted
    ready: list[PodFacts]  # alive and ready, oldest first
    ref: dict[str, PodRef]  # the ready ones, as the planner takes them
    warm: set[str]  # pods whose agent said recently that its workers are warm
    leaving: set[str]  # alive pods on draining nodes

    @classmethod
    def of(
        cls,
        pods: Sequence[PodFacts],
        health: Mapping[str, tuple[PodHealth, Failure | None]],
        failed: Collection[str],
        signals: AgentSignals,
        draining: Collection[str],
    ) -> _Pool:
        alive = [
            p for p in pods if p.name not in failed and not p.deleting and health[p.name][0] is not PodHealth.FAILED
        ]
        ready = sorted((p for p in alive if health[p.name][0] is PodHealth.READY), key=lambda p: p.serial)
        ref = {p.name: PodRef(p.name, p.uid, p.ip or "") for p in ready}
        warm = set(signals.warm) if signals.warm is not None else set(ref)
        return cls(alive, ready, ref, warm, {p.name for p in alive if p.node in draining})


@dataclasses.dataclass(frozen=True)
class _Verdict:
    """What the plan in force becomes: a decision, or an assessment that ends the job's turn."""

    decision: PlanDecision | None
    drain_waiting: str | None = None
    suspending: Suspension | None = None
    resuming: Suspension | None = None
    early: Assessment | None = None  # the job winds down or its pods stop: nothing else applies


def _next_plan(
    spec: MegatronJobSpec,
    job_uid: str,
    status: MegatronJobStatus,
    pool: _Pool,
    signals: AgentSignals,
    failures: list[Failure],
    failed: frozenset[str],
    known_failures: Mapping[str, Failure],
    pods: Sequence[PodFacts],
    health: Mapping[str, tuple[PodHealth, Failure | None]],
    *,
    checkpoint_step: int | None,
    start_small: bool,
    settling: bool,
    placement: Mapping[str, Placement] | None,
    suspend: SuspendRequest | None,
    resuming: Suspension | None,
    now: datetime,
) -> _Verdict:
    """The plan decision: the first plan, or what the plan in force becomes (a replacement, a
    shrink or growth, a drain's migration, a suspension), or the end of the job."""
    plan = status.plan
    members = [m.pod for m in plan.members] if plan is not None else []
    ready, ref, warm, leaving = pool.ready, pool.ref, pool.warm, pool.leaving
    if plan is None:
        # The first plan waits for the full mesh (starting small and growing at once costs a
        # re-mesh), but not forever: after the wait it takes the pods that run, if enough for
        # minReplicas, and grows as the rest arrive.
        usable = [p for p in ready if p.name in warm and p.name not in leaving]
        if len(usable) >= spec.worker_pods or (start_small and usable):
            workers = [ref[p.name] for p in usable if p.role == wire.ROLE_WORKER]
            spares = [ref[p.name] for p in usable if p.role != wire.ROLE_WORKER]
            decision = plan_mesh(
                spec,
                job_uid,
                workers,
                spares,
                failed,
                None,
                store_hosts=signals.fresh,
                in_memory_optimizer=optimizer_sources.in_memory_restore(spec),
            )
            return _Verdict(decision, resuming=resuming)
        return _Verdict(None, resuming=resuming)
    if any(health.get(m, (None,))[0] is PodHealth.SUCCEEDED for m in members):  # the others finish too
        return _Verdict(PlanDecision(Outcome.UNCHANGED, plan), resuming=resuming)
    member_set = set(members)
    active = [ref[n] for n in members if n in ref]
    spares = [ref[p.name] for p in ready if p.name not in member_set and p.name in warm]
    if suspend is not None and member_set <= {p.name for p in active} and not member_set & failed:
        spares = []  # nothing to replace: a suspension brings no spare in (the mesh does not grow)
    # Reported steps are counts of completed steps, i.e. the index of the next step: the
    # resume step itself. Reports lag, so this is a lower bound of what survivors hold;
    # trainers agree on their actual step at rendezvous (worker/verify.py).
    resume = signals.completed_step

    def plan_without(away: Collection[str], resume: int | None = resume, retry: bool = False) -> PlanDecision:
        return plan_mesh(
            spec,
            job_uid,
            [p for p in active if p.name not in away],
            [p for p in spares if p.name not in away],
            failed,
            plan,
            resume_step=resume,
            checkpoint_step=checkpoint_step,
            store_hosts=[h for h in signals.fresh if h not in away],
            previous_trained=status.committed_epoch >= plan.epoch,
            in_memory_optimizer=optimizer_sources.in_memory_restore(spec),
            copy_steps=signals.copy_steps,
            retry=retry or _abandoned(plan, signals, failed),
            placement=placement,
        )

    drain_waiting: str | None = None
    decision = plan_without(leaving)
    moving = sorted(leaving & member_set)
    if moving:
        if resume is not None and set(decision.lost) <= set(moving):
            # Nothing failed: the members switch at a step boundary ahead, which every one of
            # them (the leaving ones too) reaches and commits in the old mesh; a plan at the
            # reported step would abort the step in flight, which one may commit and another not.
            decision = plan_without(leaving, resume + boundary_lead(spec, signals.step_seconds))
        decision, drain_waiting = _migration(decision, plan_without(()), moving, set(failed))
    if suspend is None and plan.reason is PlanReason.SUSPEND and decision.outcome is Outcome.UNCHANGED:
        # The suspension was withdrawn before the pods stopped: the members (who stop at the
        # suspend plan's step) join again with the state they hold and train on.
        again = plan_without(leaving, retry=True)
        if again.outcome is Outcome.NEW_PLAN and again.plan is not None and not again.lost:
            message = f"resume: the suspension was withdrawn; mesh {again.plan.mesh_label} trains on"
            decision = dataclasses.replace(
                again, plan=again.plan.model_copy(update={"reason": PlanReason.RESUME}), message=message
            )
            resuming = suspension.resumed(message)
    if settling and decision.outcome is not Outcome.UNCHANGED:
        decision = PlanDecision(Outcome.UNCHANGED, plan, message="waiting for every running pod's first report")
        resuming = None
    suspending: Suspension | None = None
    if suspend is not None:
        suspending, decision = suspension.decide(
            suspend,
            spec,
            status,
            decision,
            outcome=signals.suspend_outcome,
            checkpoint_step=checkpoint_step,
            reported_step=resume,
            step_seconds=signals.step_seconds,
            settling=settling,
            now=now,
            replan=lambda at: plan_without((), at, retry=True),
        )
        if suspending.stage is Stage.STOP:
            stop = Assessment(
                failures=tuple(failures),
                failed=failed,
                decision=decision,
                retire=tuple(p.name for p in pods if not p.deleting and p.name not in failed),
                delete=tuple((p.name, False) for p in pods if not p.deleting and p.name in failed),
                suspension=suspending,
            )
            return _Verdict(decision, early=stop)
    # Growing and resizing are not recoveries; replacing, shrinking and waiting for capacity are.
    new_plan = decision.plan if decision.outcome is Outcome.NEW_PLAN else None
    needs_recovery = decision.outcome is Outcome.WAIT or (new_plan is not None and is_recovery(new_plan))
    terminal = _recovery_budget(spec, status, needs_recovery, new_plan, decision.message) or _state_lost(
        status, plan, new_plan
    )
    if terminal is not None:
        why = {**known_failures, **{f.pod: f for f in failures}}
        end = _wind_down(status, pods, plan, why, terminal=terminal, failures=tuple(failures))
        return _Verdict(decision, early=end)
    return _Verdict(decision, drain_waiting, suspending, resuming)


@dataclasses.dataclass(frozen=True)
class _PodChanges:
    create_workers: int
    create_spares: int
    delete: tuple[tuple[str, bool], ...]  # (pod, force)
    retire: tuple[str, ...]
    moved_off: tuple[str, ...]


def _pod_changes(
    spec: MegatronJobSpec,
    status: MegatronJobStatus,
    pool: _Pool,
    pods: Sequence[PodFacts],
    health: Mapping[str, tuple[PodHealth, Failure | None]],
    failed: frozenset[str],
    why: Mapping[str, Failure],
    expected: Collection[str],
    decision: PlanDecision | None,
    suspending: Suspension | None,
) -> _PodChanges:
    """Pods to create, delete (failed), retire (surplus) and let go (moved off draining nodes)."""
    plan = status.plan
    # Replenish: one new pod for every pod of the full mesh plus spares that is not alive (or on
    # its way). Before the first plan the missing workers are created as workers.
    target = spec.worker_pods + spec.spares
    by_name = {p.name for p in pods}
    on_the_way = [n for n in expected if n not in by_name]
    # Pods on draining nodes are going: their replacements are made now, on other nodes.
    staying = [p for p in pool.alive if p.name not in pool.leaving]
    deficit = max(0, target - len(staying) - len(on_the_way))
    create_workers = 0
    if plan is None and decision is None:
        worker_pods_alive = sum(1 for p in pool.alive if p.role == wire.ROLE_WORKER)
        create_workers = min(deficit, max(0, spec.worker_pods - worker_pods_alive))
    create_spares = deficit - create_workers
    if suspending is not None and suspending.stage not in (Stage.WAIT, Stage.REFUSED):
        create_workers = create_spares = 0  # the pods are about to go: only a recovery needs new ones

    delete = tuple(
        (p.name, _force_delete(health[p.name][1]) or _force_delete(why.get(p.name)))
        for p in pods
        if (p.name in failed or health[p.name][0] is PodHealth.FAILED) and not p.deleting
    )
    in_force = decision.plan if decision is not None and decision.plan is not None else plan
    if in_force is None:
        return _PodChanges(create_workers, create_spares, delete, (), tuple(sorted(pool.leaving)))
    member_names = {m.pod for m in in_force.members}
    # More pods than the mesh plus spares (spec.replicas or spec.spares lowered): the surplus
    # outside the plan goes, pods not yet ready first, then the newest.
    surplus = len(staying) + len(on_the_way) - target
    outside = sorted(
        (p for p in staying if p.name not in member_names),
        key=lambda p: (health[p.name][0] is PodHealth.READY, -p.serial),
    )
    retire = tuple(p.name for p in outside[: max(0, surplus)])
    # A pod on a draining node goes once it holds no rank and the plan in force has trained
    # (until then a retry may still need a former member, or a spare).
    moved_off = tuple(sorted(pool.leaving - member_names)) if status.committed_epoch >= in_force.epoch else ()
    return _PodChanges(create_workers, create_spares, delete, retire, moved_off)


def _resume(
    spec: MegatronJobSpec,
    job_uid: str,
    status: MegatronJobStatus,
    pods: Sequence[PodFacts],
    node_ready: Mapping[str, str],
    signals: AgentSignals,
    known_failures: Mapping[str, Failure],
    expected: Collection[str],
    checkpoint_step: int | None,
    start_small: bool,
    resuming: Suspension,
) -> Assessment:
    """A suspended job asked to run again: the pods of the spec's mesh are created (the plan in
    force names pods long gone: none of them is missed), and once they are warm, or after the
    full-mesh wait, a resume plan loads the checkpoint the suspension wrote."""
    plan = status.plan
    assert plan is not None
    health = {p.name: classify_pod(p, node_ready) for p in pods}
    failures, _ = _detect(pods, health, None, signals, known_failures)
    failed = frozenset(known_failures) | {f.pod for f in failures}
    alive = [p for p in pods if p.name not in failed and not p.deleting and health[p.name][0] is not PodHealth.FAILED]
    ready = sorted((p for p in alive if health[p.name][0] is PodHealth.READY), key=lambda p: p.serial)
    warm = set(signals.warm) if signals.warm is not None else {p.name for p in ready}
    usable = [PodRef(p.name, p.uid, p.ip or "") for p in ready if p.name in warm]
    decision: PlanDecision | None = None
    if len(usable) >= spec.worker_pods or (start_small and usable):
        decision = plan_resume(
            spec,
            job_uid,
            usable,
            plan,
            checkpoint_step,
            store_hosts=signals.fresh,
            in_memory_optimizer=optimizer_sources.in_memory_restore(spec),
        )
        lost = _state_lost(status, plan, decision.plan)
        if lost is not None:
            return _wind_down(status, pods, plan, known_failures, terminal=lost, failures=tuple(failures))
        if decision.outcome is Outcome.NEW_PLAN:
            resuming = suspension.resumed(decision.message)
    on_the_way = [n for n in expected if n not in {p.name for p in pods}]
    deficit = max(0, spec.worker_pods + spec.spares - len(alive) - len(on_the_way))
    workers_alive = sum(1 for p in alive if p.role == wire.ROLE_WORKER)
    create_workers = min(deficit, max(0, spec.worker_pods - workers_alive))
    return Assessment(
        failures=tuple(failures),
        failed=failed,
        decision=decision,
        create_workers=create_workers,
        create_spares=deficit - create_workers,
        delete=tuple((p.name, _force_delete(health[p.name][1])) for p in pods if p.name in failed and not p.deleting),
        suspension=resuming,
    )


def _migration(
    away: PlanDecision, staying: PlanDecision, moving: Sequence[str], failed: Collection[str]
) -> tuple[PlanDecision, str | None]:
    """Decide whether members on draining nodes move now.

    ``away`` is the planner's decision without them, ``staying`` the one with them. They move when
    every rank of the new mesh keeps its state or takes it from a data-parallel peer (no step
    redone) or, where no peer holds a shard, from the newest checkpoint (the steps since it are
    redone: a drain must end). They stay, and the drain waits, when the mesh cannot be made without
    them (below ``minReplicas``: a replacement is on its way) or when their state exists nowhere
    else. A plan that only moves pods off drained nodes is a ``migrate``, not a recovery; one that
    also replaces failed pods keeps the planner's reason.
    """
    plan = away.plan
    if away.outcome is not Outcome.NEW_PLAN or plan is None:
        return staying, f"{', '.join(moving)} stay on their draining nodes for now: {away.message}"
    if StateSourceKind.INIT in plan.source_kinds():
        why = "no spare, data-parallel peer or checkpoint can take their state"
        return staying, f"{', '.join(moving)} stay on their draining nodes for now: {why}"
    if set(away.lost) <= set(moving) and not set(away.lost) & set(failed):
        plan = plan.model_copy(update={"reason": PlanReason.MIGRATE})
        reload = " (from the newest checkpoint)" if StateSourceKind.CHECKPOINT in plan.source_kinds() else ""
        message = f"migrate: {', '.join(moving)} leave draining nodes{reload}; " + away.message.split(": ", 1)[-1]
        return dataclasses.replace(away, plan=plan, message=message), None
    return away, None


def _state_lost(status: MegatronJobStatus, plan: MeshPlan, new_plan: MeshPlan | None) -> Terminal | None:
    """The job fails rather than silently start over: a plan that would initialize fresh weights
    after steps were trained means no surviving pod holds some shard and no checkpoint exists."""
    trained = max(status.step or 0, plan.resume_step)
    if new_plan is None or trained == 0 or StateSourceKind.INIT not in new_plan.source_kinds():
        return None
    return Terminal(
        JobPhase.FAILED,
        Reason.STATE_LOST,
        f"the pods holding the state of step {trained} are gone and there is no checkpoint to reload;"
        f" starting again at step 0 would discard {trained} trained steps (set spec.checkpoint to survive this)",
    )


def recovery_open(status: MegatronJobStatus) -> bool:
    """Whether a recovery is under way: since the plan that started the last one (or the plan in
    force, when it was made because pods were lost), no plan has trained."""
    plan = status.plan
    if plan is None:
        return False
    started = max(status.recovery_epoch, plan.epoch if is_recovery(plan) else 0)
    return status.committed_epoch < started


def _recovery_budget(
    spec: MegatronJobSpec, status: MegatronJobStatus, needs_recovery: bool, new_plan: MeshPlan | None, what: str
) -> Terminal | None:
    """The job fails when a new recovery would exceed spec.maxRecoveries.

    Recoveries are counted per incident: the plans the operator makes while a recovery is still
    under way (a pod lost while the survivors were joining, a rendezvous that failed) belong to
    it and cost nothing more. So that such a cascade still ends, one incident may take at most
    :func:`max_plans_per_recovery` plans.
    """
    if not needs_recovery:
        return None
    if not recovery_open(status):
        if status.recoveries >= spec.max_recoveries:
            return Terminal(
                JobPhase.FAILED,
                Reason.MAX_RECOVERIES,
                f"{status.recoveries} recoveries done, spec.maxRecoveries is {spec.max_recoveries}; "
                f"not recovering from: {what}",
            )
        return None
    assert status.plan is not None
    plans = (new_plan.epoch if new_plan is not None else status.plan.epoch + 1) - status.committed_epoch
    limit = max_plans_per_recovery(spec)
    if plans > limit:
        return Terminal(
            JobPhase.FAILED,
            Reason.RECOVERY_NOT_CONVERGING,
            f"{plans} plans since training last ran (epoch {status.committed_epoch}), more than {limit} for one "
            f"recovery; not recovering from: {what}",
        )
    return None


def max_plans_per_recovery(spec: MegatronJobSpec) -> int:
    """Plans one recovery may take: every pod of the mesh and the pool failing once, twice over."""
    return 2 * (spec.worker_pods + spec.spares) + 4


def _partition(pods: Sequence[PodFacts], node_ready: Mapping[str, str]) -> str | None:
    """A message when more than half of the nodes holding the job's pods (two at least) are NotReady."""
    nodes = {p.node for p in pods if p.node and not p.deleting}
    down = sorted(n for n in nodes if node_ready.get(n, "True") != "True")
    if len(nodes) < 2 or 2 * len(down) <= len(nodes):
        return None
    return (
        f"{len(down)} of the job's {len(nodes)} nodes are NotReady at once ({', '.join(down[:5])}"
        f"{', ...' if len(down) > 5 else ''}): a partition or a control-plane outage, not failed GPUs; "
        "no pod is failed for its node's state until heartbeats stop or the nodes return"
    )


def _force_delete(failure: Failure | None) -> bool:
    # A pod on a dead node never confirms a graceful deletion; a hung one may never exit.
    return failure is not None and failure.reason in (FailureReason.NODE_NOT_READY, FailureReason.HEARTBEAT_MISSING)


def _wind_down(
    status: MegatronJobStatus,
    pods: Sequence[PodFacts],
    plan: MeshPlan | None,
    failed: Mapping[str, Failure],
    *,
    terminal: Terminal | None = None,
    failures: tuple[Failure, ...] = (),
) -> Assessment:
    """A finished job: a failed one releases all its pods, a succeeded one its spares."""
    phase = terminal.phase if terminal is not None else status.phase
    members = {m.pod for m in plan.members} if plan is not None else set()
    doomed = [p for p in pods if not p.deleting and (phase is JobPhase.FAILED or p.name not in members)]
    if terminal is None:
        terminal = Terminal(phase, "", "")
    return Assessment(
        failures=failures,
        failed=frozenset(failed) | {f.pod for f in failures},
        decision=PlanDecision(Outcome.UNCHANGED, plan) if plan is not None else None,
        delete=tuple((p.name, False) for p in doomed),
        terminal=terminal,
    )


def is_recovery(plan: MeshPlan) -> bool:
    """Plans made because pods were lost count as recoveries (and against spec.maxRecoveries)."""
    return plan.reason in (PlanReason.REPLACE, PlanReason.SHRINK)


def phase_of(plan: MeshPlan | None, trained: bool, waiting: bool, has_pods: bool) -> tuple[JobPhase, str]:
    """Phase of a running job and the reason of its state condition.

    Args:
        plan: the plan in force.
        trained: every member of the plan committed a training step in its epoch. Only then is
            the job Running (Ready): holding the plan is not training.
        waiting: the planner could not make a plan for lack of pods after a failure.
        has_pods: the job has pods at all.
    """
    if waiting and plan is not None:
        return JobPhase.DEGRADED, Reason.BELOW_MIN_REPLICAS
    if plan is None:
        return (JobPhase.STARTING if has_pods else JobPhase.PENDING), Reason.WAITING_FOR_PODS
    if trained:
        return JobPhase.RUNNING, Reason.TRAINING
    if plan.reason is PlanReason.INITIAL:
        return JobPhase.STARTING, Reason.WAITING_FOR_FIRST_STEP
    if plan.reason is PlanReason.GROW:
        return JobPhase.RECOVERING, Reason.GROWING
    if plan.reason is PlanReason.RESIZE:
        return JobPhase.RECOVERING, Reason.RESIZING
    if plan.reason is PlanReason.MIGRATE:
        return JobPhase.RECOVERING, Reason.MIGRATING
    if plan.reason is PlanReason.SUSPEND:
        return JobPhase.SUSPENDING, Reason.SUSPENDING
    if plan.reason is PlanReason.RESUME:
        return JobPhase.STARTING, Reason.RESUMING
    return JobPhase.RECOVERING, Reason.RECOVERING
