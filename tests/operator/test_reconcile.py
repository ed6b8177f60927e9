"""Desired versus actual (``megatron_operator.reconcile.assess``), pure.

Scenarios: a new job gets its worker pods and spares created; the first plan waits for every
worker to run, or after the operator's full-mesh wait starts with those that run (never below
minReplicas); a deleted member, a silent agent, an accused peer and a self-reported failure are
failures, once each; failed pods are deleted (without grace when their node or agent is gone);
a consumed spare is replaced and pods on their way are not created twice; lowering spec.replicas
resizes the mesh, deletes the surplus pods (no failure, no recovery) and their going is not a
failure afterwards; maxRecoveries ends the job; a restore that found no usable checkpoint ends it
Failed with reason CheckpointUnusable instead of planning another restore; members that succeeded end it Succeeded and
release the spares; phases of a running job.
Liveness: only pods whose agents reported warm workers join a plan (a cold spare is not
promoted: the job shrinks); a failed-peer report is acted on only when plausible and corroborated;
most nodes NotReady at once fail no pod; plans made while a recovery is under way do not spend
the recovery budget, but a recovery that never converges ends; losing every holder of trained state
with no checkpoint fails the job (StateLost) instead of silently starting over; an epoch every
member abandoned (a join that timed out, nobody to blame) is planned again within its recovery.
Failure domains: given where the pods run, a deleted member is replaced by the spare on another node,
not by the first spare beside it.
"""

from __future__ import annotations

from operator_factories import JOB_UID, make_pod, make_spec

from megatron_contract import wire
from megatron_contract.job import JobPhase, MegatronJobStatus
from megatron_contract.mesh import PlanReason
from megatron_operator.failures import Failure, FailureReason, PodFacts
from megatron_operator.heartbeats import Accusation
from megatron_operator.planner import Outcome, Placement
from megatron_operator.reconcile import (
    AgentSignals,
    assess,
    is_recovery,
    max_plans_per_recovery,
    phase_of,
    recovery_open,
)
from megatron_operator.status import Reason

SPEC = make_spec(replicas=2, spares=1, min_replicas=1, max_recoveries=5)
NODES = {"gpu-0": "True"}


def _pods(*names: str, role: str = "worker", **kw: object) -> list[PodFacts]:
    return [
        PodFacts.of(make_pod(n, role=role, index=int(n.split("-")[1]), ip=f"127.64.0.{i + 1}", **kw))
        for i, n in enumerate(names)
    ]


def _running_job() -> tuple[MegatronJobStatus, list[PodFacts]]:
    pods = _pods("job-0", "job-1") + _pods("job-2", role="spare")
    a = assess(SPEC, JOB_UID, MegatronJobStatus(), pods, NODES, AgentSignals(), {})
    assert a.plan is not None
    return MegatronJobStatus(phase=JobPhase.RUNNING, plan=a.plan, epoch=1), pods


def test_new_job_creates_workers_and_spares() -> None:
    a = assess(SPEC, JOB_UID, MegatronJobStatus(), [], NODES, AgentSignals(), {})
    assert (a.create_workers, a.create_spares, a.decision) == (2, 1, None)
    on_the_way = assess(
        SPEC, JOB_UID, MegatronJobStatus(), [], NODES, AgentSignals(), {}, expected=["job-0", "job-1", "job-2"]
    )
    assert (on_the_way.create_workers, on_the_way.create_spares) == (0, 0)


def test_first_plan_waits_for_every_worker() -> None:
    pods = [*_pods("job-0"), PodFacts.of(make_pod("job-1", phase="Pending", ip=None, index=1))]
    a = assess(SPEC, JOB_UID, MegatronJobStatus(), pods, NODES, AgentSignals(), {})
    assert a.decision is None and a.create_spares == 1
    status, pods = _running_job()
    assert status.plan is not None and {m.pod for m in status.plan.members} == {"job-0", "job-1"}


