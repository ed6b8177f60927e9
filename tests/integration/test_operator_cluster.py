"""The operator as a real process against the real local control plane (kube-apiserver, scheduler,
controller-manager, kwok), with recording stand-ins for the trainer agents at the pods' addresses.

Scenarios:
- a job becomes worker pods and hot spares (GPU requests, restartPolicy Never, no API token,
  owner references, labels), a headless Service and a token Secret; the initial plan reaches
  every member with the job's bearer token; status and printer fields read Running;
- a killed worker: the spare is promoted in place (same mesh), a new spare is created, the plan
  with the next epoch is pushed to every member; status counts the recovery and its duration;
  events name the failure and the plan;
- container terminated, phase Failed and node NotReady are failures too; a failed spare is
  replaced; an agent reporting an older epoch gets the plan again; a silent agent (heartbeats
  stopped) is replaced, and so is a peer accused by a survivor once the accusation is corroborated
  (a lone word against a pod that still reports is logged, not acted on);
- more failures than spares: the job shrinks by whole replicas, then grows back when pods return;
  below minReplicas it waits Degraded;
- a job whose pods cannot all run starts with those that do after the operator's full-mesh wait,
  then grows when capacity arrives;
- lowering spec.replicas resizes the mesh and deletes the surplus pods (no failure, no recovery);
  raising it again creates pods and grows the mesh;
- the only replica lost: the plan restores every rank from the newest checkpoint the agents reported;
- after maxRecoveries the job fails with a clear reason and releases its pods; agents reporting
  success end the job Succeeded; deleting the job deletes its children;
- bad jobs are rejected by the API server with the rule's message.
The operator's log and the namespace's objects are printed when a test fails.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from operator_harness import Harness, JobApi, harness_for_test

from localcluster.waiting import wait_for
from megatron_contract import wire

pytestmark = pytest.mark.cluster
JOB = "train"
T = 30.0  # deadline of one wait
CHECKPOINT = {"path": "/ckpt", "intervalSteps": 10}


@pytest.fixture
def h(local_cluster: Any, namespace: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from harness_for_test(local_cluster, namespace, tmp_path, request, JOB)


def _start(h: Harness, nodes: int = 1, **spec: Any) -> dict[str, Any]:
    h.add_nodes(nodes)
    h.start_operator()
    h.submit(**spec)
    return h.wait_running(1)


def test_job_becomes_pods_spares_service_secret_and_initial_plan(h: Harness) -> None:
    status = _start(h, replicas=2, spares=1, min_replicas=1)
    pods = {p["metadata"]["name"]: p for p in h.api.pods(JOB)}
    assert len(pods) == 3
    job = h.api.job(JOB)
    roles = sorted(p["metadata"]["labels"][wire.LABEL_ROLE] for p in pods.values())
    assert roles == ["spare", "worker", "worker"]
    for pod in pods.values():
        spec = pod["spec"]
        assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        owner = pod["metadata"]["ownerReferences"][0]
        assert owner["uid"] == job["metadata"]["uid"] and owner["controller"] is True
        env = {e["name"]: e for e in spec["containers"][0]["env"]}
        assert env[wire.ENV_JOB_TOKEN]["valueFrom"]["secretKeyRef"]["name"] == f"{JOB}-token"
        assert env[wire.ENV_OPERATOR_URL]["value"].startswith("http://127.0.0.1:")
    service = h.api.get(f"/api/v1/namespaces/{h.ns}/services/{JOB}")
    assert service["spec"]["clusterIP"] == "None"
    assert h.token()
    # The initial plan reached both members, with the token; the spare got nothing.
    members = h.members(status)
    assert len(members) == 2 and status["plan"]["reason"] == "initial"
    for pod in members:
        assert h.agents.plans_for(pod) == [1]
    spare = next(n for n in pods if n not in members)
    assert h.agents.plans_for(spare, status=None) == []
    # The spare's readiness is counted by a later status write than the plan's.
    status = h.wait_status(lambda s: s.get("sparesReady") == 1, "the spare counted ready")
    assert status["mesh"] == "2x1x1" and status["ready"] == "2/2" and status["sparesReady"] == 1
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Ready"]["status"] == "True" and conds["Recovering"]["status"] == "False"
    assert conds["SparesExhausted"]["status"] == "False"


def test_killed_worker_is_replaced_by_spare_and_spare_pool_refilled(h: Harness) -> None:
    status = _start(h, replicas=2, spares=1, min_replicas=1)
    members = h.members(status)
    spare = next(n for n in h.pod_names() if n not in members)
    victim = members[0]
    victim_ranks = status["plan"]["members"][0]["ranks"]
    h.api.delete_pod(victim)
    status = h.wait_running(2)
    plan = status["plan"]
    assert plan["reason"] == "replace" and status["mesh"] == "2x1x1"
    assert set(h.members(status)) == {members[1], spare}
    new_ranks = next(m["ranks"] for m in plan["members"] if m["pod"] == spare)
    assert new_ranks == victim_ranks
    for pod in h.members(status):
        assert 2 in h.agents.plans_for(pod), f"{pod} did not get epoch 2"
    # Only the newcomers' sources travel (peers); every other rank keeps its own (the default).
    sources = {s["rank"]: s for s in plan["stateSources"]}
    assert set(sources) == set(new_ranks) and all(sources[r]["kind"] == "peer" for r in new_ranks)
    assert plan.get("defaultSource", "self") == "self"
    assert status["recoveries"] == 1 and status["lastRecoveryDurationSeconds"] >= 0
    assert status["lastFailure"]["pod"] == victim
    # A new spare replaces the one consumed.
    wait_for(lambda: len(h.api.running_pods(JOB)) == 3, T, "a new spare")
    h.wait_status(lambda s: s.get("sparesReady") == 1, "one spare ready again")
    reasons = {e["reason"] for e in h.api.events()}
    assert {"PodDeleted", "PlanCreated", "PlanPushed"} <= reasons, reasons


def test_terminated_container_failed_phase_and_failed_spare_are_replaced(h: Harness) -> None:
    status = _start(h, replicas=2, spares=2, min_replicas=1)
    members = h.members(status)
    spares = sorted(h.pod_names() - set(members))
    h.api.patch_pod_status(members[0], {"phase": "Failed", "reason": "Error"})
    status = h.wait_running(2)
    assert members[0] not in h.members(status)
    promoted = next(n for n in h.members(status) if n not in members)
    spare_left = next(s for s in spares if s != promoted)
    h.api.patch_pod_status(
        spare_left,
        {
            "containerStatuses": [
                {
                    "name": "trainer",
                    "ready": False,
                    "restartCount": 0,
                    "image": "trainer:test",
                    "imageID": "",
                    "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
                }
            ]
        },
    )
    # The failed spare is deleted and a new one takes its place; the plan does not change.
    wait_for(lambda: spare_left not in h.pod_names(), T, "failed spare deleted")
    h.wait_status(lambda s: s.get("sparesReady") == 2, "two spares ready")
    assert h.api.status(JOB)["epoch"] == 2


def test_node_not_ready_fails_its_pods(h: Harness) -> None:
    # The only replica is lost: the spare restores the checkpoint the member reported.
    h.agents.checkpoint_interval = 10
    status = _start(h, nodes=2, replicas=1, spares=1, min_replicas=1, checkpoint=CHECKPOINT)
    h.wait_status(lambda s: s.get("checkpointStep"), "a checkpoint to recover from")
    victim = h.members(status)[0]
    node = next(p["spec"]["nodeName"] for p in h.api.pods(JOB) if p["metadata"]["name"] == victim)
    h.cluster.set_node_ready(node, False)
    status = h.wait_running(2, timeout=60)
    assert victim not in h.members(status)
    assert status["lastFailure"]["reason"] == "NodeNotReady"


def test_shrink_when_spares_run_out_then_grow_back(h: Harness) -> None:
    nodes = h.add_nodes(1)
    h.start_operator()
    h.submit(replicas=3, spares=0, min_replicas=1)
    status = h.wait_running(1)
    h.cordon(nodes)  # replacement pods cannot start: the job must shrink
    victim = h.members(status)[0]
    h.api.delete_pod(victim)
    status = h.wait_running(2)
    assert status["plan"]["reason"] == "shrink" and status["plan"]["sizes"]["dp"] == 2
    assert status["plan"]["batch"]["globalBatchSize"] == 16
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "MeshShrunk"
    h.cordon(nodes, unschedulable=False)
    status = h.wait_running(3)  # the replacement pod arrives and the mesh grows back
    assert status["plan"]["reason"] == "grow" and status["plan"]["sizes"]["dp"] == 3
    for pod in h.members(status):
        assert 3 in h.agents.plans_for(pod)


def test_below_min_replicas_waits_degraded(h: Harness) -> None:
    nodes = h.add_nodes(1)
    h.start_operator()
    h.submit(replicas=2, spares=0, min_replicas=2)
    status = h.wait_running(1)
    h.cordon(nodes)
    h.api.delete_pod(h.members(status)[0])
    status = h.wait_status(lambda s: s.get("phase") == "Degraded", "phase Degraded")
    assert status["epoch"] == 1
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Degraded"]["reason"] == "BelowMinReplicas" and conds["Ready"]["status"] == "False"
    h.cordon(nodes, unschedulable=False)
    status = h.wait_running(2)
    assert status["plan"]["reason"] == "replace"


def test_agents_stale_epoch_silence_and_peer_accusation(h: Harness) -> None:
    status = _start(
        h,
        replicas=2,
        spares=2,
        min_replicas=1,
        failure_detection={"heartbeatIntervalSeconds": 0.5, "heartbeatTimeoutSeconds": 5},
    )
    op = h.operators[0]
    uid = h.api.job(JOB)["metadata"]["uid"]
    token = h.token()
    assert token
    a, b = h.members(status)
    # Bad tokens are refused.
    code, _ = h.agents.report(op.url, "wrong", uid, a, 1)
    assert code == 403
    # An agent behind (epoch 0) gets the plan again (a's own heartbeats paused meanwhile).
    h.agents.mute.add(a)
    pushes = len(h.agents.plans_for(a, status=None))
    code, body = h.agents.report(op.url, token, uid, a, 0)
    assert code == 200 and body["epoch"] == 1
    wait_for(lambda: len(h.agents.plans_for(a, status=None)) > pushes, T, "plan pushed again")
    h.agents.mute.discard(a)
    # One member's word alone does not fail a peer that still reports.
    code, _ = h.agents.report(
        op.url, token, uid, a, 1, failed_peers=[{"epoch": 1, "pod": b, "reason": "allreduce timed out"}]
    )
    assert code == 200
    wait_for(lambda: "not acted on" in op.log_text(), T, "the lone accusation logged as not acted on")
    assert h.api.status(JOB)["epoch"] == 1
    # Once the accused falls quiet the report is corroborated: the peer is replaced.
    h.agents.mute.add(b)
    code, _ = h.agents.report(
        op.url, token, uid, a, 1, failed_peers=[{"epoch": 1, "pod": b, "reason": "allreduce timed out again"}]
    )
    assert code == 200
    status = h.wait_running(2)
    assert b not in h.members(status) and status["lastFailure"]["reason"] == "PeerReportedFailure"
    # An agent that falls silent is replaced once its deadline passes.
    silent = next(p for p in h.members(status) if p != a)
    h.agents.mute.add(silent)
    status = h.wait_running(3)
    assert silent not in h.members(status) and a in h.members(status)
    assert status["lastFailure"] == {**status["lastFailure"], "pod": silent, "reason": "HeartbeatMissing"}


def test_max_recoveries_fails_the_job_and_releases_pods(h: Harness) -> None:
    h.agents.checkpoint_interval = 10
    status = _start(h, replicas=1, spares=1, min_replicas=1, max_recoveries=1, checkpoint=CHECKPOINT)
    h.wait_status(lambda s: s.get("checkpointStep"), "a checkpoint to recover from")
    h.api.delete_pod(h.members(status)[0])
    status = h.wait_running(2)
    h.api.delete_pod(h.members(status)[0])
    status = h.wait_status(lambda s: s.get("phase") == "Failed", "phase Failed")
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Failed"]["status"] == "True" and conds["Failed"]["reason"] == "MaxRecoveriesExceeded"
    assert conds["Ready"]["status"] == "False"
    wait_for(lambda: not h.pod_names(), T, "pods released")


def test_a_lost_only_replica_restores_from_the_reported_checkpoint(h: Harness) -> None:
    status = _start(h, replicas=1, spares=1, min_replicas=1, checkpoint={"path": "/ckpt", "intervalSteps": 20})
    uid = h.api.job(JOB)["metadata"]["uid"]
    token = h.token()
    assert token
    (member,) = h.members(status)
    h.agents.mute.add(member)  # it speaks for itself now
    code, _ = h.agents.report(h.operators[0].url, token, uid, member, 1, step=47, checkpoint_step=40)
    assert code == 200
    status = h.wait_status(lambda s: s.get("checkpointStep") == 40, "status.checkpointStep 40")
    h.api.delete_pod(member)
    status = h.wait_running(2)
    plan = status["plan"]
    # No data-parallel peer holds the state: everyone loads the checkpoint and resumes from it.
    assert plan["reason"] == "replace" and plan["resumeStep"] == 40
    assert (plan["defaultSource"], plan["defaultCheckpointStep"], plan["stateSources"]) == ("checkpoint", 40, [])


def test_agents_reporting_success_end_the_job(h: Harness) -> None:
    status = _start(h, replicas=2, spares=1, min_replicas=1)
    uid = h.api.job(JOB)["metadata"]["uid"]
    token = h.token()
    assert token
    h.agents.mute.update(h.members(status))
    for pod in h.members(status):
        h.agents.report(h.operators[0].url, token, uid, pod, 1, state="succeeded", step=100)
    status = h.wait_status(lambda s: s.get("phase") == "Succeeded", "phase Succeeded")
    assert status["step"] == 100
    members = set(h.members(status))
    wait_for(lambda: h.pod_names() <= members, T, "spares released")


def test_deleting_the_job_deletes_its_children(h: Harness) -> None:
    _start(h, replicas=1, spares=1, min_replicas=1)
    h.api.delete_job(JOB)
    wait_for(lambda: not h.api.pods(JOB), 60, "pods garbage-collected")
    wait_for(lambda: h.api.get(f"/api/v1/namespaces/{h.ns}/secrets/{JOB}-token") is None, 60, "secret deleted")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"replicas": 2, "minReplicas": 3}, "minReplicas must not exceed"),
        ({"replicas": 2, "tp": 2, "gpusPerPod": 1}, "multiple of spec.tp"),
        ({"replicas": 2, "spares": -1}, "spares"),
    ],
)
def test_bad_jobs_are_rejected(local_cluster: Any, namespace: str, spec: dict[str, Any], message: str) -> None:
    api = JobApi(local_cluster, namespace)
    body = {
        "apiVersion": wire.API_VERSION,
        "kind": wire.KIND,
        "metadata": {"name": "bad"},
        "spec": {"image": "trainer:test", **spec},
    }
    status, answer = api.create_job(body)
    assert status == 422, answer
    assert message in answer["message"], answer["message"]


def test_lowering_then_raising_replicas_resizes_without_a_recovery(h: Harness) -> None:
    h.add_nodes(1)
    h.start_operator()
    h.submit(replicas=3, spares=1, min_replicas=1)
    status = h.wait_running(1)
    path = f"/apis/{wire.GROUP}/{wire.VERSION}/namespaces/{h.api.ns}/{wire.PLURAL}/{JOB}"

    def set_replicas(n: int) -> None:
        code, body = h.cluster.request(
            "PATCH", path, {"spec": {"replicas": n}}, content_type="application/merge-patch+json"
        )
        assert code == 200, body

    set_replicas(1)
    status = h.wait_running(2)
    assert status["plan"]["reason"] == "resize" and status["plan"]["sizes"]["dp"] == 1
    assert status["plan"]["batch"]["globalBatchSize"] == 16
    assert status["recoveries"] == 0 and not status.get("lastFailure")
    # One worker pod and one spare remain; the surplus is deleted as such, not as a failure.
    wait_for(lambda: len(h.pod_names()) == 2, T, "the surplus pods to go")
    reasons = {e["reason"] for e in h.api.events()}
    assert "SurplusPodsDeleted" in reasons and "PodDeleted" not in reasons
    assert 2 in h.agents.plans_for(h.members(status)[0])

    set_replicas(3)
    # The mesh grows as pods become ready: at once onto the kept spare, then onto new pods.
    status = h.wait_status(lambda s: s.get("phase") == "Running" and s["plan"]["sizes"]["dp"] == 3, "dp back at 3")
    assert status["plan"]["reason"] == "grow"
    assert status["recoveries"] == 0
    wait_for(lambda: len(h.pod_names()) == 4, T, "the spare pool to be full again")


def test_a_job_that_cannot_get_all_its_pods_starts_smaller_after_the_wait_then_grows(h: Harness) -> None:
    h.add_nodes(1)  # 8 GPUs: two of the three 4-GPU pods fit
    # The wait must outlast the two fitting pods' start (kwok reports Running after a lag that grew
    # past 3 s on this 2-core machine under load: the operator then started with one pod, per design).
    h.start_operator(MEGATRON_OPERATOR_FULL_MESH_WAIT_SECONDS="10")
    h.submit(replicas=3, spares=0, min_replicas=1, tp=4, gpus_per_pod=4)
    status = h.wait_running(1)
    assert status["plan"]["sizes"]["dp"] == 2 and status["plan"]["reason"] == "initial"
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Degraded"]["status"] == "True"
    h.add_nodes(1)  # capacity arrives: the pending pod runs and the mesh grows
    status = h.wait_running(2)
    assert status["plan"]["reason"] == "grow" and status["plan"]["sizes"]["dp"] == 3
    assert status["recoveries"] == 0
