"""The node agent runs pods bound to its nodes as real local processes: environment with
downward-API and Secret values, a loopback pod IP and a temporary folder of its own, Running then Succeeded or Failed
with the exit code (137 for SIGKILL), and the process killed and the pod removed on delete; a pod
whose Secret is missing waits Pending (CreateContainerConfigError) and runs once it appears; a
production-shaped pod (a sidecar, an init container, volumes, a security context) runs the container
``kubectl.kubernetes.io/default-container`` names, and a pod of several containers naming none fails
saying so."""

from __future__ import annotations

import base64
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from localcluster.cluster import LocalCluster
from localcluster.nodeagent import (
    DEFAULT_CONTAINER_ANNOTATION,
    LOCAL_NODE_TOLERATION,
    NODE_POOL_LABEL,
    NodeAgent,
)
from localcluster.waiting import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def node_agent(local_cluster: LocalCluster) -> NodeAgent:
    return local_cluster.add_process_nodes(1, gpus_per_node=4, prefix="proc")


def make_pod(name: str, script: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "nodeSelector": {NODE_POOL_LABEL: "proc"},  # this module's node, not another test's
            "tolerations": [LOCAL_NODE_TOLERATION],
            "containers": [
                {
                    "name": "main",
                    "image": "trainer",
                    "command": ["python", "-c", script],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    "env": [
                        {"name": "PLAIN", "value": "v"},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "tok", "key": "token"}}},
                    ],
                }
            ],
        },
    }


def wait_pod(cluster: LocalCluster, ns: str, name: str, phase: str, timeout: float = 60) -> dict[str, Any]:
    pod: dict[str, Any] = {}

    def in_phase() -> dict[str, Any] | None:
        nonlocal pod
        code, pod = cluster.request("GET", f"/api/v1/namespaces/{ns}/pods/{name}")
        return pod if code == 200 and pod["status"].get("phase") == phase else None

    return wait_for(
        in_phase, timeout, f"pod {name} {phase}", interval=0.1, details=lambda: json.dumps(pod.get("status"))[:800]
    )


def create(cluster: LocalCluster, ns: str, obj: dict[str, Any], kind: str) -> None:
    code, body = cluster.request("POST", f"/api/v1/namespaces/{ns}/{kind}", obj)
    assert code == 201, body


def test_pod_runs_as_a_process_with_its_environment(
    local_cluster: LocalCluster, node_agent: NodeAgent, namespace: str, tmp_path: Path
) -> None:
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "tok"},
        "data": {"token": base64.b64encode(b"s3cret").decode()},
    }
    create(local_cluster, namespace, secret, "secrets")
    out = tmp_path / "env.json"
    script = f"import json,os; json.dump(dict(os.environ), open({str(out)!r}, 'w'))"
    create(local_cluster, namespace, make_pod("envpod", script), "pods")
    pod = wait_pod(local_cluster, namespace, "envpod", "Succeeded")
    env = json.loads(out.read_text())
    assert env["PLAIN"] == "v" and env["POD_NAME"] == "envpod" and env["TOKEN"] == "s3cret"
    assert env["POD_IP"] == pod["status"]["podIP"] and env["POD_IP"].startswith(node_agent.ip_prefix + ".")
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    # A temporary folder of its own beside its log, as a container has its own /tmp.
    assert env["TMPDIR"] == str(node_agent.logdir / f"{namespace}_envpod.tmp")
    assert Path(env["TMPDIR"]).is_dir()