def test_after_the_full_mesh_wait_the_job_starts_with_the_pods_that_run() -> None:
    spec = SPEC.model_copy(update={"spares": 0})
    pods = [*_pods("job-0"), PodFacts.of(make_pod("job-1", phase="Pending", ip=None, index=1))]
    waiting = assess(spec, JOB_UID, MegatronJobStatus(), pods, NODES, AgentSignals(), {})
    assert waiting.decision is None
    started = assess(spec, JOB_UID, MegatronJobStatus(), pods, NODES, AgentSignals(), {}, start_small=True)
    assert started.plan is not None and started.plan.sizes.dp == 1
    assert [m.pod for m in started.plan.members] == ["job-0"]
    # Below minReplicas it still waits.
    strict = spec.model_copy(update={"min_replicas": 2})
    held = assess(strict, JOB_UID, MegatronJobStatus(), pods, NODES, AgentSignals(), {}, start_small=True)
    assert held.plan is None and held.decision is not None and held.decision.outcome is Outcome.WAIT


def test_deleted_member_is_replaced_by_the_spare_and_a_new_spare_is_made() -> None:
    status, pods = _running_job()
    left = [p for p in pods if p.name != "job-0"]
    a = assess(SPEC, JOB_UID, status, left, NODES, AgentSignals(), {})
    assert [(f.pod, f.reason) for f in a.failures] == [("job-0", FailureReason.POD_DELETED)]
    assert a.plan is not None and a.plan.reason is PlanReason.REPLACE and a.plan.epoch == 2
    assert {m.pod for m in a.plan.members} == {"job-1", "job-2"}
    assert a.create_spares == 1 and a.create_workers == 0
    # The next pass knows the failure already: no second report, nothing planned again.
    status2 = MegatronJobStatus(phase=JobPhase.RECOVERING, plan=a.plan, epoch=2, recoveries=1)
    b = assess(SPEC, JOB_UID, status2, left, NODES, AgentSignals(), {f.pod: f for f in a.failures}, expected=["job-3"])
    assert b.failures == () and b.decision is not None and b.decision.outcome is Outcome.UNCHANGED
    assert b.create_spares == 0


def test_a_deleted_member_is_replaced_from_another_node() -> None:
    spec = SPEC.model_copy(update={"spares": 2})
    pods = _pods("job-0", "job-1") + _pods("job-2", "job-3", role="spare")
    status = MegatronJobStatus(
        phase=JobPhase.RUNNING,
        epoch=1,
        plan=assess(spec, JOB_UID, MegatronJobStatus(), pods, NODES, AgentSignals(), {}).plan,
    )
    left = [p for p in pods if p.name != "job-0"]  # gone from the index: only the operator's memory has its node
    place = {
        "job-0": Placement("gpu-0"),
        "job-1": Placement("gpu-1"),
        "job-2": Placement("gpu-0"),
        "job-3": Placement("gpu-2"),
    }
    a = assess(spec, JOB_UID, status, left, NODES, AgentSignals(), {}, placement=place)
    assert a.decision is not None and a.decision.promoted == ("job-3",)
    assert assess(spec, JOB_UID, status, left, NODES, AgentSignals(), {}).decision.promoted == ("job-2",)  # type: ignore[union-attr]


def test_agent_signals_are_failures() -> None:
    status, pods = _running_job()
    signals = AgentSignals(
        silent=["job-2"],
        unhealthy=["job-1"],
        quiet=["job-0"],
        accusations=[
            Accusation(1, "job-1", None, 0, "allreduce timed out"),
            Accusation(0, "job-1", "job-1", None, "old epoch, ignored"),
        ],
    )
    a = assess(SPEC, JOB_UID, status, pods, NODES, signals, {})
    reasons = {f.pod: f.reason for f in a.failures}
    assert reasons == {
        "job-0": FailureReason.PEER_REPORTED,
        "job-2": FailureReason.HEARTBEAT_MISSING,
        "job-1": FailureReason.AGENT_REPORTED,
    }
    assert dict(a.delete) == {"job-0": False, "job-1": False, "job-2": True}
    assert a.decision is not None and a.decision.outcome is Outcome.WAIT


def test_failed_pods_on_dead_nodes_are_deleted_without_grace() -> None:
    status, pods = _running_job()
    a = assess(SPEC, JOB_UID, status, pods, {"gpu-0": "Unknown"}, AgentSignals(), {})
    assert all(force for _, force in a.delete) and len(a.delete) == 3


