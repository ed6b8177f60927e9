"""Builders of a job's children (``megatron_operator.builders``), pure.

Scenarios: worker and spare pods come from one template (only the role differs, and a spare's
preference for nodes without workers), request ``nvidia.com/gpu`` = gpusPerPod, restartPolicy Never,
no service-account token, the env the agent reads (token from the Secret, pod name/IP from the
downward API, spec as JSON without the pod template), owner reference and labels; user env never
overrides ours; the checkpoint PVC is mounted; a bad role is refused; the headless Service publishes
not-ready pods; the Secret holds the token it is given; the PodDisruptionBudget covers the job's workers
(not its spares) with minAvailable = every worker pod, as a number; long names stay valid DNS labels.

``spec.template`` merged with what the operator owns: the template's volumes, mounts, env, extra
resources, sidecars, init containers, labels, annotations and pod fields (priorityClassName,
schedulerName, runtimeClassName, hostNetwork with its DNS policy, imagePullSecrets, affinity) reach the
pod; the trainer container keeps our image, command, ports, env and GPUs first; the shorthands
(resources, env, nodeSelector, tolerations, imagePullPolicy) land where the template's would; /dev/shm
is a memory-backed emptyDir (sized by spec.shmSize) unless the template mounts its own; secure defaults
(non-root, no privilege escalation, capabilities dropped, RuntimeDefault seccomp) that the template
relaxes field by field, IPC_LOCK added when an RDMA resource is requested; pods spread over nodes and
the job's failure-domain label, the template's own constraint on a key winning.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from operator_factories import make_spec

from megatron_contract import wire
from megatron_contract.job import EnvVar
from megatron_operator import builders
from megatron_operator.builders import JobRef

JOB = JobRef("llm", "team-a", "uid-1")


def test_worker_and_spare_share_a_template() -> None:
    spec = make_spec(replicas=2, tp=2, gpus_per_pod=2)
    worker = builders.build_pod(JOB, spec, serial=3, role=wire.ROLE_WORKER, operator_url="http://op:1")
    spare = builders.build_pod(JOB, spec, serial=3, role=wire.ROLE_SPARE, operator_url="http://op:1")
    assert worker["metadata"]["labels"][wire.LABEL_ROLE] == "worker"
    assert spare["metadata"]["labels"][wire.LABEL_ROLE] == "spare"
    worker["metadata"]["labels"].pop(wire.LABEL_ROLE)
    spare["metadata"]["labels"].pop(wire.LABEL_ROLE)
    env_w = worker["spec"]["containers"][0].pop("env")
    env_s = spare["spec"]["containers"][0].pop("env")
    # A spare prefers nodes without the job's workers: a spare beside a worker dies with it.
    anti = spare["spec"].pop("affinity")["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti == [
        {
            "weight": 100,
            "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": {wire.LABEL_JOB: "llm", wire.LABEL_ROLE: wire.ROLE_WORKER}},
            },
        }
    ]
    assert "affinity" not in worker["spec"]
    assert worker == spare
    assert [e for e in env_w if e["name"] != wire.ENV_POD_ROLE] == [e for e in env_s if e["name"] != wire.ENV_POD_ROLE]


def test_pod_shape() -> None:
    spec = make_spec(
        replicas=2,
        gpus_per_pod=4,
        tp=4,
        resources={"requests": {"cpu": 8}, "limits": {"memory": "64Gi"}},
        node_selector={"pool": "h100"},
    )
    pod = builders.build_pod(JOB, spec, serial=7, role=wire.ROLE_WORKER, operator_url="http://op:29500")
    meta, pspec = pod["metadata"], pod["spec"]
    assert meta["name"] == "llm-7" and meta["namespace"] == "team-a"
    assert meta["labels"] == {wire.LABEL_JOB: "llm", wire.LABEL_ROLE: "worker", wire.LABEL_POD_INDEX: "7"}
    assert meta["annotations"] == {"kubectl.kubernetes.io/default-container": "trainer"}
    assert meta["ownerReferences"] == [
        {
            "apiVersion": wire.API_VERSION,
            "kind": wire.KIND,
            "name": "llm",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert pspec["restartPolicy"] == "Never"
    assert pspec["automountServiceAccountToken"] is False
    assert pspec["nodeSelector"] == {"pool": "h100"}
    assert pspec["subdomain"] == "llm" and pspec["hostname"] == "llm-7"
    container = pspec["containers"][0]
    assert container["resources"] == {
        "requests": {"cpu": "8", "nvidia.com/gpu": "4"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "4"},
    }
    ports = {p["containerPort"] for p in container["ports"]}
    assert ports == {wire.AGENT_PORT, wire.RENDEZVOUS_PORT}
    env = {e["name"]: e for e in container["env"]}
    assert env[wire.ENV_JOB_TOKEN]["valueFrom"]["secretKeyRef"] == {"name": "llm-token", "key": wire.TOKEN_SECRET_KEY}
    assert env[wire.ENV_POD_NAME]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env[wire.ENV_POD_IP]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env[wire.ENV_OPERATOR_URL]["value"] == "http://op:29500"
    assert env[wire.ENV_GPUS_PER_POD]["value"] == "4"
    assert env[wire.ENV_JOB_UID]["value"] == "uid-1"
    trainer_spec = json.loads(env[wire.ENV_JOB_SPEC]["value"])
    assert trainer_spec["tp"] == 4 and trainer_spec["model"]["numAttentionHeads"] == spec.model.num_attention_heads
    assert pspec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert pspec["volumes"] == [{"name": "megatron-shm", "emptyDir": {"medium": "Memory"}}]
    assert container["volumeMounts"] == [{"name": "megatron-shm", "mountPath": "/dev/shm"}]
    assert pspec["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {wire.LABEL_JOB: "llm"}},
        }
    ]


def test_user_env_never_overrides_ours() -> None:
    spec = make_spec(env=[{"name": "NCCL_DEBUG", "value": "INFO"}])
    # Admission refuses our variables in spec.env; a spec that slipped past an old CRD still cannot.
    object.__setattr__(spec, "env", [*spec.env, EnvVar(name=wire.ENV_JOB_UID, value="evil")])
    pod = builders.build_pod(JOB, spec, serial=0, role=wire.ROLE_SPARE, operator_url="u")
    env = [(e["name"], e.get("value")) for e in pod["spec"]["containers"][0]["env"]]
    assert (wire.ENV_JOB_UID, "uid-1") in env and (wire.ENV_JOB_UID, "evil") not in env
    assert ("NCCL_DEBUG", "INFO") in env


def test_checkpoint_volume_is_mounted() -> None:
    spec = make_spec(checkpoint={"path": "/ckpt", "volumeClaimName": "ckpt-pvc"})
    pod = builders.build_pod(JOB, spec, serial=0, role=wire.ROLE_WORKER, operator_url="u")
    assert pod["spec"]["volumes"][-1] == {
        "name": "megatron-checkpoints",
        "persistentVolumeClaim": {"claimName": "ckpt-pvc"},
    }
    assert pod["spec"]["containers"][0]["volumeMounts"][-1] == {"name": "megatron-checkpoints", "mountPath": "/ckpt"}


def test_bad_role_is_refused() -> None:
    with pytest.raises(ValueError, match="role must be"):
        builders.build_pod(JOB, make_spec(), serial=0, role="boss", operator_url="u")


def test_service_and_secret() -> None:
    service = builders.build_service(JOB)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {wire.LABEL_JOB: "llm"}
    secret = builders.build_secret(JOB, "tok")
    assert secret["data"] == {wire.TOKEN_SECRET_KEY: base64.b64encode(b"tok").decode()}
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_the_disruption_budget_covers_every_worker_and_no_spare() -> None:
    pdb = builders.build_disruption_budget(JOB, make_spec(replicas=4, tp=2, pp=2, gpus_per_pod=2))
    assert pdb["apiVersion"] == "policy/v1" and pdb["metadata"]["name"] == "llm"
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    # A number, not maxUnavailable or a percentage: those need a scale subresource of the job.
    assert pdb["spec"]["minAvailable"] == 8  # 4 replicas of 2 pods each
    assert pdb["spec"]["selector"] == {"matchLabels": {wire.LABEL_JOB: "llm", wire.LABEL_ROLE: wire.ROLE_WORKER}}
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_long_names_stay_dns_labels() -> None:
    job = JobRef("x" * 80, "ns", "uid")
    assert len(builders.service_name(job)) <= 63
    assert builders.service_name(job) != builders.service_name(JobRef("x" * 79 + "y", "ns", "uid"))
    pod = builders.build_pod(job, make_spec(), serial=1, role=wire.ROLE_WORKER, operator_url="u")
    assert "hostname" not in pod["spec"]


def _pod(role: str = wire.ROLE_WORKER, **spec: Any) -> dict[str, Any]:
    return builders.build_pod(JOB, make_spec(**spec), serial=0, role=role, operator_url="u")


def _trainer(pod: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = pod["spec"]["containers"][0]
    assert container["name"] == "trainer"
    return container


PRODUCTION_TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "llm"}, "annotations": {"sidecar.istio.io/inject": "false"}},
    "spec": {
        "priorityClassName": "training-high",
        "schedulerName": "volcano",
        "runtimeClassName": "nvidia",
        "imagePullSecrets": [{"name": "registry"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]
                }
            }
        },
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}}],
        "initContainers": [{"name": "fetch", "image": "busybox", "command": ["true"]}],
        "containers": [
            {"name": "log-shipper", "image": "fluent-bit:3", "args": ["-c", "/etc/fb.conf"]},
            {
                "name": "trainer",
                "env": [
                    {"name": "NCCL_IB_HCA", "value": "mlx5"},
                    {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                ],
                "resources": {"limits": {"rdma/ib": 1, "memory": "512Gi"}, "requests": {"cpu": "32"}},
                "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
                "ports": [{"name": "debug", "containerPort": 5678}],
            },
        ],
    },
}


def test_template_reaches_the_pod_merged_with_what_is_ours() -> None:
    pod = _pod(template=PRODUCTION_TEMPLATE, gpus_per_pod=8, tp=8, replicas=1)
    meta, pspec = pod["metadata"], pod["spec"]
    assert meta["labels"]["team"] == "llm" and meta["labels"][wire.LABEL_JOB] == "llm"
    assert meta["annotations"]["sidecar.istio.io/inject"] == "false"
    for field in (
        "priorityClassName",
        "schedulerName",
        "runtimeClassName",
        "imagePullSecrets",
        "tolerations",
        "initContainers",
    ):
        assert pspec[field] == PRODUCTION_TEMPLATE["spec"][field], field
    assert pspec["affinity"] == PRODUCTION_TEMPLATE["spec"]["affinity"]  # a worker: nothing of ours added
    assert pspec["restartPolicy"] == "Never" and pspec["automountServiceAccountToken"] is False
    # The trainer first (kubectl's default container), the sidecar as given.
    assert [c["name"] for c in pspec["containers"]] == ["trainer", "log-shipper"]
    assert pspec["containers"][1] == PRODUCTION_TEMPLATE["spec"]["containers"][0]
    trainer = _trainer(pod)
    assert trainer["image"] == "trainer:test"
    names = [e["name"] for e in trainer["env"]]
    assert names[0] == wire.ENV_JOB_NAME and names[-2:] == ["NCCL_IB_HCA", "NODE"]
    assert trainer["env"][-1]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert trainer["resources"] == {
        "limits": {"rdma/ib": "1", "memory": "512Gi", "nvidia.com/gpu": "8"},
        "requests": {"cpu": "32", "nvidia.com/gpu": "8"},
    }
    assert [p["containerPort"] for p in trainer["ports"]] == [wire.AGENT_PORT, wire.RENDEZVOUS_PORT, 5678]
    assert trainer["volumeMounts"] == [
        {"name": "data", "mountPath": "/data", "readOnly": True},
        {"name": "megatron-shm", "mountPath": "/dev/shm"},
    ]
    assert pspec["volumes"] == [
        PRODUCTION_TEMPLATE["spec"]["volumes"][0],
        {"name": "megatron-shm", "emptyDir": {"medium": "Memory"}},
    ]
    # RDMA pins memory: IPC_LOCK, and nothing else, on top of dropping every capability.
    assert trainer["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    # The trainer does not need the pod template: it stays out of the spec it is given.
    env = {e["name"]: e for e in trainer["env"]}
    assert "template" not in json.loads(env[wire.ENV_JOB_SPEC]["value"])


def test_a_spare_adds_its_anti_affinity_to_the_templates() -> None:
    pod = _pod(
        wire.ROLE_SPARE,
        template=PRODUCTION_TEMPLATE,
        gpus_per_pod=8,
        tp=8,
        replicas=1,
        failure_domain={"topologyKey": "topology.kubernetes.io/zone"},
    )
    affinity = pod["spec"]["affinity"]
    assert affinity["nodeAffinity"] == PRODUCTION_TEMPLATE["spec"]["affinity"]["nodeAffinity"]
    terms = affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert [(t["weight"], t["podAffinityTerm"]["topologyKey"]) for t in terms] == [
        (100, "kubernetes.io/hostname"),
        (50, "topology.kubernetes.io/zone"),
    ]
    assert "podAntiAffinity" not in PRODUCTION_TEMPLATE["spec"]["affinity"]  # the spec was not modified


def test_shorthands_land_where_the_templates_fields_would() -> None:
    pod = _pod(
        resources={"limits": {"rdma/hca_shared_devices_a": 1}},
        env=[{"name": "A", "value": "1"}],
        node_selector={"pool": "h100"},
        tolerations=[{"key": "gpu", "operator": "Exists"}],
        image_pull_policy="Always",
    )
    trainer = _trainer(pod)
    assert trainer["resources"]["limits"] == {"rdma/hca_shared_devices_a": "1", "nvidia.com/gpu": "1"}
    assert trainer["env"][-1] == {"name": "A", "value": "1"} and trainer["imagePullPolicy"] == "Always"
    assert trainer["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert pod["spec"]["nodeSelector"] == {"pool": "h100"}
    assert pod["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    same = _pod(
        template={
            "spec": {
                "nodeSelector": {"pool": "h100"},
                "tolerations": [{"key": "gpu", "operator": "Exists"}],
                "containers": [
                    {
                        "name": "trainer",
                        "imagePullPolicy": "Always",
                        "env": [{"name": "A", "value": "1"}],
                        "resources": {"limits": {"rdma/hca_shared_devices_a": 1}},
                    }
                ],
            }
        }
    )
    for each in (same, pod):  # the spec the trainer reads differs, as its fields do
        _trainer(each)["env"] = [e for e in _trainer(each)["env"] if e["name"] != wire.ENV_JOB_SPEC]
    assert same == pod


def test_shm_is_sized_or_replaced_by_the_templates() -> None:
    sized = _pod(shm_size="64Gi")
    assert sized["spec"]["volumes"] == [{"name": "megatron-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}]
    own = {
        "spec": {
            "volumes": [{"name": "shm", "hostPath": {"path": "/dev/shm"}}],
            "containers": [{"name": "trainer", "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}],
        }
    }
    pod = _pod(template=own)
    assert pod["spec"]["volumes"] == own["spec"]["volumes"]
    assert _trainer(pod)["volumeMounts"] == [{"name": "shm", "mountPath": "/dev/shm"}]


def test_the_template_relaxes_secure_defaults_field_by_field() -> None:
    pod = _pod(
        template={
            "spec": {
                "securityContext": {"runAsNonRoot": False, "runAsUser": 0, "fsGroup": 1000},
                "containers": [
                    {
                        "name": "trainer",
                        "securityContext": {"allowPrivilegeEscalation": True, "capabilities": {"add": ["SYS_PTRACE"]}},
                    }
                ],
            }
        },
        resources={},
    )
    assert pod["spec"]["securityContext"] == {
        "runAsNonRoot": False,
        "runAsUser": 0,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert _trainer(pod)["securityContext"] == {
        "allowPrivilegeEscalation": True,
        "capabilities": {"drop": ["ALL"], "add": ["SYS_PTRACE"]},
    }
    rdma = _pod(
        template={
            "spec": {
                "containers": [
                    {
                        "name": "trainer",
                        "resources": {"limits": {"rdma/ib": 1}},
                        "securityContext": {"capabilities": {"add": ["SYS_PTRACE"], "drop": []}},
                    }
                ]
            }
        }
    )
    assert _trainer(rdma)["securityContext"]["capabilities"] == {"drop": [], "add": ["IPC_LOCK", "SYS_PTRACE"]}


def test_host_network_resolves_the_jobs_service() -> None:
    pod = _pod(template={"spec": {"hostNetwork": True}})
    assert pod["spec"]["hostNetwork"] is True and pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
    given = _pod(template={"spec": {"hostNetwork": True, "dnsPolicy": "Default"}})
    assert given["spec"]["dnsPolicy"] == "Default"


def test_pods_spread_over_nodes_and_the_failure_domain_label() -> None:
    pod = _pod(failure_domain={"topologyKey": "example.com/rack", "whenUnsatisfiable": "DoNotSchedule"})
    spread = pod["spec"]["topologySpreadConstraints"]
    assert [(c["topologyKey"], c["whenUnsatisfiable"], c["maxSkew"]) for c in spread] == [
        ("kubernetes.io/hostname", "DoNotSchedule", 1),
        ("example.com/rack", "DoNotSchedule", 1),
    ]
    assert all(c["labelSelector"] == {"matchLabels": {wire.LABEL_JOB: "llm"}} for c in spread)
    # The template's own constraint on a key wins over ours.
    mine = {
        "maxSkew": 2,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": {"team": "llm"}},
    }
    pod = _pod(template={"spec": {"topologySpreadConstraints": [mine]}})
    assert pod["spec"]["topologySpreadConstraints"] == [mine]