def test_killed_process_fails_the_pod_with_137(
    local_cluster: LocalCluster, node_agent: NodeAgent, namespace: str
) -> None:
    pod = make_pod("victim", "import time; time.sleep(600)")
    pod["spec"]["containers"][0]["env"] = []
    create(local_cluster, namespace, pod, "pods")
    wait_pod(local_cluster, namespace, "victim", "Running")
    node_agent.kill_pod_process(namespace, "victim", signal.SIGKILL)
    failed = wait_pod(local_cluster, namespace, "victim", "Failed")
    assert failed["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137


def test_deleting_the_pod_kills_its_process(
    local_cluster: LocalCluster, node_agent: NodeAgent, namespace: str, tmp_path: Path
) -> None:
    # The pod's process starts a child that leads a process group of its own (as trainer workers
    # do): deleting the pod must end it too.
    child_pid = tmp_path / "child.pid"
    script = (
        "import subprocess, time; "
        "child = subprocess.Popen(['sleep', '600'], process_group=0); "
        f"open({str(child_pid)!r}, 'w').write(str(child.pid)); time.sleep(600)"
    )
    pod = make_pod("doomed", script)
    pod["spec"]["containers"][0]["env"] = []
    create(local_cluster, namespace, pod, "pods")
    wait_pod(local_cluster, namespace, "doomed", "Running")
    [running] = [p for p in node_agent.pods.values() if p.name == "doomed"]
    child = int(wait_for(lambda: child_pid.exists() and child_pid.read_text(), 30, "the pod to start its child"))
    code, _ = local_cluster.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/doomed")
    assert code == 200
    deleted = time.monotonic()
    wait_for(
        lambda: local_cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods/doomed")[0] == 404,
        30,
        "the pod removed after delete",
        interval=0.1,
    )
    assert running.proc.poll() is not None, "process survived its pod"
    wait_for(
        lambda: not _running(child),
        30 - (time.monotonic() - deleted),  # the pod and its child share 30 s from the delete
        f"the pod's child {child} (a group of its own) to end with the pod",
        interval=0.1,
    )


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def test_pod_without_command_fails_clearly(local_cluster: LocalCluster, node_agent: NodeAgent, namespace: str) -> None:
    pod = make_pod("nocmd", "")
    del pod["spec"]["containers"][0]["command"]
    pod["spec"]["containers"][0]["env"] = []
    create(local_cluster, namespace, pod, "pods")
    failed = wait_pod(local_cluster, namespace, "nocmd", "Failed")
    assert "no command" in failed["status"]["message"]


def test_pod_waits_for_its_missing_secret_then_runs(
    local_cluster: LocalCluster, node_agent: NodeAgent, namespace: str
) -> None:
    create(local_cluster, namespace, make_pod("patient", "import os; assert os.environ['TOKEN'] == 'late'"), "pods")
    pod: dict[str, Any] = {}

    def waiting_container() -> list[Any] | None:  # Pending with the reason kubelet gives, not Failed
        nonlocal pod
        pod = local_cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods/patient")[1]
        waiting = [(cs.get("state") or {}).get("waiting") for cs in pod["status"].get("containerStatuses") or []]
        return waiting if waiting and waiting[0] else None

    waiting = wait_for(
        waiting_container,
        30,
        "the pod to wait",
        interval=0.1,
        details=lambda: json.dumps(pod.get("status"))[:800],
    )
    assert pod["status"]["phase"] == "Pending", pod["status"]
    assert waiting[0]["reason"] == "CreateContainerConfigError" and 'secret "tok" not found' in waiting[0]["message"]
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "tok"},
        "data": {"token": base64.b64encode(b"late").decode()},
    }
    create(local_cluster, namespace, secret, "secrets")
    done = wait_pod(local_cluster, namespace, "patient", "Succeeded")
    assert done["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0


def test_the_default_container_of_a_pod_with_sidecars_runs(
    local_cluster: LocalCluster, node_agent: NodeAgent, namespace: str
) -> None:
    pod = make_pod("sidecars", "import os; assert os.environ['PLAIN'] == 'v'")
    pod["spec"]["containers"][0]["env"] = [{"name": "PLAIN", "value": "v"}]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "shm", "mountPath": "/dev/shm"}]
    pod["spec"]["containers"].append({"name": "log-shipper", "image": "fluent-bit", "command": ["false"]})
    pod["spec"]["initContainers"] = [{"name": "fetch", "image": "busybox", "command": ["false"]}]
    pod["spec"]["volumes"] = [{"name": "shm", "emptyDir": {"medium": "Memory"}}]
    pod["spec"]["securityContext"] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    pod["metadata"]["annotations"] = {DEFAULT_CONTAINER_ANNOTATION: "main"}
    create(local_cluster, namespace, pod, "pods")
    done = wait_pod(local_cluster, namespace, "sidecars", "Succeeded")
    assert [cs["name"] for cs in done["status"]["containerStatuses"]] == ["main"]
    del pod["metadata"]["annotations"]
    pod["metadata"]["name"] = "unnamed"
    create(local_cluster, namespace, pod, "pods")
    failed = wait_pod(local_cluster, namespace, "unnamed", "Failed")
    assert DEFAULT_CONTAINER_ANNOTATION in failed["status"]["message"]


def test_two_node_agents_never_give_two_pods_one_address(local_cluster: LocalCluster, node_agent: NodeAgent) -> None:
    """Agents of one cluster share the pod range 127.P: each must hand out its own addresses (two
    pools running at once once gave a pod the address, and so the control port, of another)."""
    other = local_cluster.add_process_nodes(1, gpus_per_node=1, prefix="proc2")
    first = {node_agent._allocate_ip() for _ in range(300)}
    second = {other._allocate_ip() for _ in range(300)}
    assert len(first) == len(second) == 300
    assert not first & second
    assert all(ip.startswith(node_agent.ip_prefix + ".") for ip in first | second)