def test_max_recoveries_ends_the_job() -> None:
    status, pods = _running_job()
    status = status.model_copy(update={"recoveries": 5})
    a = assess(SPEC, JOB_UID, status, pods[1:], NODES, AgentSignals(), {})
    assert a.terminal is not None and a.terminal.phase is JobPhase.FAILED
    assert a.terminal.reason == Reason.MAX_RECOVERIES and "maxRecoveries is 5" in a.terminal.message
    assert {name for name, _ in a.delete} == {"job-1", "job-2"}


def test_an_unusable_checkpoint_ends_the_job_instead_of_another_restore() -> None:
    status, pods = _running_job()
    why = "no usable checkpoint at or before step 8: step 8: no manifest; step 6: corrupted"
    a = assess(SPEC, JOB_UID, status, pods, NODES, AgentSignals(checkpoint_unusable=why), {})
    assert a.terminal is not None and a.terminal.phase is JobPhase.FAILED
    assert (a.terminal.reason, a.terminal.message) == (Reason.CHECKPOINT_UNUSABLE, why)
    assert a.decision is None or a.decision.outcome is not Outcome.NEW_PLAN


def test_success_ends_the_job_and_releases_spares() -> None:
    status, pods = _running_job()
    done = [
        PodFacts.of(make_pod(p.name, role=p.role, index=p.serial, phase="Succeeded", terminated={"exitCode": 0}))
        if p.role == "worker"
        else p
        for p in pods
    ]
    a = assess(SPEC, JOB_UID, status, done, NODES, AgentSignals(), {})
    assert a.terminal is not None and a.terminal.phase is JobPhase.SUCCEEDED
    assert [name for name, _ in a.delete] == ["job-2"]
    b = assess(SPEC, JOB_UID, status, pods, NODES, AgentSignals(finished=True), {})
    assert b.terminal is not None and b.terminal.phase is JobPhase.SUCCEEDED


def test_phase_of() -> None:
    status, _ = _running_job()
    plan = status.plan
    assert phase_of(None, False, False, False) == (JobPhase.PENDING, Reason.WAITING_FOR_PODS)
    assert phase_of(None, False, False, True)[0] is JobPhase.STARTING
    assert phase_of(plan, False, False, True) == (JobPhase.STARTING, Reason.WAITING_FOR_FIRST_STEP)
    assert phase_of(plan, True, False, True)[0] is JobPhase.RUNNING
    assert phase_of(plan, True, True, True)[0] is JobPhase.DEGRADED
    assert plan is not None
    later = plan.model_copy(update={"reason": PlanReason.REPLACE, "epoch": 2})
    assert phase_of(later, False, False, True)[0] is JobPhase.RECOVERING


def test_known_failures_are_not_reported_twice() -> None:
    status, pods = _running_job()
    known = {"job-2": Failure("job-2", FailureReason.HEARTBEAT_MISSING, "x")}
    a = assess(SPEC, JOB_UID, status, pods, NODES, AgentSignals(silent=["job-2"]), known)
    assert a.failures == () and ("job-2", True) in a.delete


def test_lowering_replicas_resizes_and_deletes_the_surplus() -> None:
    status, pods = _running_job()
    smaller = SPEC.model_copy(update={"replicas": 1})
    a = assess(smaller, JOB_UID, status, pods, NODES, AgentSignals(), {})
    assert a.plan is not None and a.plan.reason is PlanReason.RESIZE and a.plan.sizes.dp == 1
    assert not is_recovery(a.plan) and a.failures == () and a.delete == ()
    assert (a.create_workers, a.create_spares) == (0, 0)
    # 3 pods alive, 2 wanted (1 worker pod + 1 spare): one pod outside the new mesh goes.
    members = {m.pod for m in a.plan.members}
    assert len(a.retire) == 1 and a.retire[0] not in members
    # Next pass: the retired pod is being deleted; that is neither a failure nor a reason to create.
    resized = MegatronJobStatus(phase=JobPhase.RUNNING, plan=a.plan, epoch=2)
    going = [
        PodFacts.of(make_pod(p.name, role=p.role, index=p.serial, ip=p.ip, deleting=True)) if p.name in a.retire else p
        for p in pods
    ]
    b = assess(smaller, JOB_UID, resized, going, NODES, AgentSignals(silent=list(a.retire)), {}, retired=a.retire)
    assert b.failures == () and b.delete == () and b.retire == ()
    assert (b.create_workers, b.create_spares) == (0, 0)
    assert b.decision is not None and b.decision.outcome is Outcome.UNCHANGED
    # A restarted operator has no memory of it: the role label it set before deleting tells it.
    labelled = [
        PodFacts.of(make_pod(p.name, role=wire.ROLE_RETIRED, index=p.serial, ip=p.ip, deleting=True))
        if p.name in a.retire
        else p
        for p in pods
    ]
    c = assess(smaller, JOB_UID, resized, labelled, NODES, AgentSignals(), {})
    assert c.failures == () and c.delete == () and (c.create_workers, c.create_spares) == (0, 0)


