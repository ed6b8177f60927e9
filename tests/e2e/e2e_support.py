"""Support for end-to-end runs: job builders, waiting with a deadline, dumps on failure."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

from localcluster import waiting
from localcluster.cluster import LocalCluster
from localcluster.nodeagent import LOCAL_NODE_TOLERATION, NODE_POOL_LABEL

JOBS = "/apis/megatron.dev/v1alpha1/namespaces/{ns}/megatronjobs"


def make_elastic_job(
    name: str = "e2e", *, pool: str = "e2e", replicas: int = 2, spares: int = 1, train_iters: int = 40, **spec: Any
) -> dict[str, Any]:
    """A tiny GPT job whose pods run the real trainer agent on the node agent's process nodes."""
    body: dict[str, Any] = {
        "image": "megatron-trainer:local",
        "command": ["python", "-m", "megatron_trainer.agent"],
        "tp": 1,
        "pp": 1,
        "gpusPerPod": 1,
        "replicas": replicas,
        "minReplicas": 1,
        "spares": spares,
        "nodeSelector": {NODE_POOL_LABEL: pool},  # the nodes of the test's own node agent
        "tolerations": [LOCAL_NODE_TOLERATION],
        "model": {"numLayers": 2, "hiddenSize": 32, "numAttentionHeads": 2, "seqLength": 16, "vocabSize": 128},
        "training": {"globalBatchSize": 4, "microBatchSize": 1, "trainIters": train_iters, "lr": 0.001, "seed": 7},
        "failureDetection": {
            "heartbeatIntervalSeconds": 1,
            "heartbeatTimeoutSeconds": 20,
            "collectiveTimeoutSeconds": 15,
            # CPU steps of processes sharing two cores stall for seconds: a hang is a stall past 5 s.
            "hangDetectionFloorSeconds": 5,
        },
        "maxRecoveries": 5,
    }
    body.update(spec)
    return {"apiVersion": "megatron.dev/v1alpha1", "kind": "MegatronJob", "metadata": {"name": name}, "spec": body}


def job_status(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    code, job = cluster.request("GET", JOBS.format(ns=namespace) + f"/{name}")
    assert code == 200, job
    status: dict[str, Any] = job.get("status") or {}
    return status


# End-to-end waits read the API server: a few polls a second, no more (two cores run the whole stack).
wait_for = partial(waiting.wait_for, interval=0.25, error=AssertionError)


def dump(cluster: LocalCluster, namespace: str, operator_log: Path) -> str:
    """The operator's log tail, the job, the pods and each pod's log tail: what a failure needs."""
    parts = ["--- operator log (tail)", _tail(operator_log, 80)]
    parts.append("--- megatronjobs")
    parts.append(cluster.kubectl("get", "mj", "-n", namespace, "-o", "yaml", check=False).stdout[-6000:])
    parts.append("--- pods")
    parts.append(cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", "--show-labels", check=False).stdout)
    parts.append(cluster.kubectl("get", "events", "-n", namespace, check=False).stdout[-4000:])
    for pod_log in sorted((cluster.workdir / "pods").glob(f"{namespace}_*.log")):
        parts += [f"--- {pod_log.name} (tail)", _tail(pod_log, 30)]
    return "\n".join(parts)


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(none)"


def to_json(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)[:4000]
