"""Queueing through Kueue: the operator as a real process, Kueue's own controller manager (built from
its Go module) and the real local control plane (kwok nodes, recording stand-ins for the agents).

Each test has its own ResourceFlavor (its nodes carry the flavor's label), ClusterQueue (nvidia.com/gpu
quota) and LocalQueue. Scenarios:
- a labelled job gets a Workload it owns (workers and spares as pod sets, a GPU per pod) and no pod
  while the quota is too small (it is suspended: phase Suspended, ``QueueAdmitted=False``); once the
  ClusterQueue's quota is raised Kueue admits it and its pods run, with the flavor's node labels in
  their node selector;
- a job without the label, with Kueue running, gets no Workload and runs as always;
- deactivating the running job's Workload (``spec.active: false``) makes Kueue evict it: the job is
  suspended with a checkpoint (a suspend plan whose checkpoint the stand-in agents report written),
  its pods are deleted, it says why (``QueueAdmitted=False``/``EvictedByQueue``, ``Suspended=True``
  naming the step), and the quota is given back (the Workload's admission cleared); no pod comes
  back while it is inactive;
- preemption of a job without ``spec.checkpoint``: a Workload of higher priority in the same
  ClusterQueue evicts it; no checkpoint can be written, so its pods are deleted at once; it is
  requeued and, once the other Workload is gone, admitted again and resumes from its newest
  periodic checkpoint;
- the operator acting as the chart's ServiceAccount (its ClusterRole and leader Role) queues a job,
  runs it once admitted and gives the quota back after an eviction: the chart grants what it uses;
- resizing a running queued job (``spec.replicas``) makes its Workload again at the new size: the job
  is suspended with a checkpoint, admitted again and resumes at the new size;
- in a cluster without Kueue, a labelled job runs as if unlabelled;
- the production example's Workload passes the API server's validation under Kueue's CRDs.
The operator's log, the namespace's objects and Kueue's log tail are printed when a test fails.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from operator_factories import make_job
from operator_harness import JOBS, POOL_LABEL, REPO, Harness, OperatorProcess, harness_for_test, open_harness

from localcluster import build
from localcluster import kueue as kueue_objects
from localcluster.cluster import LocalCluster
from localcluster.kueue import KueueManager
from localcluster.waiting import wait_for
from megatron_contract import MegatronJob, wire
from megatron_operator import builders, queueing
from megatronjob_builders import PRODUCTION_EXAMPLE, example_job

pytestmark = pytest.mark.cluster
JOB = "queued"
T = 60.0  # a wait's deadline: each step here passes through Kueue's manager too, on a loaded machine
FLAVOR_LABEL = "example.com/gpu-flavor"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
CHART = REPO / "charts" / "megatron-operator"
WORKLOADS = f"/apis/{kueue_objects.GROUP}/{kueue_objects.VERSION}"


@pytest.fixture
def h(
    local_cluster: Any, kueue: KueueManager, namespace: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Harness]:
    failed_before = request.session.testsfailed
    yield from harness_for_test(local_cluster, namespace, tmp_path, request, JOB)
    if request.session.testsfailed > failed_before:
        print("=" * 30, "Kueue's log")
        print(kueue.log_tail(60))
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    for path in (
        f"{WORKLOADS}/clusterqueues/cq-{namespace}",
        f"{WORKLOADS}/resourceflavors/f-{namespace}",
        f"{rbac}/clusterroles/{namespace}-megatron-operator",  # the chart's, when a test installed it
        f"{rbac}/clusterrolebindings/{namespace}-megatron-operator",
    ):
        local_cluster.request("DELETE", path)


def _queues(h: Harness, gpus: int, *, preempt: bool = False) -> None:
    """This test's flavor (its nodes labelled), ClusterQueue with ``gpus`` GPUs, and LocalQueue."""
    flavor, cq = f"f-{h.ns}", f"cq-{h.ns}"
    for node in h.nodes:
        h.cluster.request(
            "PATCH",
            f"/api/v1/nodes/{node}",
            {"metadata": {"labels": {FLAVOR_LABEL: h.ns}}},
            content_type="application/merge-patch+json",
        )
    kueue_objects.apply(
        h.cluster,
        kueue_objects.resource_flavor(flavor, {FLAVOR_LABEL: h.ns}),
        kueue_objects.cluster_queue(cq, flavor, gpus, preempt=preempt),
        kueue_objects.local_queue(h.ns, "lq", cq),
    )


def _set_quota(h: Harness, gpus: int) -> None:
    cq = kueue_objects.cluster_queue(f"cq-{h.ns}", f"f-{h.ns}", gpus)
    kueue_objects.apply(h.cluster, cq)


