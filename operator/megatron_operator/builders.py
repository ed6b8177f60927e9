"""Pure builders of a job's children: worker and spare pods, the headless Service, the token Secret.

Every function returns a plain dict ready for the API server; nothing here talks to it.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from typing import Any

from megatron_contract import wire
from megatron_contract.job import MegatronJobSpec

GPU_RESOURCE = "nvidia.com/gpu"
CONTAINER_NAME = "trainer"
#: Annotation on the job that reserves pod serial numbers before pods are created, so a restarted
#: operator never re-uses a name (and never creates the same pod twice).
ANNOTATION_NEXT_SERIAL = f"{wire.GROUP}/next-pod-serial"
_DNS_LABEL_MAX = 63


@dataclasses.dataclass(frozen=True)
class JobRef:
    """Identity of a MegatronJob: what children need to point at their owner."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def of(cls, body: Any) -> JobRef:
        meta = body["metadata"]
        return cls(meta["name"], meta["namespace"], meta["uid"])


def _dns_label(name: str) -> str:
    """``name`` if it is a valid DNS label length, else a truncated form with a stable hash."""
    if len(name) <= _DNS_LABEL_MAX:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: _DNS_LABEL_MAX - 9].rstrip('-')}-{digest}"


def service_name(job: JobRef) -> str:
    """The headless Service of a job (the pods' DNS subdomain)."""
    return _dns_label(job.name)


def secret_name(job: JobRef) -> str:
    """The Secret holding the job's token."""
    return f"{job.name}-token"


def pod_name(job: JobRef, serial: int) -> str:
    """The name of the job's pod number ``serial`` (serials are never re-used)."""
    return f"{job.name}-{serial}"


def owner_reference(job: JobRef) -> dict[str, Any]:
    """An ownerReference that makes the job the controller of a child (deleted with it)."""
    return {
        "apiVersion": wire.API_VERSION,
        "kind": wire.KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_labels(job: JobRef) -> dict[str, str]:
    """Labels every child of a job carries."""
    return {wire.LABEL_JOB: job.name}


def build_secret(job: JobRef, token: str) -> dict[str, Any]:
    """The per-job Secret with the token that signs plans and reports (the pods read it; the operator never).

    ``data`` rather than ``stringData``: the Secret is server-side applied, and a write-only field
    would leave the applied configuration different from the object on every apply.
    """
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": secret_name(job),
            "namespace": job.namespace,
            "labels": child_labels(job),
            "ownerReferences": [owner_reference(job)],
        },
        "data": {wire.TOKEN_SECRET_KEY: base64.b64encode(token.encode()).decode()},
    }


def build_service(job: JobRef) -> dict[str, Any]:
    """The headless Service: stable DNS names for the pods, ready or not (rendezvous needs them early)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(job),
            "namespace": job.namespace,
            "labels": child_labels(job),
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": child_labels(job),
            "ports": [
                {"name": "agent", "port": wire.AGENT_PORT, "targetPort": wire.AGENT_PORT},
                {"name": "rendezvous", "port": wire.RENDEZVOUS_PORT, "targetPort": wire.RENDEZVOUS_PORT},
            ],
        },
    }


def _trainer_env(job: JobRef, spec: MegatronJobSpec, role: str, operator_url: str) -> list[dict[str, Any]]:
    # The whole spec, as the contract says (wire.ENV_JOB_SPEC): workers read model, training,
    # parallel sizes, checkpoint and failure-detection deadlines from it.
    trainer_spec = spec.to_wire()
    env: list[dict[str, Any]] = [
        {"name": wire.ENV_JOB_NAME, "value": job.name},
        {"name": wire.ENV_JOB_NAMESPACE, "value": job.namespace},
        {"name": wire.ENV_JOB_UID, "value": job.uid},
        {
            "name": wire.ENV_JOB_TOKEN,
            "valueFrom": {"secretKeyRef": {"name": secret_name(job), "key": wire.TOKEN_SECRET_KEY}},
        },
        {"name": wire.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": wire.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": wire.ENV_POD_ROLE, "value": role},
        {"name": wire.ENV_OPERATOR_URL, "value": operator_url},
        {"name": wire.ENV_GPUS_PER_POD, "value": str(spec.gpus_per_pod)},
        {"name": wire.ENV_JOB_SPEC, "value": json.dumps(trainer_spec, sort_keys=True)},
        {"name": wire.ENV_HEARTBEAT_INTERVAL, "value": str(spec.failure_detection.heartbeat_interval_seconds)},
    ]
    ours = {e["name"] for e in env}
    # The user's variables come last but never override ours: the agent depends on them.
    env.extend({"name": e.name, "value": e.value} for e in spec.env if e.name not in ours)
    return env


def build_pod(
    job: JobRef, spec: MegatronJobSpec, *, serial: int, role: str, operator_url: str
) -> dict[str, Any]:
    """A trainer pod; workers and hot spares are built from the same template, only the role differs.

    Args:
        job: the owning job.
        spec: the job's spec.
        serial: the pod's serial number (its name is ``{job}-{serial}``).
        role: ``wire.ROLE_WORKER`` or ``wire.ROLE_SPARE``.
        operator_url: where the pod's agent sends its reports.
    """
    if role not in (wire.ROLE_WORKER, wire.ROLE_SPARE):
        raise ValueError(f"role must be {wire.ROLE_WORKER!r} or {wire.ROLE_SPARE!r}, not {role!r}")
    name = pod_name(job, serial)
    gpus = {GPU_RESOURCE: str(spec.gpus_per_pod)}
    resources = {
        "requests": {**{k: str(v) for k, v in spec.resources.requests.items()}, **gpus},
        "limits": {**{k: str(v) for k, v in spec.resources.limits.items()}, **gpus},
    }
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "args": list(spec.args),
        "env": _trainer_env(job, spec, role, operator_url),
        "resources": resources,
        "ports": [
            {"name": "agent", "containerPort": wire.AGENT_PORT},
            {"name": "rendezvous", "containerPort": wire.RENDEZVOUS_PORT},
        ],
    }
    if spec.command:
        container["command"] = list(spec.command)
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    pod_spec: dict[str, Any] = {
        # A failed pod is replaced by a spare, never restarted in place: the mesh moves on without it.
        "restartPolicy": "Never",
        # Trainers talk to the operator over HTTP with the job token, never to the API server.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "subdomain": service_name(job),
        "containers": [container],
    }
    if len(name) <= _DNS_LABEL_MAX:
        pod_spec["hostname"] = name
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.to_wire() for t in spec.tolerations]
    if spec.checkpoint is not None and spec.checkpoint.volume_claim_name:
        pod_spec["volumes"] = [
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": spec.checkpoint.volume_claim_name}}
        ]
        container["volumeMounts"] = [{"name": "checkpoints", "mountPath": spec.checkpoint.path}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": job.namespace,
            "labels": {**child_labels(job), wire.LABEL_ROLE: role, wire.LABEL_POD_INDEX: str(serial)},
            "ownerReferences": [owner_reference(job)],
        },
        "spec": pod_spec,
    }


def role_labels(role: str, replica: int | None) -> dict[str, str | None]:
    """A label patch giving a pod its role (and data-parallel replica, None removes it)."""
    return {wire.LABEL_ROLE: role, wire.LABEL_REPLICA: None if replica is None else str(replica)}
