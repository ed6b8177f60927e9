"""Small builders of test objects for the operator's tests: specs, job bodies, pods, nodes."""

from __future__ import annotations

from typing import Any

from megatron_contract.job import MegatronJobSpec
from megatron_contract.wire import API_VERSION, KIND, LABEL_JOB, LABEL_POD_INDEX, LABEL_ROLE, ROLE_SPARE, ROLE_WORKER
from megatron_operator.planner import PodRef
from megatronjob_builders import small_spec

JOB_UID = "00000000-0000-0000-0000-00000000a1b2"


def make_spec(
    replicas: int = 4,
    *,
    min_replicas: int = 1,
    spares: int = 1,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    gpus_per_pod: int = 1,
    global_batch: int | None = None,
    **extra: Any,
) -> MegatronJobSpec:
    """The operator's small spec (:func:`megatronjob_builders.small_spec`); the global batch
    defaults to enough micro-batches for every replica."""
    return small_spec(
        replicas=replicas,
        min_replicas=min_replicas,
        spares=spares,
        tp=tp,
        pp=pp,
        cp=cp,
        gpus_per_pod=gpus_per_pod,
        training={"global_batch_size": global_batch or max(16, replicas * 2)},
        **extra,
    )


def make_job(
    name: str = "job", namespace: str = "ns", *, uid: str = JOB_UID, status: dict[str, Any] | None = None, **spec: Any
) -> dict[str, Any]:
    """A MegatronJob body as the API server would return it."""
    body: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": 1, "resourceVersion": "1"},
        "spec": make_spec(**spec).to_wire(),
    }
    if status is not None:
        body["status"] = status
    return body


def make_pod_refs(count: int, prefix: str = "p", start: int = 0) -> list[PodRef]:
    """Healthy pods for the planner: ``p0``, ``p1``, ... at 127.64.0.x."""
    return [
        PodRef(f"{prefix}{i}", f"uid-{prefix}{i}", f"127.64.{i // 250}.{i % 250 + 1}")
        for i in range(start, start + count)
    ]


def make_pod(
    name: str,
    *,
    job: str = "job",
    role: str = ROLE_WORKER,
    phase: str = "Running",
    ip: str | None = "127.64.0.9",
    node: str | None = "gpu-0",
    uid: str | None = None,
    terminated: dict[str, Any] | None = None,
    restarts: int = 0,
    deleting: bool = False,
    reason: str | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """A pod body of a job, in the given lifecycle state."""
    status: dict[str, Any] = {"phase": phase}
    if ip:
        status["podIP"] = ip
    if reason:
        status["reason"] = reason
    state = {"terminated": terminated} if terminated else {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
    status["containerStatuses"] = [
        {"name": "trainer", "ready": phase == "Running" and not terminated, "restartCount": restarts, "state": state}
    ]
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "uid": uid or f"uid-{name}",
        "labels": {LABEL_JOB: job, LABEL_ROLE: role, LABEL_POD_INDEX: str(index)},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node} if node else {}, "status": status}


def make_node(name: str = "gpu-0", ready: str = "True") -> dict[str, Any]:
    """A node body with the given Ready status ("True", "False" or "Unknown")."""
    return {"metadata": {"name": name}, "status": {"conditions": [{"type": "Ready", "status": ready}]}}


__all__ = ["JOB_UID", "ROLE_SPARE", "ROLE_WORKER", "make_job", "make_node", "make_pod", "make_pod_refs", "make_spec"]