def test_a_peer_report_needs_a_member_reporter_and_corroboration() -> None:
    status, pods = _running_job()
    lone = Accusation(1, "job-1", "job-0", None, "allreduce failed")
    a = assess(SPEC, JOB_UID, status, pods, NODES, AgentSignals(accusations=[lone]), {})
    assert a.failures == () and a.doubted == (lone,) and a.delete == ()
    # The spare is no member of epoch 1: it shares no group with job-0.
    outsider = Accusation(1, "job-2", "job-0", None, "says so")
    b = assess(SPEC, JOB_UID, status, pods, NODES, AgentSignals(accusations=[outsider], quiet=["job-0"]), {})
    assert b.failures == () and b.doubted == (outsider,)
    # Corroborated by the accused's own silence, or by a second member.
    c = assess(SPEC, JOB_UID, status, pods, NODES, AgentSignals(accusations=[lone], quiet=["job-0"]), {})
    assert [(f.pod, f.reason) for f in c.failures] == [("job-0", FailureReason.PEER_REPORTED)]
    three = _pods("job-0", "job-1", "job-3") + _pods("job-2", role="spare")
    spec3 = make_spec(replicas=3, spares=1, min_replicas=1)
    plan3 = assess(spec3, JOB_UID, MegatronJobStatus(), three, NODES, AgentSignals(), {}).plan
    assert plan3 is not None
    status3 = MegatronJobStatus(phase=JobPhase.RUNNING, plan=plan3, epoch=1, committed_epoch=1)
    two = [lone, Accusation(1, "job-3", "job-0", None, "allreduce failed")]
    d = assess(spec3, JOB_UID, status3, three, NODES, AgentSignals(accusations=two), {})
    assert [f.pod for f in d.failures] == ["job-0"] and d.doubted == ()


def test_most_nodes_not_ready_at_once_fail_no_pod() -> None:
    pods = [
        PodFacts.of(
            make_pod(f"job-{i}", role="worker" if i < 2 else "spare", index=i, ip=f"127.64.0.{i + 1}", node=f"gpu-{i}")
        )
        for i in range(3)
    ]
    nodes = {f"gpu-{i}": "True" for i in range(3)}
    plan = assess(SPEC, JOB_UID, MegatronJobStatus(), pods, nodes, AgentSignals(), {}).plan
    assert plan is not None
    status = MegatronJobStatus(phase=JobPhase.RUNNING, plan=plan, epoch=1, committed_epoch=1)
    partitioned = assess(
        SPEC, JOB_UID, status, pods, {**nodes, "gpu-0": "Unknown", "gpu-1": "False"}, AgentSignals(), {}
    )
    assert partitioned.failures == () and partitioned.delete == ()
    assert partitioned.partition is not None and "2 of the job's 3 nodes" in partitioned.partition
    # Heartbeats still decide: a silent pod on a NotReady node fails.
    silent = assess(
        SPEC, JOB_UID, status, pods, {**nodes, "gpu-0": "Unknown", "gpu-1": "False"}, AgentSignals(silent=["job-1"]), {}
    )
    assert [(f.pod, f.reason) for f in silent.failures] == [("job-1", FailureReason.HEARTBEAT_MISSING)]
    # One node of three is a node failure.
    one = assess(SPEC, JOB_UID, status, pods, {**nodes, "gpu-0": "Unknown"}, AgentSignals(), {})
    assert [(f.pod, f.reason) for f in one.failures] == [("job-0", FailureReason.NODE_NOT_READY)]
    assert one.partition is None
    # ... once it has been NotReady for the grace: a node that just flipped may be the first of a partition.
    just = assess(
        SPEC, JOB_UID, status, pods, {**nodes, "gpu-0": "Unknown"}, AgentSignals(), {}, recently_down={"gpu-0"}
    )
    assert just.failures == ()
    # Nodes still in their grace count for the partition rule.
    flipping = assess(
        SPEC,
        JOB_UID,
        status,
        pods,
        {**nodes, "gpu-0": "Unknown", "gpu-1": "False"},
        AgentSignals(),
        {},
        recently_down={"gpu-1"},
    )
    assert flipping.failures == () and flipping.partition is not None
    # ... unless a partition was seen a moment ago: the last node of it to come back fails nobody.
    returning = assess(
        SPEC, JOB_UID, status, pods, {**nodes, "gpu-0": "Unknown"}, AgentSignals(), {}, partition_hold=True
    )
    assert returning.failures == () and returning.partition is None


