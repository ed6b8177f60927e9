"""Builders of a job's children (``megatron_operator.builders``), pure.

Scenarios: worker and spare pods come from one template (only the role differs), request
``nvidia.com/gpu`` = gpusPerPod, restartPolicy Never, no service-account token, the env the agent
reads (token from the Secret, pod name/IP from the downward API, spec as JSON), owner reference and
labels; user env never overrides ours; the checkpoint PVC is mounted; a bad role is refused; the
headless Service publishes not-ready pods; the Secret holds the token it is given; long names stay valid
DNS labels.
"""

from __future__ import annotations

import base64
import json

import pytest
from operator_factories import make_spec

from megatron_contract import wire
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
    assert worker == spare
    assert [e for e in env_w if e["name"] != wire.ENV_POD_ROLE] == [e for e in env_s if e["name"] != wire.ENV_POD_ROLE]


def test_pod_shape() -> None:
    spec = make_spec(replicas=2, gpus_per_pod=4, tp=4, resources={"requests": {"cpu": 8}, "limits": {"memory": "64Gi"}},
                     node_selector={"pool": "h100"})
    pod = builders.build_pod(JOB, spec, serial=7, role=wire.ROLE_WORKER, operator_url="http://op:29500")
    meta, pspec = pod["metadata"], pod["spec"]
    assert meta["name"] == "llm-7" and meta["namespace"] == "team-a"
    assert meta["labels"] == {wire.LABEL_JOB: "llm", wire.LABEL_ROLE: "worker", wire.LABEL_POD_INDEX: "7"}
    assert meta["ownerReferences"] == [{"apiVersion": wire.API_VERSION, "kind": wire.KIND, "name": "llm",
                                        "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
    assert pspec["restartPolicy"] == "Never"
    assert pspec["automountServiceAccountToken"] is False
    assert pspec["nodeSelector"] == {"pool": "h100"}
    assert pspec["subdomain"] == "llm" and pspec["hostname"] == "llm-7"
    container = pspec["containers"][0]
    assert container["resources"] == {"requests": {"cpu": "8", "nvidia.com/gpu": "4"},
                                      "limits": {"memory": "64Gi", "nvidia.com/gpu": "4"}}
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


def test_user_env_never_overrides_ours() -> None:
    spec = make_spec(env=[{"name": wire.ENV_JOB_UID, "value": "evil"}, {"name": "NCCL_DEBUG", "value": "INFO"}])
    pod = builders.build_pod(JOB, spec, serial=0, role=wire.ROLE_SPARE, operator_url="u")
    env = [(e["name"], e.get("value")) for e in pod["spec"]["containers"][0]["env"]]
    assert (wire.ENV_JOB_UID, "uid-1") in env and (wire.ENV_JOB_UID, "evil") not in env
    assert ("NCCL_DEBUG", "INFO") in env


def test_checkpoint_volume_is_mounted() -> None:
    spec = make_spec(checkpoint={"path": "/ckpt", "volumeClaimName": "ckpt-pvc"})
    pod = builders.build_pod(JOB, spec, serial=0, role=wire.ROLE_WORKER, operator_url="u")
    assert pod["spec"]["volumes"] == [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt-pvc"}}]
    assert pod["spec"]["containers"][0]["volumeMounts"] == [{"name": "checkpoints", "mountPath": "/ckpt"}]


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


def test_long_names_stay_dns_labels() -> None:
    job = JobRef("x" * 80, "ns", "uid")
    assert len(builders.service_name(job)) <= 63
    assert builders.service_name(job) != builders.service_name(JobRef("x" * 79 + "y", "ns", "uid"))
    pod = builders.build_pod(job, make_spec(), serial=1, role=wire.ROLE_WORKER, operator_url="u")
    assert "hostname" not in pod["spec"]
