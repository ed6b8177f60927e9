"""The node agent: the slice of kubelet that end-to-end runs need.

Pods that the scheduler binds to this agent's nodes run as local processes: the container's
(the one ``kubectl.kubernetes.io/default-container`` names, when a pod has sidecars, which are not
run, nor are init containers; volumes, security contexts and resources are not applied either)
command and args with its environment (plain values, downward-API ``fieldRef`` and
``secretKeyRef`` resolved), a loopback pod IP of its own (``127.P.x.y``, so every pod can bind
the same ports), status reported as Running, then Succeeded or Failed with the exit code (128+N
for a signal, as container runtimes do), and every process of the pod killed when it is deleted.
A pod is a session (its command starts one): processes that lead process groups of their own in
it (the trainer's workers do) still belong to the pod, as they would to its container.
A pod whose Secret (or key) is missing stays Pending with its container waiting for
``CreateContainerConfigError`` and is retried every second until it appears, as kubelet does.
Nodes stay Ready through Lease renewals. ``python``/``python3`` as the command run with this
agent's interpreter, so pods use the project's environment.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from localcluster.api import ApiError, KubeApi

GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_CONTAINER_ANNOTATION = "kubectl.kubernetes.io/default-container"
LOCAL_NODE_LABEL = "megatron.dev/local-node"
#: The nodes of one NodeAgent share this label's value, so a test can keep its pods on its own nodes.
NODE_POOL_LABEL = "megatron.dev/node-pool"
#: Process nodes are tainted so that only pods meant to run as processes land there (pods of
#: tests that use kwok nodes would otherwise be scheduled here and fail to start).
LOCAL_NODE_TAINT = {"key": LOCAL_NODE_LABEL, "value": "true", "effect": "NoSchedule"}
LOCAL_NODE_TOLERATION = {"key": LOCAL_NODE_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"}
#: Second octets of the loopback ranges (127.P.x.y) pod IPs of process nodes come from.
PROCESS_POD_OCTETS = range(150, 236)
LEASE_SECONDS = 40
RENEW_SECONDS = 10
#: How often a pod waiting for a missing Secret is tried again.
CONFIG_RETRY_SECONDS = 1.0
#: Variables a pod inherits from the agent (so the project's Python and paths work inside it).
# MEGATRON_TEST_SESSION: the test suite's mark on every process it starts (tests/leftover_processes.py).
PASSTHROUGH_ENV = ("PATH", "PYTHONPATH", "HOME", "LANG", "MEGATRON_OPERATOR_CACHE", "MEGATRON_TEST_SESSION")


def signal_session(sid: int, sig: int) -> None:
    """Send ``sig`` to every process of session ``sid`` (a pod: its main process started it)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sid, sig)  # the main group first, then the groups its processes made
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getsid(int(entry.name)) == sid:
                os.kill(int(entry.name), sig)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _log(msg: str) -> None:
    print(f"[nodeagent] {msg}", file=sys.stderr, flush=True)


def main_container(pod: dict[str, Any]) -> dict[str, Any]:
    """The container a process node runs: the one the ``kubectl.kubernetes.io/default-container``
    annotation names, else the only one. Its sidecars and init containers are not run (their images
    are nothing here); a pod of several containers that names none cannot run."""
    containers = pod["spec"]["containers"]
    wanted = (pod["metadata"].get("annotations") or {}).get(DEFAULT_CONTAINER_ANNOTATION)
    if wanted is not None:
        for container in containers:
            if container["name"] == wanted:
                return dict(container)
        raise ValueError(f"the {DEFAULT_CONTAINER_ANNOTATION} annotation names no container: {wanted}")
    if len(containers) != 1:
        raise ValueError(
            f"the local node agent runs one container per pod: name it with the {DEFAULT_CONTAINER_ANNOTATION} "
            "annotation"
        )
    return dict(containers[0])


class ContainerConfigError(RuntimeError):
    """The container's environment cannot be made yet (a Secret or a key of it is missing)."""


@dataclasses.dataclass
class RunningPod:
    namespace: str
    name: str
    uid: str
    ip: str
    proc: subprocess.Popen[bytes]
    deleting: bool = False


