"""Node maintenance (``reconcile.assess`` with draining nodes, ``failures.node_draining``), pure.

Scenarios: a node counts as draining when cordoned or tainted NoExecute for maintenance, not for
the taints of a NotReady node; a member on a draining node moves to a spare with its state from a
data-parallel peer in a ``migrate`` plan (no failure, no recovery) at a step boundary ahead of
the reported step, so that no member aborts a step another commits, and its replacement is created
at once; the former member is deleted only once the new plan has trained; a spare on a draining
node is deleted at once, and a pod there that holds no rank ending is no failure; a failure in
the same pass is replaced at once, at the reported step, and a leaving member that then holds the
only copy of the state stays; with no spare the mesh shrinks around it the same way; with no peer to
take its state from (DP 1) it moves to the spare through the newest checkpoint, and with no
checkpoint either it stays and the drain waits, saying why; below minReplicas it stays until its
replacement is warm.
"""

from __future__ import annotations

from operator_factories import JOB_UID, make_pod, make_spec

from megatron_contract.job import CheckpointSpec, JobPhase, MegatronJobSpec, MegatronJobStatus
from megatron_contract.mesh import MeshPlan, PlanReason, StateSourceKind
from megatron_operator.failures import PodFacts, node_draining
from megatron_operator.planner import Outcome
from megatron_operator.reconcile import AgentSignals, Assessment, assess, is_recovery, phase_of
from megatron_operator.status import Reason

NODES = {f"gpu-{i}": "True" for i in range(4)}


def _pods(*roles: str) -> list[PodFacts]:
    """Pod job-i on node gpu-i, with the given roles."""
    return [
        PodFacts.of(make_pod(f"job-{i}", role=role, index=i, ip=f"127.64.0.{i + 1}", node=f"gpu-{i}"))
        for i, role in enumerate(roles)
    ]


def _running(
    spec_kw: dict[str, int], roles: tuple[str, ...]
) -> tuple[MegatronJobSpec, MegatronJobStatus, list[PodFacts]]:
    spec = make_spec(**spec_kw)
    pods = _pods(*roles)
    first = assess(spec, JOB_UID, MegatronJobStatus(), pods, NODES, AgentSignals(), {})
    assert first.plan is not None
    status = MegatronJobStatus(phase=JobPhase.RUNNING, plan=first.plan, epoch=1, committed_epoch=1)
    return spec, status, pods


def _drain(
    spec: MegatronJobSpec, status: MegatronJobStatus, pods: list[PodFacts], *nodes: str, step_seconds: float = 0.5
) -> Assessment:
    signals = AgentSignals(completed_step=40, step_seconds=step_seconds)
    return assess(spec, JOB_UID, status, pods, NODES, signals, {}, draining=set(nodes))


def _members(plan: MeshPlan | None) -> list[str]:
    assert plan is not None
    return [m.pod for m in plan.members]


