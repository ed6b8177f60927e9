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
"""

from __future__ import annotations

from operator_factories import JOB_UID, make_pod, make_spec

from megatron_contract import wire
from megatron_contract.job import JobPhase, MegatronJobStatus
from megatron_contract.mesh import PlanReason
from megatron_operator.failures import Failure, FailureReason, PodFacts
from megatron_operator.heartbeats import Accusation
from megatron_operator.planner import Outcome
from megatron_operator.reconcile import AgentSignals, assess, is_recovery, phase_of
from megatron_operator.status import Reason

SPEC = make_spec(replicas=2, spares=1, min_replicas=1, max_recoveries=5)
NODES = {"gpu-0": "True"}


def _pods(*names: str, role: str = "worker", **kw: object) -> list[PodFacts]:
    return [PodFacts.of(make_pod(n, role=role, index=int(n.split("-")[1]), ip=f"127.64.0.{i + 1}", **kw))
            for i, n in enumerate(names)]


def _running_job() -> tuple[MegatronJobStatus, list[PodFacts]]:
    pods = _pods("job-0", "job-1") + _pods("job-2", role="spare")
    a = assess(SPEC, JOB_UID, MegatronJobStatus(), pods, NODES, AgentSignals(), {})
    assert a.plan is not None
    return MegatronJobStatus(phase=JobPhase.RUNNING, plan=a.plan, epoch=1), pods


def test_new_job_creates_workers_and_spares() -> None:
    a = assess(SPEC, JOB_UID, MegatronJobStatus(), [], NODES, AgentSignals(), {})
    assert (a.create_workers, a.create_spares, a.decision) == (2, 1, None)
    on_the_way = assess(SPEC, JOB_UID, MegatronJobStatus(), [], NODES, AgentSignals(), {},
                        expected=["job-0", "job-1", "job-2"])
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
    b = assess(SPEC, JOB_UID, status2, left, NODES, AgentSignals(), {f.pod: f for f in a.failures},
               expected=["job-3"])
    assert b.failures == () and b.decision is not None and b.decision.outcome is Outcome.UNCHANGED
    assert b.create_spares == 0


def test_agent_signals_are_failures() -> None:
    status, pods = _running_job()
    signals = AgentSignals(silent=["job-2"], unhealthy=["job-1"],
                           accusations=[Accusation(1, "job-1", None, 0, "allreduce timed out"),
                                        Accusation(0, "job-1", "job-1", None, "old epoch, ignored")])
    a = assess(SPEC, JOB_UID, status, pods, NODES, signals, {})
    reasons = {f.pod: f.reason for f in a.failures}
    assert reasons == {"job-0": FailureReason.PEER_REPORTED, "job-2": FailureReason.HEARTBEAT_MISSING,
                       "job-1": FailureReason.AGENT_REPORTED}
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
    done = [PodFacts.of(make_pod(p.name, role=p.role, index=p.serial, phase="Succeeded",
                                 terminated={"exitCode": 0})) if p.role == "worker" else p for p in pods]
    a = assess(SPEC, JOB_UID, status, done, NODES, AgentSignals(), {})
    assert a.terminal is not None and a.terminal.phase is JobPhase.SUCCEEDED
    assert [name for name, _ in a.delete] == ["job-2"]
    b = assess(SPEC, JOB_UID, status, pods, NODES, AgentSignals(all_succeeded=True), {})
    assert b.terminal is not None and b.terminal.phase is JobPhase.SUCCEEDED


def test_phase_of() -> None:
    status, _ = _running_job()
    plan = status.plan
    assert phase_of(None, False, False, False) == (JobPhase.PENDING, Reason.WAITING_FOR_PODS)
    assert phase_of(None, False, False, True)[0] is JobPhase.STARTING
    assert phase_of(plan, False, False, True) == (JobPhase.STARTING, Reason.PUSHING_PLAN)
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
    going = [PodFacts.of(make_pod(p.name, role=p.role, index=p.serial, ip=p.ip, deleting=True))
             if p.name in a.retire else p for p in pods]
    b = assess(smaller, JOB_UID, resized, going, NODES, AgentSignals(silent=list(a.retire)), {}, retired=a.retire)
    assert b.failures == () and b.delete == () and b.retire == ()
    assert (b.create_workers, b.create_spares) == (0, 0)
    assert b.decision is not None and b.decision.outcome is Outcome.UNCHANGED
    # A restarted operator has no memory of it: the role label it set before deleting tells it.
    labelled = [PodFacts.of(make_pod(p.name, role=wire.ROLE_RETIRED, index=p.serial, ip=p.ip, deleting=True))
                if p.name in a.retire else p for p in pods]
    c = assess(smaller, JOB_UID, resized, labelled, NODES, AgentSignals(), {})
    assert c.failures == () and c.delete == () and (c.create_workers, c.create_spares) == (0, 0)