class NodeAgent:
    """Runs the pods of ``nodes`` as local processes until :meth:`stop`."""

    def __init__(
        self,
        kubeconfig: Path,
        nodes: list[str],
        workdir: Path,
        gpus_per_node: int = 8,
        pool: str = "local",
        ip_prefix: str = "127.150",
        first_ip: int = 1,
    ) -> None:
        self.api = KubeApi(kubeconfig)
        self.ip_prefix = ip_prefix
        self.pool = pool
        self.nodes = set(nodes)
        self.node_list = list(nodes)
        self.gpus_per_node = gpus_per_node
        self.logdir = Path(workdir) / "pods"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.pods: dict[str, RunningPod] = {}  # by pod uid
        self._finished: set[str] = set()
        self._config_waiting: dict[str, dict[str, Any]] = {}  # pod uid -> body, retried until its Secret exists
        self._waiting_ip: dict[str, str] = {}  # the address a waiting pod keeps across its retries
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Agents of one cluster share ip_prefix: each hands out its own block, from first_ip on.
        self._next_ip = first_ip
        self._threads: list[threading.Thread] = []

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> NodeAgent:
        for name in self.node_list:
            self._register_node(name)
        for target in (self._renew_leases, self._watch_pods, self._retry_config):
            t = threading.Thread(target=target, name=f"nodeagent-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            running = list(self.pods.values())
        for pod in running:
            self._kill(pod, grace=2.0)

    # -- nodes ------------------------------------------------------------------------------------

    def _register_node(self, name: str) -> None:
        capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", GPU_RESOURCE: str(self.gpus_per_node)}
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {LOCAL_NODE_LABEL: "true", NODE_POOL_LABEL: self.pool, "kubernetes.io/hostname": name},
            },
            "spec": {"taints": [LOCAL_NODE_TAINT]},
        }
        with contextlib.suppress(ApiError):
            self.api.request("POST", "/api/v1/nodes", node)
        self.api.request(
            "PATCH",
            f"/api/v1/nodes/{name}/status",
            {
                "status": {
                    "capacity": capacity,
                    "allocatable": capacity,
                    "addresses": [
                        {"type": "InternalIP", "address": "127.0.0.1"},
                        {"type": "Hostname", "address": name},
                    ],
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "reason": "KubeletReady",
                            "message": "local node agent is running",
                            "lastHeartbeatTime": _now(),
                            "lastTransitionTime": _now(),
                        }
                    ],
                }
            },
            patch="strategic",
        )
        self._renew_lease(name)

    def set_ready(self, ready: bool, names: list[str] | None = None) -> None:
        """Report this agent's nodes (or ``names``) Ready or NotReady, while their pods keep running:
        what a kubelet cut off from the API server looks like to everyone else."""
        cond = {
            "type": "Ready",
            "status": "True" if ready else "False",
            "reason": "KubeletReady" if ready else "KubeletNotReady",
            "message": "local node agent is running" if ready else "made NotReady by a test; pods keep running",
            "lastHeartbeatTime": _now(),
            "lastTransitionTime": _now(),
        }
        for name in names or self.node_list:
            self.api.request(
                "PATCH", f"/api/v1/nodes/{name}/status", {"status": {"conditions": [cond]}}, patch="strategic"
            )

    def _renew_lease(self, name: str) -> None:
        lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "namespace": "kube-node-lease"},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": _now_micro()},
        }
        try:
            self.api.request(
                "PATCH",
                f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}",
                {"spec": lease["spec"]},
            )
        except ApiError as err:
            if err.status != 404:
                raise
            self.api.request("POST", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", lease)

    def _renew_leases(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            for name in self.node_list:
                try:
                    self._renew_lease(name)
                except (ApiError, OSError) as err:
                    _log(f"lease renewal of {name} failed: {err}")

    # -- pods -------------------------------------------------------------------------------------

    def _watch_pods(self) -> None:
        while not self._stop.is_set():
            try:
                listing = self.api.request("GET", "/api/v1/pods")
                for pod in listing["items"]:
                    self._handle(pod, deleted=False)
                rv = listing["metadata"]["resourceVersion"]
                while not self._stop.is_set():
                    for event in self.api.watch("/api/v1/pods", rv, timeout_seconds=30):
                        if event["type"] == "ERROR":
                            raise ApiError(event["object"].get("code", 500), event["object"])
                        rv = event["object"]["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            self._handle(event["object"], deleted=event["type"] == "DELETED")
                        if self._stop.is_set():
                            return
            except (ApiError, OSError, ValueError) as err:
                if not self._stop.is_set():
                    _log(f"pod watch restarts after: {err}")
                    time.sleep(0.5)

    def _handle(self, pod: dict[str, Any], deleted: bool) -> None:
        if pod["spec"].get("nodeName") not in self.nodes:
            return
        uid = pod["metadata"]["uid"]
        with self._lock:
            running = self.pods.get(uid)
        if deleted or pod["metadata"].get("deletionTimestamp"):
            with self._lock:
                self._config_waiting.pop(uid, None)
                self._waiting_ip.pop(uid, None)
            if running is not None and not running.deleting:
                running.deleting = True
                threading.Thread(target=self._delete, args=(running, pod, deleted), daemon=True).start()
            elif running is None and not deleted:
                self._finalize_delete(pod["metadata"]["namespace"], pod["metadata"]["name"], uid)
            return
        with self._lock:
            waiting = uid in self._config_waiting  # the retry thread has it
        if (
            running is None
            and not waiting
            and uid not in self._finished
            and pod["status"].get("phase", "Pending") == "Pending"
        ):
            self._run(pod)

    def _retry_config(self) -> None:
        while not self._stop.wait(CONFIG_RETRY_SECONDS):
            with self._lock:
                waiting = list(self._config_waiting.items())
            for uid, pod in waiting:
                with self._lock:
                    if self._config_waiting.pop(uid, None) is None:  # deleted meanwhile
                        continue
                try:
                    self._run(pod)
                except (ApiError, OSError) as err:
                    _log(f"retry of {pod['metadata']['name']} failed: {err}")

    def _run(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        try:
            container = main_container(pod)
            argv = [*container.get("command", []), *container.get("args", [])]
            if not argv:
                raise ValueError("container has no command: the local node agent cannot run an image's entrypoint")
            if argv[0] in ("python", "python3"):
                argv[0] = sys.executable
            with self._lock:
                kept = self._waiting_ip.pop(uid, None)
            ip = kept or self._allocate_ip()
            env = {k: os.environ[k] for k in PASSTHROUGH_ENV if k in os.environ}
            # A temporary folder of the pod's own, as a container has its own /tmp: what its
            # processes leave there (torch's inductor cache folder, say) stays beside its log.
            env["TMPDIR"] = str(self.logdir / f"{ns}_{name}.tmp")
            env.update(self._container_env(pod, container, ip))
        except ContainerConfigError as err:
            with self._lock:
                self._config_waiting[uid] = pod
                self._waiting_ip[uid] = ip
            waiting = {"reason": "CreateContainerConfigError", "message": str(err)}
            self._set_status(
                ns,
                name,
                {
                    "phase": "Pending",
                    "containerStatuses": [
                        {
                            "name": container["name"],
                            "image": container.get("image", ""),
                            "imageID": "",
                            "ready": False,
                            "started": False,
                            "restartCount": 0,
                            "state": {"waiting": waiting},
                        }
                    ],
                },
            )
            return
        except (ValueError, ApiError, KeyError) as err:
            self._finished.add(uid)
            self._set_status(ns, name, {"phase": "Failed", "reason": "LocalNodeAgentError", "message": str(err)})
            return
        (self.logdir / f"{ns}_{name}.tmp").mkdir(exist_ok=True)
        log = (self.logdir / f"{ns}_{name}.log").open("ab")
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=container.get("workingDir") or os.getcwd(),
        )
        log.close()
        running = RunningPod(ns, name, uid, ip, proc)
        with self._lock:
            self.pods[uid] = running
        started = _now()
        self._set_status(
            ns,
            name,
            {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "hostIP": "127.0.0.1",
                "startTime": started,
                "conditions": [
                    {"type": t, "status": "True", "lastTransitionTime": started}
                    for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
                ],
                "containerStatuses": [
                    {
                        "name": container["name"],
                        "image": container.get("image", ""),
                        "imageID": "",
                        "ready": True,
                        "started": True,
                        "restartCount": 0,
                        "state": {"running": {"startedAt": started}},
                    }
                ],
            },
        )
        threading.Thread(target=self._wait_exit, args=(running, container), daemon=True).start()

    def _container_env(self, pod: dict[str, Any], container: dict[str, Any], ip: str) -> dict[str, str]:
        fields = {
            "metadata.name": pod["metadata"]["name"],
            "metadata.namespace": pod["metadata"]["namespace"],
            "metadata.uid": pod["metadata"]["uid"],
            "spec.nodeName": pod["spec"]["nodeName"],
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
            "status.podIP": ip,
            "status.hostIP": "127.0.0.1",
        }
        env: dict[str, str] = {}
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = var["value"]
            elif ref := var.get("valueFrom", {}).get("fieldRef"):
                env[var["name"]] = fields.get(ref["fieldPath"], "")
            elif ref := var.get("valueFrom", {}).get("secretKeyRef"):
                ns = pod["metadata"]["namespace"]
                try:
                    secret = self.api.request("GET", f"/api/v1/namespaces/{ns}/secrets/{ref['name']}")
                except ApiError as err:
                    if err.status == 404:
                        raise ContainerConfigError(f'secret "{ref["name"]}" not found') from err
                    raise
                data = secret.get("data") or {}
                if ref["key"] not in data:
                    raise ContainerConfigError(f"couldn't find key {ref['key']} in Secret {ns}/{ref['name']}")
                env[var["name"]] = base64.b64decode(data[ref["key"]]).decode()
        return env

    def _allocate_ip(self) -> str:
        with self._lock:
            n = self._next_ip
            self._next_ip += 1
        return f"{self.ip_prefix}.{n // 250}.{n % 250 + 1}"

    def _wait_exit(self, running: RunningPod, container: dict[str, Any]) -> None:
        code = running.proc.wait()
        exit_code = code if code >= 0 else 128 - code  # killed by signal N: 128+N, like a container
        with self._lock:
            self.pods.pop(running.uid, None)
            self._finished.add(running.uid)
        if running.deleting:
            return
        phase = "Succeeded" if exit_code == 0 else "Failed"
        finished = _now()
        _log(f"pod {running.namespace}/{running.name} exited with {exit_code}")
        self._set_status(
            running.namespace,
            running.name,
            {
                "phase": phase,
                "conditions": [
                    {"type": t, "status": "False", "lastTransitionTime": finished} for t in ("ContainersReady", "Ready")
                ],
                "containerStatuses": [
                    {
                        "name": container["name"],
                        "image": container.get("image", ""),
                        "imageID": "",
                        "ready": False,
                        "started": False,
                        "restartCount": 0,
                        "state": {
                            "terminated": {
                                "exitCode": exit_code,
                                "reason": "Completed" if exit_code == 0 else "Error",
                                "finishedAt": finished,
                            }
                        },
                    }
                ],
            },
        )

    def _set_status(self, ns: str, name: str, status: dict[str, Any]) -> None:
        try:
            self.api.request("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status", {"status": status})
        except ApiError as err:
            if err.status != 404:
                _log(f"status of {ns}/{name} not written: {err}")

    def _delete(self, running: RunningPod, pod: dict[str, Any], already_gone: bool) -> None:
        grace = min(float(pod["spec"].get("terminationGracePeriodSeconds", 30)), 5.0)
        self._kill(running, grace)
        if not already_gone:
            self._finalize_delete(running.namespace, running.name, running.uid)

    def _finalize_delete(self, ns: str, name: str, uid: str) -> None:
        # The API server keeps a gracefully deleted pod until its kubelet confirms with grace 0.
        with contextlib.suppress(ApiError):
            self.api.request(
                "DELETE",
                f"/api/v1/namespaces/{ns}/pods/{name}",
                {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}},
            )

    def _kill(self, running: RunningPod, grace: float) -> None:
        # As a container runtime: SIGTERM to the pod's main process group, SIGKILL after the grace,
        # and whatever else still runs in the pod (other groups of its session) goes with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(running.proc.pid, signal.SIGTERM)
        try:
            running.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(running.proc.pid, signal.SIGKILL)
            running.proc.wait()
        signal_session(running.proc.pid, signal.SIGKILL)

    def kill_pod_process(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to every process of a running pod (a test's way to make a 'GPU die'); returns
        the pid of its main process."""
        with self._lock:
            pod = next((p for p in self.pods.values() if p.namespace == namespace and p.name == name), None)
        if pod is None:
            raise KeyError(f"no running pod {namespace}/{name} on this node agent")
        signal_session(pod.proc.pid, sig)
        return pod.proc.pid