def test_cordoned_or_maintenance_tainted_nodes_are_draining() -> None:
    assert node_draining({"spec": {"unschedulable": True}})
    assert node_draining({"spec": {"taints": [{"key": "maintenance", "effect": "NoExecute"}]}})
    assert not node_draining({"spec": {"taints": [{"key": "maintenance", "effect": "NoSchedule"}]}})
    assert not node_draining({"spec": {"taints": [{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]}})
    assert not node_draining({"spec": {}})


def test_a_member_on_a_draining_node_moves_to_a_spare_with_its_state_from_a_peer() -> None:
    spec, status, pods = _running({"replicas": 2, "spares": 1, "min_replicas": 1}, ("worker", "worker", "spare"))
    a = _drain(spec, status, pods, "gpu-1")
    assert a.decision is not None and a.decision.outcome is Outcome.NEW_PLAN
    plan = a.plan
    assert plan is not None and plan.reason is PlanReason.MIGRATE and not is_recovery(plan)
    # At a boundary ahead of the reported step 40, which no member passes before the plan reaches it:
    # two heartbeat intervals (2 s each) and a second, at 0.5 s a step, and one more step.
    assert _members(plan) == ["job-0", "job-2"] and plan.resume_step == 40 + 21
    kinds = plan.source_kinds()
    assert StateSourceKind.PEER in kinds and not {StateSourceKind.CHECKPOINT, StateSourceKind.INIT} & kinds
    assert a.failures == () and a.terminal is None and a.drain_waiting is None
    assert a.create_spares == 1  # the leaving pod's replacement, on another node
    assert a.moved_off == ()  # it goes once the new plan has trained
    assert phase_of(plan, trained=False, waiting=False, has_pods=True) == (JobPhase.RECOVERING, Reason.MIGRATING)

    moved = MegatronJobStatus(phase=JobPhase.RECOVERING, plan=plan, epoch=2, committed_epoch=1)
    assert _drain(spec, moved, pods, "gpu-1").moved_off == ()
    trained = moved.model_copy(update={"committed_epoch": 2})
    after = _drain(spec, trained, pods, "gpu-1")
    assert after.moved_off == ("job-1",) and after.decision is not None
    assert after.decision.outcome is Outcome.UNCHANGED and after.failures == ()
    # Its workers lose their peers once the mesh moved on, and its agent says so: no failure.
    signals = AgentSignals(completed_step=52, unhealthy=["job-1"])
    ended = assess(spec, JOB_UID, trained, pods, NODES, signals, {}, draining={"gpu-1"})
    assert ended.failures == () and ended.moved_off == ("job-1",)


def test_a_spare_on_a_draining_node_is_deleted_at_once_and_replaced() -> None:
    spec, status, pods = _running({"replicas": 2, "spares": 1, "min_replicas": 1}, ("worker", "worker", "spare"))
    a = _drain(spec, status, pods, "gpu-2")
    assert a.decision is not None and a.decision.outcome is Outcome.UNCHANGED
    assert a.moved_off == ("job-2",) and a.create_spares == 1 and a.spares_ready == 0


def test_with_no_spare_the_mesh_shrinks_around_the_leaving_member() -> None:
    spec, status, pods = _running({"replicas": 2, "spares": 0, "min_replicas": 1}, ("worker", "worker"))
    a = _drain(spec, status, pods, "gpu-0")
    assert a.plan is not None and a.plan.reason is PlanReason.MIGRATE and a.plan.sizes.dp == 1
    assert _members(a.plan) == ["job-1"] and a.create_spares == 1


def test_with_no_peer_the_member_moves_through_the_checkpoint_or_with_none_stays() -> None:
    spec, status, pods = _running({"replicas": 1, "spares": 1, "min_replicas": 1}, ("worker", "spare"))
    a = _drain(spec, status, pods, "gpu-0")
    assert a.decision is not None and a.decision.outcome is Outcome.UNCHANGED
    assert _members(a.plan) == ["job-0"] and a.moved_off == ()
    assert a.drain_waiting is not None and "job-0 stay" in a.drain_waiting and "checkpoint" in a.drain_waiting

    spec = spec.model_copy(update={"checkpoint": CheckpointSpec(path="/ckpt", interval_steps=10)})
    moved = assess(
        spec, JOB_UID, status, pods, NODES, AgentSignals(completed_step=40), {}, checkpoint_step=30, draining={"gpu-0"}
    )
    plan = moved.plan
    assert plan is not None and plan.reason is PlanReason.MIGRATE and _members(plan) == ["job-1"]
    assert plan.source_kinds() == {StateSourceKind.CHECKPOINT} and moved.drain_waiting is None


def test_below_min_replicas_the_member_stays_until_its_replacement_is_warm() -> None:
    spec, status, pods = _running({"replicas": 2, "spares": 0, "min_replicas": 2}, ("worker", "worker"))
    a = _drain(spec, status, pods, "gpu-1")
    assert a.decision is not None and a.decision.outcome is Outcome.UNCHANGED and a.create_spares == 1
    assert a.drain_waiting is not None and "job-1 stay" in a.drain_waiting
    arrived = [*pods, *_pods("worker", "worker", "spare")[2:]]  # job-2, a warm spare on gpu-2
    moved = _drain(spec, status, arrived, "gpu-1")
    assert moved.plan is not None and moved.plan.reason is PlanReason.MIGRATE
    assert _members(moved.plan) == ["job-0", "job-2"] and moved.drain_waiting is None


def test_a_failure_while_a_member_leaves_is_replaced_first_and_the_last_holder_stays() -> None:
    roles = ("worker", "worker", "spare", "spare")
    spec, status, pods = _running({"replicas": 2, "spares": 2, "min_replicas": 1}, roles)
    gone = [p for p in pods if p.name != "job-0"]  # job-0 deleted while job-1's node drains
    a = _drain(spec, status, gone, "gpu-1")
    assert a.plan is not None and a.plan.reason is PlanReason.REPLACE and is_recovery(a.plan)
    assert a.plan.resume_step == 40 and _members(a.plan) == ["job-2", "job-1"]
    assert a.drain_waiting is not None and "job-1 stay" in a.drain_waiting
