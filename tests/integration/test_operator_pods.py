"""Production pods: the operator as a real process against the real local control plane (kwok nodes,
recording stand-ins for the agents), with ``spec.template``, ``spec.failureDomain`` and the job's
PodDisruptionBudget.

Scenarios:
- a job with a pod template (an extra volume and its mount, an env variable, a sidecar, an init
  container, a label and an annotation) gets pods that carry all of it next to what the operator
  owns (its env first, GPUs, /dev/shm in memory, secure defaults, restartPolicy Never, no token);
  the pods run, and a killed worker is replaced by the spare, which carries the template too;
- the production example's pods (worker and spare), built by the operator, pass the API server's
  pod validation (a server-side dry run);
- the job's PodDisruptionBudget (owned by the job) lets the eviction API take a spare but no worker
  (429, naming the budget), and comes back at once when deleted;
- failure domains: the job's pods land on different nodes (spread over kubernetes.io/hostname), and
  a killed worker is replaced by the spare outside its rack (the job's topology label), not by the
  spare the planner would take first without domains.
The operator's log and the namespace's objects are printed when a test fails.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from operator_harness import Harness, harness_for_test

from localcluster.waiting import wait_for
from megatron_contract import MegatronJob, wire
from megatron_operator import builders
from megatronjob_builders import PRODUCTION_EXAMPLE, example_job

pytestmark = pytest.mark.cluster
JOB = "prod"
T = 30.0  # deadline of one wait
RACK = "example.com/rack"

TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "llm"}, "annotations": {"example.com/owner": "pretraining"}},
    "spec": {
        "terminationGracePeriodSeconds": 5,
        "volumes": [{"name": "scratch", "emptyDir": {}}],
        "initContainers": [{"name": "fetch", "image": "busybox:1.36", "command": ["true"]}],
        "containers": [
            {"name": "log-shipper", "image": "fluent-bit:3", "args": ["--quiet"]},
            {
                "name": "trainer",
                "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
                "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
            },
        ],
    },
}


@pytest.fixture
def h(local_cluster: Any, namespace: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from harness_for_test(local_cluster, namespace, tmp_path, request, JOB)


def _check_pod(pod: dict[str, Any]) -> None:
    meta, spec = pod["metadata"], pod["spec"]
    name = meta["name"]
    assert meta["labels"]["team"] == "llm" and meta["labels"][wire.LABEL_JOB] == JOB, name
    assert meta["annotations"]["example.com/owner"] == "pretraining", name
    assert [c["name"] for c in spec["containers"]] == ["trainer", "log-shipper"], name
    assert [c["name"] for c in spec["initContainers"]] == ["fetch"], name
    trainer = spec["containers"][0]
    env = [e["name"] for e in trainer["env"]]
    assert env[0] == wire.ENV_JOB_NAME and env[-1] == "NCCL_DEBUG", name
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "1", name
    mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
    assert mounts == {"/scratch": "scratch", "/dev/shm": "megatron-shm"}, name
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["megatron-shm"]["emptyDir"] == {"medium": "Memory"} and "scratch" in volumes, name
    assert spec["securityContext"]["runAsNonRoot"] is True, name
    assert trainer["securityContext"]["allowPrivilegeEscalation"] is False, name
    assert trainer["securityContext"]["capabilities"]["drop"] == ["ALL"], name
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False, name


def test_template_reaches_every_pod_and_the_job_recovers(h: Harness) -> None:
    h.add_nodes(2)
    h.start_operator()
    h.submit(replicas=2, spares=1, min_replicas=1, template=TEMPLATE)
    status = h.wait_running(1)
    pods = h.api.pods(JOB)
    assert len(pods) == 3
    for pod in pods:
        _check_pod(pod)
    members = h.members(status)
    spare = next(n for n in h.pod_names() if n not in members)
    h.api.delete_pod(members[0])
    status = h.wait_running(2)
    assert status["plan"]["reason"] == "replace" and set(h.members(status)) == {members[1], spare}
    wait_for(lambda: len(h.api.running_pods(JOB)) == 3, T, "a new spare")
    for pod in h.api.running_pods(JOB):
        _check_pod(pod)


def test_the_replacement_comes_from_another_rack(h: Harness) -> None:
    nodes = h.add_nodes(4)
    # Nodes without the label of a spread constraint are left out of the scheduler's spreading.
    for node, rack in zip(nodes, ("rack-a", "rack-a", "rack-b", "rack-b"), strict=True):
        _label(h, node, rack)
    h.start_operator()
    h.submit(replicas=2, spares=2, min_replicas=1, failure_domain={"topologyKey": RACK})
    status = h.wait_running(1)
    wait_for(lambda: len(h.api.running_pods(JOB)) == 4, T, "four running pods")
    node_of = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in h.api.running_pods(JOB)}
    assert sorted(node_of.values()) == sorted(nodes), f"pods not spread over nodes: {node_of}"
    spread = h.api.running_pods(JOB)[0]["spec"]["topologySpreadConstraints"]
    assert [c["topologyKey"] for c in spread] == ["kubernetes.io/hostname", RACK]
    worker, peer = h.members(status)
    # Racks moved so that the first spare (by serial, the planner's order without domains) shares
    # the worker's rack: the operator reads a node's rack when it plans.
    first, second = sorted((n for n in node_of if n not in (worker, peer)), key=lambda n: int(n.rsplit("-", 1)[1]))
    for pod, rack in ((worker, "rack-c"), (first, "rack-c"), (second, "rack-d"), (peer, "rack-e")):
        _label(h, node_of[pod], rack)
    h.api.delete_pod(worker)
    status = h.wait_running(2)
    assert status["plan"]["reason"] == "replace"
    assert set(h.members(status)) == {peer, second}, f"the spare in rack-d should replace {worker} of rack-c"


def _label(h: Harness, node: str, rack: str) -> None:
    code, body = h.cluster.request(
        "PATCH",
        f"/api/v1/nodes/{node}",
        {"metadata": {"labels": {RACK: rack}}},
        content_type="application/merge-patch+json",
    )
    assert code == 200, body


def test_the_production_examples_pods_pass_pod_validation(local_cluster: Any, namespace: str) -> None:
    job = MegatronJob.model_validate(example_job("llama3-8b", PRODUCTION_EXAMPLE))
    priority = {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": "training-high"},
        "value": 1000,
    }
    code, body = local_cluster.request("POST", "/apis/scheduling.k8s.io/v1/priorityclasses", priority)
    assert code in (201, 409), body
    ref = builders.JobRef("llama3-8b", namespace, "0c5d1f64-0000-4000-8000-000000000001")
    for role in (wire.ROLE_WORKER, wire.ROLE_SPARE):
        pod = builders.build_pod(ref, job.spec, serial=0, role=role, operator_url="http://operator:29500")
        code, body = local_cluster.request("POST", f"/api/v1/namespaces/{namespace}/pods?dryRun=All", pod)
        assert code == 201, f"{role}: {body}"
        trainer = body["spec"]["containers"][0]
        assert trainer["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "8"


def _evict(h: Harness, pod: str) -> tuple[int, Any]:
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": h.ns}}
    result: tuple[int, Any] = h.cluster.request("POST", f"/api/v1/namespaces/{h.ns}/pods/{pod}/eviction", eviction)
    return result


def test_the_disruption_budget_lets_evictions_take_spares_but_no_worker(h: Harness) -> None:
    h.add_nodes(2)
    # Budgets are opt-in; a long periodic check so that only the watch restores a deleted one.
    h.start_operator(MEGATRON_OPERATOR_DISRUPTION_BUDGETS="true", MEGATRON_OPERATOR_CHILDREN_CHECK_SECONDS="3600")
    h.submit(replicas=2, spares=1, min_replicas=1)
    status = h.wait_running(1)
    path = f"/apis/policy/v1/namespaces/{h.ns}/poddisruptionbudgets/{JOB}"
    pdb = wait_for(
        lambda: (b := h.api.get(path)) and b.get("status", {}).get("currentHealthy") == 2 and b,
        T,
        "the budget counting both workers",
    )
    assert pdb["spec"]["minAvailable"] == 2 and pdb["status"]["disruptionsAllowed"] == 0
    assert pdb["spec"]["selector"]["matchLabels"] == {wire.LABEL_JOB: JOB, wire.LABEL_ROLE: wire.ROLE_WORKER}
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == h.api.job(JOB)["metadata"]["uid"]
    worker = h.members(status)[0]
    code, body = _evict(h, worker)
    assert code == 429 and "disruption budget" in str(body), (code, body)
    spare = next(n for n in h.pod_names() if n not in h.members(status))
    code, body = _evict(h, spare)
    assert code == 201, (code, body)
    wait_for(lambda: spare not in h.pod_names() and len(h.api.running_pods(JOB)) == 3, T, "the spare replaced")
    assert h.api.status(JOB)["epoch"] == 1  # a spare's going changes no plan
    # Deleted, it comes back at once (the operator watches budgets), not at the periodic check.
    old = pdb["metadata"]["uid"]
    code, body = h.cluster.request("DELETE", path)
    assert code == 200, body
    wait_for(lambda: (b := h.api.get(path)) and b["metadata"]["uid"] != old, 10, "the budget recreated")