def test_only_warm_pods_join_a_plan() -> None:
    pods = _pods("job-0", "job-1") + _pods("job-2", role="spare")
    cold = assess(SPEC, JOB_UID, MegatronJobStatus(), pods, NODES, AgentSignals(warm=["job-0"]), {})
    assert cold.decision is None  # job-1 and job-2 run, but their workers are not warm yet
    either = assess(SPEC, JOB_UID, MegatronJobStatus(), pods, NODES, AgentSignals(warm=["job-0", "job-2"]), {})
    assert either.plan is not None and {m.pod for m in either.plan.members} == {"job-0", "job-2"}
    status, pods = _running_job()
    left = [p for p in pods if p.name != "job-0"]
    # The spare runs but its agent has not reported warm workers: no promotion, the mesh shrinks.
    a = assess(SPEC, JOB_UID, status, left, NODES, AgentSignals(warm=[]), {})
    assert a.plan is not None and a.plan.reason is PlanReason.SHRINK and a.spares_ready == 0
    assert {m.pod for m in a.plan.members} == {"job-1"}
    b = assess(SPEC, JOB_UID, status, left, NODES, AgentSignals(warm=["job-2"]), {})
    assert b.plan is not None and b.plan.reason is PlanReason.REPLACE and b.spares_ready == 0
    assert {m.pod for m in b.plan.members} == {"job-1", "job-2"}


def test_plans_made_while_a_recovery_is_under_way_are_one_recovery() -> None:
    status, pods = _running_job()
    trained = status.model_copy(update={"committed_epoch": 1, "recoveries": 5})
    assert not recovery_open(trained)
    left = [p for p in pods if p.name != "job-0"]
    ended = assess(SPEC, JOB_UID, trained, left, NODES, AgentSignals(), {})
    assert ended.terminal is not None and ended.terminal.reason == Reason.MAX_RECOVERIES
    # The budget was spent by this very recovery (epoch 2 has not trained): losing another pod
    # while it is under way makes another plan of the same recovery.
    budget_spent = MegatronJobStatus(
        phase=JobPhase.RUNNING, plan=_running_job()[0].plan, epoch=1, committed_epoch=1, recoveries=4
    )
    first = assess(SPEC, JOB_UID, budget_spent, left, NODES, AgentSignals(), {})
    assert first.plan is not None and first.plan.reason is PlanReason.REPLACE
    under_way = MegatronJobStatus(phase=JobPhase.RECOVERING, plan=first.plan, epoch=2, committed_epoch=1, recoveries=5)
    assert recovery_open(under_way)
    spare = _pods("job-3", role="spare")
    again = assess(
        SPEC,
        JOB_UID,
        under_way,
        [p for p in left if p.name != "job-2"] + spare,
        NODES,
        AgentSignals(),
        {"job-0": Failure("job-0", FailureReason.POD_DELETED, "")},
    )
    assert again.terminal is None and again.plan is not None and again.plan.epoch == 3
    # ... but not forever.
    cap = max_plans_per_recovery(SPEC)
    stuck = under_way.model_copy(update={"plan": first.plan.model_copy(update={"epoch": 1 + cap})})  # type: ignore[union-attr]
    never = assess(
        SPEC,
        JOB_UID,
        stuck,
        [p for p in left if p.name != "job-2"] + spare,
        NODES,
        AgentSignals(),
        {"job-0": Failure("job-0", FailureReason.POD_DELETED, "")},
    )
    assert never.terminal is not None and never.terminal.reason == Reason.RECOVERY_NOT_CONVERGING


