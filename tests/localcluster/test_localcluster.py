"""The local control plane itself: a start brings up a working API server with fake GPU nodes
that schedule and run GPU pods, a stop leaves no process and frees the port; a taken port and a
failed build are reported clearly; the CLI's up/down round trip; nodes can be made NotReady; its
kubeconfig names certificate files, so a client of it (the kubernetes package, which the operator
logs in with) writes no temporary copies of them, where one with the same certificates embedded
does (a killed process never removes them)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from localcluster import build
from localcluster.cluster import ClusterError, LocalCluster, port_in_use
from localcluster.waiting import wait_for

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]


def test_gpu_pod_is_scheduled_and_runs_on_a_fake_node(local_cluster: LocalCluster, namespace: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gpu-pod"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "8"}}}],
        },
    }
    code, body = local_cluster.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod)
    assert code == 201, body

    def running() -> bool:
        _, p = local_cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods/gpu-pod")
        return p.get("status", {}).get("phase") == "Running"

    wait_for(running, 30, "the GPU pod to run", interval=0.1)
    _, p = local_cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods/gpu-pod")
    assert p["spec"]["nodeName"].startswith("gpu-")
    assert p["status"]["podIP"].startswith("127."), "pod IPs must be on loopback so tests can serve at them"


def test_node_can_be_made_not_ready_and_ready_again(local_cluster: LocalCluster) -> None:
    [name] = local_cluster.add_gpu_nodes(1, prefix="flaky")
    local_cluster.set_node_ready(name, False)
    assert not local_cluster.node_ready(name)
    local_cluster.set_node_ready(name, True)
    assert local_cluster.node_ready(name)


_LIST_NAMESPACES = """
import sys, time
from kubernetes import client, config
api = client.CoreV1Api(config.new_client_from_config(sys.argv[1]))
print(len(api.list_namespace().items), flush=True)
time.sleep(60)
"""


def _client_leaves(kubeconfig: Path, tmp: Path) -> list[str]:
    """What a kubernetes client of ``kubeconfig`` that is killed once it has listed the namespaces
    leaves in its temporary directory ``tmp`` (one that exits removes its temporary files)."""
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    cmd = [sys.executable, "-c", _LIST_NAMESPACES, str(kubeconfig)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip().isdigit(), proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
        proc.wait(timeout=30)
    return sorted(p.name for p in tmp.iterdir())


def test_a_client_of_the_kubeconfig_leaves_no_temporary_files(local_cluster: LocalCluster, tmp_path: Path) -> None:
    import base64

    import yaml

    assert _client_leaves(local_cluster.kubeconfig, tmp_path / "files") == []
    # The same identity embedded, as kubeconfigs often carry it: the client writes it out (the test
    # above could not pass by a client that never writes).
    config = yaml.safe_load(local_cluster.kubeconfig.read_text())
    for entry, keys in (
        (config["clusters"][0]["cluster"], ["certificate-authority"]),
        (config["users"][0]["user"], ["client-certificate", "client-key"]),
    ):
        for key in keys:
            entry[f"{key}-data"] = base64.b64encode(Path(entry.pop(key)).read_bytes()).decode()
    embedded = tmp_path / "embedded"
    embedded.write_text(yaml.safe_dump(config))
    assert _client_leaves(embedded, tmp_path / "data") != []


def test_stop_leaves_no_process_and_frees_the_port() -> None:
    cluster = LocalCluster(kwok=False)
    started = time.monotonic()
    cluster.start()
    print(f"start with cached binaries: {time.monotonic() - started:.1f} s")
    pids = [p.pid for p in cluster.procs.values()]
    port = cluster.apiserver_port
    assert port is not None and port_in_use(port)
    workdir = cluster.workdir
    cluster.stop()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"process {pid} survived stop()"
    assert not port_in_use(port)
    assert not workdir.exists()


def test_taken_port_is_reported() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cluster = LocalCluster(apiserver_port=port, kwok=False)
        with pytest.raises(ClusterError, match=f"port {port} for kube-apiserver is taken"):
            cluster.start()
        assert not cluster.workdir.exists(), "a failed start left the folder it made"


def test_failed_build_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.ENV_CACHE_DIR, str(tmp_path))  # nothing cached here
    monkeypatch.setenv("PATH", "/nonexistent")  # and no Go toolchain
    cluster = LocalCluster(kwok=False)
    with pytest.raises(ClusterError, match="Go toolchain"):
        cluster.start()
    assert not cluster.workdir.exists(), "a failed start left the folder it made"


def test_cli_up_and_down(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO / p) for p in ("contract", "localcluster"))}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "localcluster"]
    up = subprocess.run(
        [*cmd, "up", "--dir", str(tmp_path), "--port", str(port), "--nodes", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    try:
        assert up.returncode == 0, up.stderr
        assert f"KUBECONFIG={tmp_path}/kubeconfig" in up.stdout
        nodes = subprocess.run(
            ["kubectl", f"--kubeconfig={tmp_path}/kubeconfig", "get", "nodes", "--no-headers"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert nodes.stdout.count(" Ready ") == 2, nodes.stdout
        again = subprocess.run([*cmd, "up", "--dir", str(tmp_path)], env=env, capture_output=True, text=True)
        assert again.returncode == 1 and "already up" in again.stderr
    finally:
        down = subprocess.run(
            [*cmd, "down", "--dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
        )
    assert down.returncode == 0, down.stderr
    assert not port_in_use(port)
