"""End to end, all real: Kueue evicts a training job, which stops with its work in a checkpoint and
resumes from it once admitted again.

Kueue's own controller manager (built from its Go module), the operator (subprocess) and a job of two
workers on process nodes (the trainer agent and Megatron-Core workers, CPU/gloo), queued through a
LocalQueue whose ClusterQueue holds exactly its two GPUs. Mid-run the job's Workload is deactivated
(``spec.active: false``, as ``kueuectl stop workload`` does): Kueue evicts it, the members train to a
step boundary and write a distributed checkpoint of that step, and the operator deletes every pod and
gives the quota back. Checked: phase Suspended, ``Suspended=True``/``EvictedByQueue`` naming the
step, that checkpoint on disk, no pod left, no step beyond it committed, the Workload's admission
cleared. Reactivated, Kueue admits the job again, new pods (on the flavor's nodes) load the checkpoint
and the job trains to the end: no recovery, every step committed once with exactly its global batch,
none redone, the steps from the checkpoint on in the resumed epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    LONG_RUN_ITERS,
    dump,
    make_elastic_job,
    process_nodes_fixture,
    submit,
    wait_for,
    wait_for_phase,
    wait_for_step,
)

from localcluster import kueue as kueue_objects
from localcluster.chaos import check_history, read_samples
from localcluster.cluster import LocalCluster
from localcluster.jobs import GLOBAL_BATCH
from localcluster.kueue import KueueManager
from localcluster.nodeagent import NODE_POOL_LABEL, NodeAgent
from localcluster.operator_run import running_operator
from megatron_contract.wire import LABEL_JOB
from megatron_trainer.worker.checkpoint_files import MANIFEST, checkpoint_dir

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

POOL = "kueue"
process_nodes = process_nodes_fixture(2, POOL)
ITERS = LONG_RUN_ITERS
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
WORKLOADS = f"/apis/{kueue_objects.GROUP}/{kueue_objects.VERSION}"


@pytest.fixture
def queue(local_cluster: LocalCluster, kueue: KueueManager, namespace: str) -> Iterator[str]:
    """A LocalQueue whose ClusterQueue holds two GPUs of a flavor that is this module's nodes."""
    flavor, cq = f"f-{namespace}", f"cq-{namespace}"
    kueue_objects.apply(
        local_cluster,
        kueue_objects.resource_flavor(flavor, {NODE_POOL_LABEL: POOL}),
        kueue_objects.cluster_queue(cq, flavor, 2),
        kueue_objects.local_queue(namespace, "lq", cq),
    )
    yield "lq"
    for path in (f"{WORKLOADS}/clusterqueues/{cq}", f"{WORKLOADS}/resourceflavors/{flavor}"):
        local_cluster.request("DELETE", path)


def _set_active(cluster: LocalCluster, namespace: str, active: bool) -> None:
    code, body = cluster.request(
        "PATCH",
        f"{WORKLOADS}/namespaces/{namespace}/workloads/megatronjob-queued",
        {"spec": {"active": active}},
        content_type="application/merge-patch+json",
    )
    assert code == 200, body


def _workload_status(cluster: LocalCluster, namespace: str) -> dict[str, Any]:
    code, body = cluster.request("GET", f"{WORKLOADS}/namespaces/{namespace}/workloads/megatronjob-queued")
    assert code == 200, body
    status: dict[str, Any] = body.get("status") or {}
    return status


def _pods(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    code, body = cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector={LABEL_JOB}%3Dqueued")
    assert code == 200, body
    pods: list[dict[str, Any]] = body["items"]
    return pods


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


def test_kueue_evicts_a_training_job_into_a_checkpoint_and_it_resumes_from_there_once_admitted(
    local_cluster: LocalCluster,
    process_nodes: NodeAgent,
    queue: str,
    namespace: str,
    tmp_path: Path,
) -> None:
    log = tmp_path / "operator.log"
    samples, checkpoints = tmp_path / "samples", tmp_path / "checkpoints"
    samples.mkdir()
    show = partial(dump, local_cluster, namespace, log)
    checkpoint = {"path": str(checkpoints), "intervalSteps": 1000}  # no periodic one: only the eviction's
    job = make_elastic_job("queued", pool=POOL, train_iters=ITERS, spares=0, samples=samples, checkpoint=checkpoint)
    job["metadata"]["labels"] = {QUEUE_LABEL: queue}
    with running_operator(local_cluster, namespace, log):
        submit(local_cluster, namespace, job)
        wait_for_step(local_cluster, namespace, "queued", 3, 300, show)
        assert all(p["spec"]["nodeSelector"][NODE_POOL_LABEL] == POOL for p in _pods(local_cluster, namespace))

        _set_active(local_cluster, namespace, False)
        stopped = wait_for_phase(local_cluster, namespace, "queued", "Suspended", 180, show)
        cond, step = _condition(stopped, "Suspended"), stopped.get("checkpointStep")
        assert (cond.get("status"), cond.get("reason")) == ("True", "EvictedByQueue"), show()
        assert step is not None and 3 < step < ITERS and f"checkpoint of step {step}" in cond["message"], stopped
        assert (checkpoint_dir(checkpoints, step) / MANIFEST).is_file(), sorted(p.name for p in checkpoints.iterdir())
        wait_for(lambda: _pods(local_cluster, namespace) == [], 60, "the job's pods to go", details=show)
        wait_for(
            lambda: "admission" not in _workload_status(local_cluster, namespace),
            60,
            "the quota given back",
            details=show,
        )
        assert max(s for _, s in read_samples(samples)) == step - 1  # trained up to the checkpoint, no further

        _set_active(local_cluster, namespace, True)
        final = wait_for_phase(local_cluster, namespace, "queued", "Succeeded", 600, show)
    assert final.get("recoveries", 0) == 0 and "lastFailure" not in final, final
    assert _condition(final, "QueueAdmitted").get("status") == "True", final
    problems, history, redone = check_history(read_samples(samples), ITERS, GLOBAL_BATCH, victims=set())
    assert problems == [] and redone == [], (problems, redone)
    assert all((epoch > stopped["epoch"]) == (s >= step) for s, epoch in history.items()), history
    print(f"evicted at step {step} (epoch {stopped['epoch']}); resumed in epoch {final['epoch']}")
