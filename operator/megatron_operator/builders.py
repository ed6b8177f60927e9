"""Pure builders of a job's children: worker and spare pods, the headless Service, the token Secret,
the PodDisruptionBudget of its workers.

Every function returns a plain dict ready for the API server; nothing here talks to it.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import hashlib
import json
from typing import Any

from megatron_contract import wire
from megatron_contract.job import MegatronJobSpec
from megatron_contract.pod_template import (
    AGENT_PORT_NAME,
    CHECKPOINT_VOLUME,
    GPU_RESOURCE,
    RENDEZVOUS_PORT_NAME,
    SHM_PATH,
    SHM_VOLUME,
    is_rdma_resource,
)

CONTAINER_NAME = wire.TRAINER_CONTAINER
#: kubectl logs/exec pick this container of a pod (and the local node agent runs it).
DEFAULT_CONTAINER_ANNOTATION = "kubectl.kubernetes.io/default-container"
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


def disruption_budget_name(job: JobRef) -> str:
    """The PodDisruptionBudget of a job's workers."""
    return job.name


def build_disruption_budget(job: JobRef, spec: MegatronJobSpec) -> dict[str, Any]:
    """The PodDisruptionBudget that keeps voluntary evictions (a node drain) from taking a worker
    behind the operator's back: no worker pod may be evicted.

    ``minAvailable`` is every worker pod of the full mesh, a number: the disruption controller
    counts the pods themselves (``maxUnavailable`` or a percentage would need a scale subresource
    of the job, whose replicas are data-parallel replicas, not pods). After a shrink fewer workers
    run than that, which refuses evictions all the same.

    Spares are outside it (losing one costs a warm-up, not a recovery), and so are pods the operator
    relabels out of the mesh (``retired``): a worker leaves through the operator, which moves its
    ranks first. A worker that is not Ready (hung, failing) may still be evicted
    (``unhealthyPodEvictionPolicy: AlwaysAllow``): it holds nothing a drain could save.
    """
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": disruption_budget_name(job),
            "namespace": job.namespace,
            "labels": child_labels(job),
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {
            "minAvailable": spec.worker_pods,
            "selector": {"matchLabels": {**child_labels(job), wire.LABEL_ROLE: wire.ROLE_WORKER}},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _trainer_env(job: JobRef, spec: MegatronJobSpec, role: str, operator_url: str) -> list[dict[str, Any]]:
    # The spec, as the contract says (wire.ENV_JOB_SPEC): workers read model, training, parallel
    # sizes, checkpoint and failure-detection deadlines from it. The pod template is the pod's
    # business, not the trainer's (and may be large).
    trainer_spec = spec.to_wire()
    trainer_spec.pop("template", None)
    return [
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


def _merge_security(defaults: dict[str, Any], given: dict[str, Any] | None) -> dict[str, Any]:
    """A securityContext: the template's fields win, key by key (that is how it relaxes a default);
    capabilities the template adds come on top of ours, the ones it drops replace ours."""
    merged = {**defaults, **copy.deepcopy(given or {})}
    ours, theirs = defaults.get("capabilities"), (given or {}).get("capabilities")
    if ours is not None and theirs is not None:
        add = [*ours.get("add", []), *(c for c in theirs.get("add", []) if c not in ours.get("add", []))]
        merged["capabilities"] = {**ours, **theirs, **({"add": add} if add else {})}
    return merged


def _trainer_container(
    job: JobRef, spec: MegatronJobSpec, role: str, operator_url: str, given: dict[str, Any] | None
) -> dict[str, Any]:
    """The trainer container: the template's container of that name (or spec's shorthands) under ours.

    Admission has refused what would clash (pydantic and CEL rules of the spec): an image, command
    or args other than spec's, our ports or variables, another GPU count. What remains merges.
    """
    container: dict[str, Any] = copy.deepcopy(given) if given is not None else {"name": CONTAINER_NAME}
    container["image"] = spec.image
    container["args"] = list(spec.args)
    if spec.command:
        container["command"] = list(spec.command)
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    ours = _trainer_env(job, spec, role, operator_url)
    owned = {e["name"] for e in ours}
    extra = container.get("env") if given is not None and "env" in given else [e.to_wire() for e in spec.env]
    # The user's variables come last and never override ours: the agent depends on them.
    container["env"] = ours + [e for e in extra or [] if e.get("name") not in owned]
    given_resources = container.get("resources") or {
        "requests": dict(spec.resources.requests),
        "limits": dict(spec.resources.limits),
    }
    gpus = {GPU_RESOURCE: str(spec.gpus_per_pod)}
    resources = {
        **given_resources,
        "requests": {**{k: str(v) for k, v in (given_resources.get("requests") or {}).items()}, **gpus},
        "limits": {**{k: str(v) for k, v in (given_resources.get("limits") or {}).items()}, **gpus},
    }
    container["resources"] = resources
    container["ports"] = [
        {"name": AGENT_PORT_NAME, "containerPort": wire.AGENT_PORT},
        {"name": RENDEZVOUS_PORT_NAME, "containerPort": wire.RENDEZVOUS_PORT},
        *container.get("ports", []),
    ]
    mounts = list(container.get("volumeMounts", []))
    if not any(m.get("mountPath") == SHM_PATH for m in mounts):
        mounts.append({"name": SHM_VOLUME, "mountPath": SHM_PATH})
    if spec.checkpoint is not None and spec.checkpoint.volume_claim_name:
        mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": spec.checkpoint.path})
    container["volumeMounts"] = mounts
    rdma = any(is_rdma_resource(name) for part in ("requests", "limits") for name in resources[part])
    # Secure by default; the template relaxes a field by giving it. RDMA (verbs) pins memory: IPC_LOCK.
    capabilities: dict[str, Any] = {"drop": ["ALL"], **({"add": ["IPC_LOCK"]} if rdma else {})}
    container["securityContext"] = _merge_security(
        {"allowPrivilegeEscalation": False, "capabilities": capabilities}, container.get("securityContext")
    )
    return container


def _volumes(spec: MegatronJobSpec, given: list[dict[str, Any]], trainer: dict[str, Any]) -> list[dict[str, Any]]:
    """The template's volumes and ours: a memory-backed /dev/shm (unless the template mounts its
    own there) and the checkpoint PVC."""
    volumes = list(given)
    if any(m["name"] == SHM_VOLUME for m in trainer["volumeMounts"]):
        shm: dict[str, Any] = {"medium": "Memory"}
        if spec.shm_size is not None:
            shm["sizeLimit"] = str(spec.shm_size)
        volumes.append({"name": SHM_VOLUME, "emptyDir": shm})
    if spec.checkpoint is not None and spec.checkpoint.volume_claim_name:
        volumes.append(
            {"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": spec.checkpoint.volume_claim_name}}
        )
    return volumes


def failure_domain_keys(spec: MegatronJobSpec) -> list[str]:
    """Node labels naming the failure domains pods spread over: the node, then the larger one if any."""
    keys = [wire.HOSTNAME_TOPOLOGY_KEY]
    key = spec.failure_domain.topology_key
    if key and key != wire.HOSTNAME_TOPOLOGY_KEY:
        keys.append(key)
    return keys


def _spread(job: JobRef, spec: MegatronJobSpec, role: str, pod_spec: dict[str, Any]) -> None:
    """Spread the job's pods over failure domains, so that one node's (or rack's) loss takes as few
    as possible, and keep spares away from workers: a spare beside a worker dies with it.

    The template's own spread constraints on a key win over ours; its affinity is kept, ours added.
    """
    constraints = list(pod_spec.get("topologySpreadConstraints", []))
    taken = {c.get("topologyKey") for c in constraints}
    keys = failure_domain_keys(spec)
    for key in keys:
        if key not in taken:
            constraints.append(
                {
                    "maxSkew": 1,
                    "topologyKey": key,
                    "whenUnsatisfiable": spec.failure_domain.when_unsatisfiable,
                    "labelSelector": {"matchLabels": child_labels(job)},
                }
            )
    pod_spec["topologySpreadConstraints"] = constraints
    if role != wire.ROLE_SPARE:
        return
    affinity = copy.deepcopy(pod_spec.get("affinity") or {})
    anti = affinity.setdefault("podAntiAffinity", {})
    preferred = anti.setdefault("preferredDuringSchedulingIgnoredDuringExecution", [])
    workers = {"matchLabels": {**child_labels(job), wire.LABEL_ROLE: wire.ROLE_WORKER}}
    for weight, key in zip((100, 50), keys, strict=False):
        preferred.append({"weight": weight, "podAffinityTerm": {"topologyKey": key, "labelSelector": workers}})
    pod_spec["affinity"] = affinity


def build_pod(
    job: JobRef, spec: MegatronJobSpec, *, serial: int, role: str, operator_url: str, replica: int | None = None
) -> dict[str, Any]:
    """A trainer pod: the job's ``spec.template`` merged with what the operator owns.

    Workers and hot spares are built from the same template; only the role (and a spare's
    preference for nodes without workers) differs. The operator owns the trainer container's image,
    command, ports, environment and GPUs, the labels under its API group, the owner reference,
    ``restartPolicy: Never``, no service-account token, the hostname and subdomain; it adds a
    memory-backed ``/dev/shm``, secure defaults the template may relax (non-root, no privilege
    escalation, capabilities dropped but IPC_LOCK with RDMA, the runtime's seccomp profile) and
    spreading over failure domains. Admission has refused templates that clash with any of it.

    Args:
        job: the owning job.
        spec: the job's spec.
        serial: the pod's serial number (its name is ``{job}-{serial}``).
        role: ``wire.ROLE_WORKER`` or ``wire.ROLE_SPARE``.
        operator_url: where the pod's agent sends its reports.
        replica: the data-parallel replica the worker is expected to hold (its replica label from
            the start), when known.
    """
    if role not in (wire.ROLE_WORKER, wire.ROLE_SPARE):
        raise ValueError(f"role must be {wire.ROLE_WORKER!r} or {wire.ROLE_SPARE!r}, not {role!r}")
    name = pod_name(job, serial)
    template = spec.template.to_wire() if spec.template is not None else {}
    meta = template.get("metadata", {})
    pod_spec: dict[str, Any] = copy.deepcopy(template.get("spec", {}))
    containers = pod_spec.pop("containers", [])
    given = next((c for c in containers if c.get("name") == CONTAINER_NAME), None)
    trainer = _trainer_container(job, spec, role, operator_url, given)
    # The trainer first (kubectl's default container), the template's sidecars after it.
    pod_spec["containers"] = [trainer, *(c for c in containers if c.get("name") != CONTAINER_NAME)]
    pod_spec["volumes"] = _volumes(spec, pod_spec.get("volumes", []), trainer)
    pod_spec.update(
        {
            # A failed pod is replaced by a spare, never restarted in place: the mesh moves on without it.
            "restartPolicy": "Never",
            # Trainers talk to the operator over HTTP with the job token, never to the API server.
            "automountServiceAccountToken": False,
            "subdomain": service_name(job),
        }
    )
    pod_spec.setdefault("enableServiceLinks", False)
    if len(name) <= _DNS_LABEL_MAX:
        pod_spec["hostname"] = name
    if spec.node_selector and "nodeSelector" not in pod_spec:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations and "tolerations" not in pod_spec:
        pod_spec["tolerations"] = [t.to_wire() for t in spec.tolerations]
    if pod_spec.get("hostNetwork") and "dnsPolicy" not in pod_spec:
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"  # the job's Service names still resolve
    pod_spec["securityContext"] = _merge_security(
        {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}, pod_spec.get("securityContext")
    )
    _spread(job, spec, role, pod_spec)
    labels = {**meta.get("labels", {}), **child_labels(job), wire.LABEL_ROLE: role, wire.LABEL_POD_INDEX: str(serial)}
    if replica is not None:
        labels[wire.LABEL_REPLICA] = str(replica)
    annotations = {**meta.get("annotations", {}), DEFAULT_CONTAINER_ANNOTATION: CONTAINER_NAME}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": job.namespace,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [owner_reference(job)],
        },
        "spec": pod_spec,
    }


def role_labels(role: str, replica: int | None) -> dict[str, str | None]:
    """A label patch giving a pod its role (and data-parallel replica, None removes it)."""
    return {wire.LABEL_ROLE: role, wire.LABEL_REPLICA: None if replica is None else str(replica)}