def test_a_restarted_operator_waits_for_first_reports_before_replanning() -> None:
    status, pods = _running_job()
    left = [p for p in pods if p.name != "job-0"]
    # Nobody has reported yet, so the spare does not look warm: planning now would shrink.
    waiting = assess(SPEC, JOB_UID, status, left, NODES, AgentSignals(warm=[]), {}, settling=True)
    assert [f.pod for f in waiting.failures] == ["job-0"]  # the failure is known and its pod handled
    assert waiting.decision is not None and waiting.decision.outcome is Outcome.UNCHANGED
    assert waiting.plan is status.plan
    heard = assess(SPEC, JOB_UID, status, left, NODES, AgentSignals(warm=["job-2"]), {})
    assert heard.plan is not None and heard.plan.reason is PlanReason.REPLACE


def test_losing_every_holder_of_trained_state_fails_the_job_instead_of_starting_over() -> None:
    status, pods = _running_job()
    spare_only = [p for p in pods if p.role == "spare"]
    # Before any step was trained, a fresh start loses nothing: the spare starts the job over.
    fresh = assess(SPEC, JOB_UID, status, spare_only, NODES, AgentSignals(), {})
    assert fresh.terminal is None and fresh.plan is not None and fresh.plan.resume_step == 0
    # After 12 steps, with no checkpoint, it would discard them: the job fails and says why.
    trained = status.model_copy(update={"step": 12})
    lost = assess(SPEC, JOB_UID, trained, spare_only, NODES, AgentSignals(), {})
    assert lost.terminal is not None and lost.terminal.phase is JobPhase.FAILED
    assert lost.terminal.reason == Reason.STATE_LOST and "12 trained steps" in lost.terminal.message
    # With a checkpoint, the spare reloads it.
    reload = assess(SPEC, JOB_UID, trained, spare_only, NODES, AgentSignals(), {}, checkpoint_step=10)
    assert reload.terminal is None and reload.plan is not None and reload.plan.resume_step == 10


def test_an_epoch_every_member_abandoned_is_planned_again_within_its_recovery() -> None:
    status, pods = _running_job()
    status = status.model_copy(update={"committed_epoch": 1})
    one = AgentSignals(accusations=[Accusation(1, "job-0", None, None, "wait timeout after 15000ms")])
    assert assess(SPEC, JOB_UID, status, pods, NODES, one, {}).decision.outcome is Outcome.UNCHANGED  # type: ignore[union-attr]
    both = AgentSignals(
        accusations=[
            Accusation(1, "job-0", None, None, "wait timeout after 15000ms"),
            Accusation(1, "job-1", None, None, "wait timeout after 15000ms"),
        ]
    )
    a = assess(SPEC, JOB_UID, status, pods, NODES, both, {})
    assert a.failures == () and a.plan is not None and a.plan.epoch == 2
    assert {m.pod for m in a.plan.members} == {"job-0", "job-1"} and a.plan.reason is PlanReason.REPLACE
    assert a.decision is not None and "every member abandoned epoch 1" in a.decision.message
    # A grow made while a recovery was under way keeps it open: a retry of it is the same recovery.
    grow = a.plan.model_copy(update={"reason": PlanReason.GROW, "epoch": 3})
    within = MegatronJobStatus(
        phase=JobPhase.RECOVERING, plan=grow, epoch=3, committed_epoch=1, recovery_epoch=2, recoveries=1
    )
    assert recovery_open(within)
    assert not recovery_open(within.model_copy(update={"committed_epoch": 3}))
