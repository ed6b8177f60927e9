"""The CRD on a real kube-apiserver: the example job is accepted and shows in ``kubectl get``
with its printer columns; the Llama example is accepted with its model fields left as given (the
preset resolves them, not schema defaults); the production example (a pod template with RDMA,
volumes, a priority class) is accepted with its template kept as given; every job of ``BAD_JOBS``
(bad fields, pod templates that would break the operator, shorthands set twice, and names too
long for a label or not a DNS-1035 label) is refused by ``kubectl apply`` with a message naming
the field; quantities in their usual forms, GPUs equal to gpusPerPod (in spec.resources and in the
template's trainer container), a template that clashes with nothing and a 63-character name are
accepted; a mixture-of-experts job with expert parallelism, and the MoE example, are accepted; tp, pp, cp, ep and
gpusPerPod cannot change on a live job while replicas can; the status subresource accepts the
operator's status and ignores status sent with the spec."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from localcluster.cluster import LocalCluster
from megatronjob_builders import (
    BAD_JOBS,
    GOOD_RESOURCES,
    GOOD_TEMPLATE,
    LLAMA_EXAMPLE,
    LONGEST_NAME,
    MOE_EXAMPLE,
    MOE_TP2,
    PRODUCTION_EXAMPLE,
    BadJob,
    example_job,
    with_spec,
)

pytestmark = pytest.mark.cluster


def apply(cluster: LocalCluster, namespace: str, job: dict[str, Any]) -> tuple[int, str]:
    proc = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(job), check=False)
    return proc.returncode, proc.stdout + proc.stderr


def test_example_is_accepted_and_listed(local_cluster: LocalCluster, namespace: str) -> None:
    code, out = apply(local_cluster, namespace, example_job())
    assert code == 0, out
    got = json.loads(local_cluster.kubectl("get", "mj", "gpt-demo", "-n", namespace, "-o", "json").stdout)
    assert got["spec"]["cp"] == 1, "defaults from the schema were not applied"
    assert got["spec"]["failureDetection"]["collectiveTimeoutSeconds"] == 30
    table = local_cluster.kubectl("get", "megatronjobs", "-n", namespace).stdout
    assert table.split()[:7] == ["NAME", "PHASE", "MESH", "READY", "SPARES", "RECOVERIES", "AGE"], table


def test_llama_example_is_accepted_without_model_defaults(local_cluster: LocalCluster, namespace: str) -> None:
    code, out = apply(local_cluster, namespace, example_job("llama", LLAMA_EXAMPLE))
    assert code == 0, out
    got = json.loads(local_cluster.kubectl("get", "mj", "llama", "-n", namespace, "-o", "json").stdout)
    # The API server must not fill model fields: a default would override the preset's value.
    assert got["spec"]["model"] == {"preset": "llama3-8b", "seqLength": 4096, "sequenceParallel": True}
    assert got["spec"]["training"]["lrSchedule"]["warmupSteps"] == 2000


def test_production_example_is_accepted_with_its_template_as_given(local_cluster: LocalCluster, namespace: str) -> None:
    job = example_job("llama3-8b", PRODUCTION_EXAMPLE)
    code, out = apply(local_cluster, namespace, job)
    assert code == 0, out
    got = json.loads(local_cluster.kubectl("get", "mj", "llama3-8b", "-n", namespace, "-o", "json").stdout)
    # Fields the CRD does not type (priorityClassName, imagePullSecrets, the PVC source) are kept.
    assert got["spec"]["template"] == job["spec"]["template"]


@pytest.mark.parametrize("bad", BAD_JOBS, ids=lambda b: b.name)
def test_bad_job_is_refused_naming_the_field(local_cluster: LocalCluster, namespace: str, bad: BadJob) -> None:
    job = bad.job()
    code, out = apply(local_cluster, namespace, job)
    assert code != 0, f"{bad.name} was accepted:\n{out}"
    assert bad.expect in out, f"{bad.name}: refusal does not name the field:\n{out}"
    name = job["metadata"]["name"]
    assert local_cluster.kubectl("get", "mj", name, "-n", namespace, check=False).returncode != 0


def test_quantities_gpus_matching_gpus_per_pod_and_a_63_character_name_are_accepted(
    local_cluster: LocalCluster, namespace: str
) -> None:
    job = with_spec(example_job(LONGEST_NAME), resources=GOOD_RESOURCES)
    code, out = apply(local_cluster, namespace, job)
    assert code == 0, out


def test_a_template_that_clashes_with_nothing_is_accepted(local_cluster: LocalCluster, namespace: str) -> None:
    code, out = apply(local_cluster, namespace, with_spec(example_job("templated"), **GOOD_TEMPLATE))
    assert code == 0, out


def test_expert_parallel_job_is_accepted_and_ep_is_immutable(local_cluster: LocalCluster, namespace: str) -> None:
    job = with_spec(example_job("moe"), ep=2, **MOE_TP2)
    code, out = apply(local_cluster, namespace, job)
    assert code == 0, out
    got = json.loads(local_cluster.kubectl("get", "mj", "moe", "-n", namespace, "-o", "json").stdout)
    assert got["spec"]["ep"] == 2 and got["spec"]["model"]["numExperts"] == 8
    code, out = apply(local_cluster, namespace, with_spec(job, ep=1))
    assert code != 0 and "spec.ep is immutable" in out, out
    code, out = apply(local_cluster, namespace, example_job("moe-example", MOE_EXAMPLE))
    assert code == 0, out


@pytest.mark.parametrize(
    ("field", "value"), [("tp", 1), ("pp", 2), ("cp", 2), ("gpusPerPod", 4)], ids=["tp", "pp", "cp", "gpusPerPod"]
)
def test_parallel_layout_is_immutable(local_cluster: LocalCluster, namespace: str, field: str, value: int) -> None:
    job = example_job("live")
    assert apply(local_cluster, namespace, job)[0] == 0
    code, out = apply(local_cluster, namespace, with_spec(job, **{field: value}))
    assert code != 0 and f"spec.{field} is immutable" in out, out
    code, out = apply(local_cluster, namespace, with_spec(job, replicas=6))
    assert code == 0, f"replicas should stay mutable:\n{out}"


def test_status_subresource(local_cluster: LocalCluster, namespace: str) -> None:
    job = example_job("st")
    job["status"] = {"phase": "Running"}
    assert apply(local_cluster, namespace, job)[0] == 0
    path = f"/apis/megatron.dev/v1alpha1/namespaces/{namespace}/megatronjobs/st"
    _, obj = local_cluster.request("GET", path)
    assert "status" not in obj or obj["status"].get("phase") != "Running", "status must only change via /status"
    status = {"phase": "Running", "mesh": "4x2x1", "ready": "4/4", "sparesReady": 1, "recoveries": 0, "epoch": 1}
    code, body = local_cluster.request(
        "PATCH", path + "/status", {"status": status}, content_type="application/merge-patch+json"
    )
    assert code == 200, body
    row = local_cluster.kubectl("get", "mj", "st", "-n", namespace, "--no-headers").stdout.split()
    assert row[1:6] == ["Running", "4x2x1", "4/4", "1", "0"], row
    code, body = local_cluster.request(
        "PATCH", path + "/status", {"status": {"phase": "Exploded"}}, content_type="application/merge-patch+json"
    )
    assert code == 422 and "status.phase" in json.dumps(body), body