def _submit(h: Harness, queue: str | None = "lq", **spec: Any) -> dict[str, Any]:
    body = make_job(JOB, h.ns, node_selector={POOL_LABEL: h.ns}, **spec)
    if queue is not None:
        body["metadata"]["labels"] = {QUEUE_LABEL: queue}
    status, created = h.api.create_job(body)
    assert status == 201, created
    return created


def _workload(h: Harness) -> dict[str, Any] | None:
    found: dict[str, Any] | None = h.api.get(f"{WORKLOADS}/namespaces/{h.ns}/workloads/megatronjob-{JOB}")
    return found


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)


def _queue_condition(h: Harness, value: str, reason: str, what: str) -> dict[str, Any]:
    return h.wait_status(
        lambda s: (c := _condition(s, "QueueAdmitted")) is not None and c["status"] == value and c["reason"] == reason,
        what,
        T,
    )


def test_a_queued_job_waits_for_quota_then_runs_on_the_flavors_nodes(h: Harness) -> None:
    h.add_nodes(2)
    _queues(h, gpus=2)  # the job needs 3: 2 workers and a spare, one GPU each
    h.start_operator()
    job = _submit(h, replicas=2, spares=1)
    status = _queue_condition(h, "False", "WaitingForQueueAdmission", "the job waiting for Kueue")
    status = h.wait_status(lambda s: s.get("phase") == "Suspended", "the job suspended until admitted", T)
    suspended = _condition(status, "Suspended")
    assert suspended is not None and (suspended["status"], suspended["reason"]) == ("True", "WaitingForQueueAdmission")
    workload = wait_for(lambda: _workload(h), T, "the job's Workload")
    [owner] = workload["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == (wire.KIND, job["metadata"]["uid"], True)
    assert workload["spec"]["queueName"] == "lq"
    pod_sets = {p["name"]: p for p in workload["spec"]["podSets"]}
    assert {n: p["count"] for n, p in pod_sets.items()} == {"workers": 2, "spares": 1}
    for pod_set in pod_sets.values():
        [trainer] = [c for c in pod_set["template"]["spec"]["containers"] if c["name"] == wire.TRAINER_CONTAINER]
        assert trainer["resources"]["requests"]["nvidia.com/gpu"] == "1", pod_set
    # Kueue has looked at it and found the quota too small; the operator has had many passes since.
    wait_for(
        lambda: (
            (c := _condition((_workload(h) or {}).get("status") or {}, "QuotaReserved"))
            and c["status"] == "False"
            and c
        ),
        T,
        "Kueue's verdict: no quota",
    )
    time.sleep(3)
    assert h.api.pods(JOB) == [], "pods created before Kueue admitted the job"

    _set_quota(h, gpus=3)
    h.wait_running(1, T)
    _queue_condition(h, "True", "AdmittedByQueue", "QueueAdmitted=True")
    pods = wait_for(lambda: len(p := h.api.running_pods(JOB)) == 3 and p, T, "three running pods")
    for pod in pods:
        assert pod["spec"]["nodeSelector"] == {POOL_LABEL: h.ns, FLAVOR_LABEL: h.ns}, pod["metadata"]["name"]


def test_a_job_without_the_label_ignores_kueue(h: Harness) -> None:
    h.add_nodes(1)
    _queues(h, gpus=0)  # Kueue would never admit it
    h.start_operator()
    _submit(h, queue=None, replicas=2, spares=1)
    status = h.wait_running(1, T)
    assert _condition(status, "QueueAdmitted") is None, status
    assert _workload(h) is None
    assert all(FLAVOR_LABEL not in p["spec"]["nodeSelector"] for p in h.api.pods(JOB))


def _admitted_and_running(h: Harness, gpus: int, *, preempt: bool = False, **spec: Any) -> None:
    h.add_nodes(1)
    _queues(h, gpus=gpus, preempt=preempt)
    h.start_operator()
    _submit(h, replicas=2, spares=1, **spec)
    h.wait_running(1, T)
    wait_for(lambda: len(h.api.running_pods(JOB)) == 3, T, "three running pods")


def test_deactivating_the_workload_suspends_the_job_with_a_checkpoint(h: Harness) -> None:
    _admitted_and_running(h, gpus=3, checkpoint={"path": "/checkpoints/queued"})
    status, body = h.cluster.request(
        "PATCH",
        f"{WORKLOADS}/namespaces/{h.ns}/workloads/megatronjob-{JOB}",
        {"spec": {"active": False}},
        content_type="application/merge-patch+json",
    )
    assert status == 200, body
    _queue_condition(h, "False", "EvictedByQueue", "the job evicted")
    status = h.wait_status(lambda s: s.get("phase") == "Suspended", "the job suspended", T)
    assert status["plan"]["reason"] == "suspend", status["plan"]
    suspended = _condition(status, "Suspended")
    assert suspended is not None and (suspended["status"], suspended["reason"]) == ("True", "EvictedByQueue")
    step = status["plan"]["resumeStep"]
    assert f"checkpoint of step {step} written and verified" in suspended["message"], suspended
    wait_for(lambda: not h.api.pods(JOB), T, "every pod of the job deleted")
    # The quota is given back: no admission, QuotaReserved False; Kueue leaves an inactive one there.
    workload = wait_for(
        lambda: (w := _workload(h)) and "admission" not in (w.get("status") or {}) and w, T, "the admission cleared"
    )
    reserved = _condition(workload["status"], "QuotaReserved")
    assert reserved is not None and reserved["status"] == "False", workload["status"]
    _queue_condition(h, "False", "WaitingForQueueAdmission", "the job waiting again (deactivated)")
    assert h.api.status(JOB)["phase"] == "Suspended"
    time.sleep(2)
    assert h.api.pods(JOB) == [], "pods created for a deactivated Workload"
    events = {e["reason"] for e in h.api.events()}
    assert {"EvictedByQueue", "QueueQuotaReleased"} <= events, events


def test_preemption_stops_a_job_without_checkpoints_at_once_and_it_comes_back(h: Harness) -> None:
    h.agents.checkpoint_interval = 2  # a checkpoint to resume from once admitted again
    _admitted_and_running(h, gpus=3, preempt=True)
    h.wait_status(lambda s: s.get("checkpointStep"), "a checkpoint", T)
    first = h.pod_names()
    vip = {
        "apiVersion": f"{kueue_objects.GROUP}/{kueue_objects.VERSION}",
        "kind": "Workload",
        "metadata": {"name": "vip", "namespace": h.ns},
        "spec": {
            "queueName": "lq",
            "priority": 100,
            "podSets": [
                {
                    "name": "main",
                    "count": 3,
                    "template": {
                        "spec": {
                            "restartPolicy": "Never",
                            "containers": [
                                {"name": "c", "image": "x", "resources": {"requests": {"nvidia.com/gpu": "1"}}}
                            ],
                        }
                    },
                }
            ],
        },
    }
    status, body = h.cluster.request("POST", f"{WORKLOADS}/namespaces/{h.ns}/workloads", vip)
    assert status == 201, body
    _queue_condition(h, "False", "EvictedByQueue", "the job preempted")
    status = h.wait_status(lambda s: s.get("phase") == "Suspended", "the job stopped", T)
    suspended = _condition(status, "Suspended")
    assert suspended is not None and "without one" in suspended["message"], suspended
    wait_for(lambda: not h.api.pods(JOB), T, "every pod of the job deleted")
    first_checkpoint = h.api.status(JOB)["checkpointStep"]
    workload = wait_for(
        lambda: (
            (w := _workload(h)) and (c := _condition(w.get("status") or {}, "Requeued")) and c["status"] == "True" and w
        ),
        T,
        "the job's Workload requeued",
    )
    assert "admission" not in workload["status"], workload["status"]
    wait_for(
        lambda: (
            (w := h.api.get(f"{WORKLOADS}/namespaces/{h.ns}/workloads/vip"))
            and (w.get("status") or {}).get("admission")
        ),
        T,
        "the preemptor admitted",
    )
    assert h.api.pods(JOB) == []
    h.cluster.request("DELETE", f"{WORKLOADS}/namespaces/{h.ns}/workloads/vip")
    _queue_condition(h, "True", "AdmittedByQueue", "the job admitted again")
    pods = wait_for(lambda: len(p := h.api.running_pods(JOB)) == 3 and p, T, "three running pods again")
    assert not first & {p["metadata"]["name"] for p in pods}
    status = h.wait_status(lambda s: s.get("phase") == "Running" and s.get("epoch", 0) > 1, "training again", T)
    assert status["plan"]["reason"] == "resume", status["plan"]
    # The newest checkpoint the operator knows: the one status named when the pods were gone, or a
    # newer one whose report (sent before they went) it took in later.
    assert status["plan"]["resumeStep"] == status["checkpointStep"] >= first_checkpoint


def test_the_production_examples_workload_passes_kueues_validation(
    local_cluster: Any, kueue: KueueManager, namespace: str
) -> None:
    """The Workload of a large job with a full pod template is accepted by the API server under
    Kueue's CRD schema and rules (a server-side dry run)."""
    job = MegatronJob.model_validate(example_job("llama3-8b", PRODUCTION_EXAMPLE))
    queue = yaml.safe_load(PRODUCTION_EXAMPLE.read_text())["metadata"]["labels"][QUEUE_LABEL]
    ref = builders.JobRef("llama3-8b", namespace, "0c5d1f64-0000-4000-8000-000000000001")
    workload = queueing.build_workload(ref, job.spec, queue)
    code, created = local_cluster.request("POST", f"{WORKLOADS}/namespaces/{namespace}/workloads?dryRun=All", workload)
    assert code == 201, created
    assert [(p["name"], p["count"]) for p in created["spec"]["podSets"]] == [("workers", 16), ("spares", 2)]


def test_without_kueue_a_labelled_job_runs_as_any_other(tmp_path: Path) -> None:
    """A control plane of its own, without Kueue's CRDs (the session's may have them by now)."""
    with LocalCluster() as cluster:
        cluster.install_crds()
        status, body = cluster.request(
            "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "plain"}}
        )
        assert status == 201, body
        # Closed here, not by a fixture: before its control plane stops, and its dump of a failure
        # printed while this test's output is still captured.
        with open_harness(cluster, "plain", tmp_path, JOB) as h:
            h.add_nodes(1)
            h.start_operator()
            _submit(h, replicas=2, spares=1)
            status = h.wait_running(1, T)
            assert _condition(status, "QueueAdmitted") is None and _condition(status, "Suspended") is None, status
            assert "runs without queueing" in h.operators[0].log_text()


def _chart_identity(h: Harness) -> Path:
    """The chart's ServiceAccount, ClusterRole and leader Role (rendered for a release named after the
    test's namespace) installed into it; returns a kubeconfig that acts as that ServiceAccount."""
    helm = build.build(build.HELM)
    only = ["--show-only", "templates/rbac.yaml", "--show-only", "templates/serviceaccount.yaml"]
    rendered = subprocess.run(
        [str(helm), "template", h.ns, str(CHART), "--namespace", h.ns, *only],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    h.cluster.kubectl("apply", "-f", "-", input=rendered)
    account = f"{h.ns}-megatron-operator"
    status, body = h.cluster.request(
        "POST",
        f"/api/v1/namespaces/{h.ns}/serviceaccounts/{account}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}},
    )
    assert status == 201, body
    config = yaml.safe_load(h.cluster.kubeconfig.read_text())
    config["users"] = [{"name": "admin", "user": {"token": body["status"]["token"]}}]
    path = h.cluster.kubeconfig.parent / f"kubeconfig-{h.ns}"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_charts_rbac_is_enough_for_queueing(h: Harness) -> None:
    """The operator as the chart's ServiceAccount: creates and watches the Workload, reads the
    flavor, and after an eviction patches the Workload's status (every Kueue verb the chart grants)."""
    h.add_nodes(1)
    _queues(h, gpus=2)
    kubeconfig = _chart_identity(h)
    op = OperatorProcess(kubeconfig, h.ns, h.tmp / "operator-rbac.log").start()
    h.operators.append(op)
    h.agents.operator_urls.append(op.url)
    _submit(h, replicas=2, spares=1)
    _queue_condition(h, "False", "WaitingForQueueAdmission", "the job waiting for Kueue")
    _set_quota(h, gpus=3)
    h.wait_running(1, T)
    for pod in wait_for(lambda: len(p := h.api.running_pods(JOB)) == 3 and p, T, "three running pods"):
        assert pod["spec"]["nodeSelector"][FLAVOR_LABEL] == h.ns
    status, body = h.cluster.request(
        "PATCH",
        f"{WORKLOADS}/namespaces/{h.ns}/workloads/megatronjob-{JOB}",
        {"spec": {"active": False}},
        content_type="application/merge-patch+json",
    )
    assert status == 200, body
    wait_for(lambda: not h.api.pods(JOB), T, "every pod of the job deleted")
    wait_for(lambda: (w := _workload(h)) and "admission" not in (w.get("status") or {}), T, "the quota given back")
    # A 403 status, not the milliseconds of a log line's timestamp (",403").
    refused = re.search(r"Forbidden|(?<![,\d])403(?!\d)", op.log_text())
    assert refused is None, op.log_text()[-3000:]


def test_resizing_a_queued_job_queues_it_again_at_its_new_size(h: Harness) -> None:
    _admitted_and_running(h, gpus=4, checkpoint={"path": "/checkpoints/queued"})
    old_uid = (_workload(h) or {})["metadata"]["uid"]
    status, body = h.cluster.request(
        "PATCH",
        f"{JOBS}/namespaces/{h.ns}/{wire.PLURAL}/{JOB}",
        {"spec": {"replicas": 3}},
        content_type="application/merge-patch+json",
    )
    assert status == 200, body
    workload = wait_for(
        lambda: (w := _workload(h)) and w["metadata"]["uid"] != old_uid and w, T, "a new Workload for the new size"
    )
    assert {p["name"]: p["count"] for p in workload["spec"]["podSets"]} == {"workers": 3, "spares": 1}
    status = h.wait_status(
        lambda s: s.get("phase") == "Running" and s.get("mesh", "").startswith("3x"), "training at the new size", T
    )
    assert status["plan"]["reason"] == "resume", status["plan"]
    assert len(wait_for(lambda: len(p := h.api.running_pods(JOB)) == 4 and p, T, "four running pods")) == 4
