"""Start and stop a real Kubernetes control plane on loopback.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler run as local processes (built by
:mod:`localcluster.build`), plus kwok, which keeps fake GPU nodes Ready and moves pods bound to
them to Running with a loopback pod IP. Every process starts in its own session so that
:meth:`LocalCluster.stop` (or ``python -m localcluster down``) can end it and its children.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from localcluster import build, certs
from localcluster.nodeagent import PROCESS_POD_OCTETS, NodeAgent
from localcluster.waiting import wait_for

SERVICE_CIDR = "10.0.0.0/24"
#: Pod IPs of kwok nodes are on loopback (127.K.x.y), so a test can serve at a pod's address;
#: each cluster draws its own K (and the node agent its own), so that two clusters running at once
#: (two developers' test runs) never hand out the same address.
KWOK_POD_OCTETS = range(64, 150)
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
GPU_RESOURCE = "nvidia.com/gpu"
STATE_FILE = "cluster.json"
#: Pod addresses each process-node agent of a cluster hands out (see add_process_nodes).
IPS_PER_AGENT = 2000
REPO_ROOT = Path(__file__).resolve().parents[2]


class ClusterError(RuntimeError):
    """The control plane could not start; the message says which part and why."""


def _log(msg: str) -> None:
    print(f"[localcluster] {msg}", file=sys.stderr, flush=True)


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something already listens on ``host:port``."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_port() -> int:
    """A port nobody listens on now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class LocalCluster:
    """A control plane on loopback.

    Args:
        workdir: where certificates, etcd data, logs and the kubeconfig go; a fresh temporary
            folder (removed on stop) when None.
        apiserver_port: the API server's port; a free one when None. A taken port is reported.
        kwok: also run kwok, which manages fake nodes and their pods.
    """

    def __init__(self, workdir: Path | None = None, *, apiserver_port: int | None = None, kwok: bool = True) -> None:
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="megatron-localcluster-"))
        self.apiserver_port = apiserver_port
        self.with_kwok = kwok
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._certs: certs.Certs | None = None
        self.node_agents: list[NodeAgent] = []
        rng = random.SystemRandom()
        self.kwok_pod_cidr = f"127.{rng.choice(KWOK_POD_OCTETS)}.0.1/16"
        self.process_pod_prefix = f"127.{rng.choice(PROCESS_POD_OCTETS)}"
        self._agents_started = 0  # node agents ever added: each gets its own block of pod IPs

    # -- paths ------------------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    def log_path(self, component: str) -> Path:
        return self.workdir / "logs" / f"{component}.log"

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> LocalCluster:
        """Build (first run only) and start every component; return when the API is ready.

        Raises:
            ClusterError: a port is taken, a binary could not be built, or a component died or
                did not become ready in time (the tail of its log is in the message).
        """
        started = time.monotonic()
        try:
            names = [c.name for c in build.CONTROL_PLANE] + (["kwok"] if self.with_kwok else [])
            binaries = build.build_all(names)
        except build.BuildError as err:
            self._discard_workdir()
            raise ClusterError(str(err)) from err
        if self.apiserver_port is None:
            self.apiserver_port = free_port()
        elif port_in_use(self.apiserver_port):
            self._discard_workdir()
            raise ClusterError(
                f"port {self.apiserver_port} for kube-apiserver is taken by another process; "
                "stop it (`python -m localcluster down`?) or choose another with --port"
            )
        for stale in ("etcd", "pki", "logs"):  # a previous run's data must not leak into this one
            shutil.rmtree(self.workdir / stale, ignore_errors=True)
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        _log(f"starting control plane in {self.workdir}")
        self._certs = certs.generate(self.workdir / "pki")
        try:
            self._start_etcd(binaries["etcd"])
            self._start_apiserver(binaries["kube-apiserver"], timeout)
            self._write_kubeconfig()
            self._start_controller_manager(binaries["kube-controller-manager"])
            self._start_scheduler(binaries["kube-scheduler"])
            if self.with_kwok:
                self._start_kwok(binaries["kwok"])
            self._wait_default_service_account(timeout)
        except BaseException:
            self.stop()
            raise
        self._save_state()
        _log(
            f"control plane ready at {self.server} in {time.monotonic() - started:.1f} s; kubeconfig {self.kubeconfig}"
        )
        return self

    def stop(self) -> None:
        """Stop every component (SIGTERM, then SIGKILL) and free its port; idempotent."""
        for agent in self.node_agents:
            agent.stop()
        self.node_agents.clear()
        for name in reversed(list(self.procs)):
            _terminate(self.procs[name].pid, name)
        self.procs.clear()
        (self.workdir / STATE_FILE).unlink(missing_ok=True)
        self._discard_workdir()

    def _discard_workdir(self) -> None:
        """Remove the temporary folder this cluster made (a folder given to it is the caller's). A start
        that fails before anything runs calls this, not :meth:`stop`: a cluster already running in a
        given folder keeps its state file."""
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- components -------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = self.log_path(name).open("ab")
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=self.workdir,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise ClusterError(f"{name} exited with code {proc.returncode}:\n{self._log_tail(name)}")

    def _log_tail(self, name: str, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _start_etcd(self, binary: Path) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._spawn(
            "etcd",
            [
                str(binary),
                "--name=default",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=default=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",  # a throwaway store; fsync only slows tests down
                "--log-level=warn",
            ],
        )
        self._wait(lambda: _http_ok(f"{self.etcd_url}/health"), "etcd", 30)

    def _start_apiserver(self, binary: Path, timeout: float) -> None:
        c = self._pki()
        self._spawn(
            "kube-apiserver",
            [
                str(binary),
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.apiserver_port}",
                f"--cert-dir={self.workdir / 'pki'}",
                f"--tls-cert-file={c.apiserver_crt}",
                f"--tls-private-key-file={c.apiserver_key}",
                f"--client-ca-file={c.ca_crt}",
                f"--service-account-key-file={c.sa_pub}",
                f"--service-account-signing-key-file={c.sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                "--enable-priority-and-fairness=false",
                "--v=1",
            ],
        )
        self._wait(lambda: self._api_ok("/readyz"), "kube-apiserver", timeout)

    def restart_apiserver(self, down_seconds: float = 0.0, timeout: float = 60.0) -> None:
        """Kill kube-apiserver (SIGKILL), wait ``down_seconds``, start it again on the same port with
        the same certificates and etcd: every client sees its connections drop and come back."""
        proc = self.procs.pop("kube-apiserver")
        proc.kill()
        proc.wait()
        time.sleep(down_seconds)
        self._start_apiserver(build.build(build.ALL["kube-apiserver"]), timeout)
        self._save_state()

    def _start_controller_manager(self, binary: Path) -> None:
        c = self._pki()
        self._spawn(
            "kube-controller-manager",
            [
                str(binary),
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--secure-port=0",
                f"--service-account-private-key-file={c.sa_key}",
                f"--root-ca-file={c.ca_crt}",
                "--use-service-account-credentials=false",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # Pod IPs are on loopback (127.x), which Endpoints and EndpointSlices refuse; nothing
                # here resolves Services anyway, so their controllers would only log errors.
                "--controllers=*,-nodeipam,-endpoint,-endpointslice,-endpointslicemirroring",
                "--v=1",
            ],
        )

    def _start_scheduler(self, binary: Path) -> None:
        self._spawn(
            "kube-scheduler",
            [
                str(binary),
                f"--kubeconfig={self.kubeconfig}",
                "--leader-elect=false",
                "--secure-port=0",
                "--v=1",
            ],
        )

    def _start_kwok(self, binary: Path) -> None:
        self._spawn(
            "kwok",
            [
                str(binary),
                f"--kubeconfig={self.kubeconfig}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                f"--cidr={self.kwok_pod_cidr}",
                "--node-ip=127.0.0.1",
                "--node-port=0",
                "--server-address=",
            ],
        )

    def _wait_default_service_account(self, timeout: float) -> None:
        # Pods cannot be created in a namespace until its "default" ServiceAccount exists; waiting
        # here means every later step can rely on the controllers running.
        self._wait(
            lambda: self._api_ok("/api/v1/namespaces/default/serviceaccounts/default"),
            "kube-controller-manager",
            timeout,
        )

    def _wait(self, ready: Callable[[], bool], name: str, timeout: float) -> None:
        """Until ``ready()``; a control-plane process that exits meanwhile fails the wait at once."""

        def ready_while_all_alive() -> bool:
            if ready():
                return True
            for proc_name in self.procs:
                self._check_alive(proc_name)
            return False

        wait_for(
            ready_while_all_alive,
            timeout,
            f"{name} to be ready",
            interval=0.1,
            error=ClusterError,
            details=lambda: self._log_tail(name),
        )

    # -- API access -------------------------------------------------------------------------------

    def _pki(self) -> certs.Certs:
        if self._certs is None:
            raise ClusterError("cluster not started")
        return self._certs

    def _ssl_context(self) -> ssl.SSLContext:
        c = self._pki()
        ctx = ssl.create_default_context(cafile=str(c.ca_crt))
        ctx.load_cert_chain(str(c.admin_crt), str(c.admin_key))
        return ctx

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        """One call to the API server as cluster admin; returns (status, decoded JSON body)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.server + path,
            data=data,
            method=method,
            headers={"Content-Type": content_type, "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, context=self._ssl_context(), timeout=10) as resp:
                return resp.status, _decode(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, _decode(err.read())

    def _api_ok(self, path: str) -> bool:
        try:
            status, _ = self.request("GET", path)
        except (OSError, ssl.SSLError):
            return False
        return status == 200

    def _write_kubeconfig(self) -> None:
        # The certificates and key are named by path, not embedded: a client given embedded data
        # (the kubernetes package, kopf through it) writes it to temporary files of its own, which
        # a killed process never removes.
        c = self._pki()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "local", "cluster": {"server": self.server, "certificate-authority": str(c.ca_crt.resolve())}}
            ],
            "users": [
                {
                    "name": "admin",
                    "user": {
                        "client-certificate": str(c.admin_crt.resolve()),
                        "client-key": str(c.admin_key.resolve()),
                    },
                }
            ],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin"}}],
            "current-context": "local",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))
        self.kubeconfig.chmod(0o600)

    def _save_state(self) -> None:
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "pids": {name: p.pid for name, p in self.procs.items()},
        }
        (self.workdir / STATE_FILE).write_text(json.dumps(state, indent=2))

    # -- cluster content --------------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster."""
        proc = subprocess.run(
            ["kubectl", f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc

    def install_crds(self, directory: Path = REPO_ROOT / "crds", timeout: float = 30.0) -> None:
        """Apply every CRD in ``directory`` and wait until each is Established."""
        files = sorted(directory.glob("*.yaml"))
        if not files:
            raise ClusterError(f"no CRD files in {directory}")
        for f in files:
            self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(f))
            name = yaml.safe_load(f.read_text())["metadata"]["name"]
            self.kubectl("wait", "--for=condition=Established", f"crd/{name}", f"--timeout={int(timeout)}s")

    def add_gpu_nodes(self, count: int, gpus_per_node: int = 8, prefix: str = "gpu") -> list[str]:
        """Register ``count`` fake nodes advertising ``nvidia.com/gpu``, kept Ready by kwok.

        Returns their names (``{prefix}-0``, ...), continuing after any existing ones.
        """
        if not self.with_kwok:
            raise ClusterError("fake nodes need kwok; start LocalCluster(kwok=True)")
        status, existing = self.request("GET", "/api/v1/nodes")
        taken = {n["metadata"]["name"] for n in existing.get("items", [])} if status == 200 else set()
        names: list[str] = []
        i = 0
        while len(names) < count:
            name = f"{prefix}-{i}"
            i += 1
            if name in taken:
                continue
            node = _fake_node(name, gpus_per_node)
            status, body = self.request("POST", "/api/v1/nodes", node)
            if status != 201:
                raise ClusterError(f"could not create node {name}: {status} {body}")
            names.append(name)
        self._wait(lambda: all(self.node_ready(n) for n in names), "kwok", 60)
        return names

    def add_process_nodes(self, count: int, gpus_per_node: int = 8, prefix: str = "local") -> NodeAgent:
        """Register ``count`` nodes whose pods run as local processes (see :mod:`localcluster.nodeagent`).

        Pods reach them with ``nodeSelector: {megatron.dev/local-node: "true"}``, or only these
        nodes with ``{megatron.dev/node-pool: <prefix>}``. Returns the agent, whose
        ``kill_pod_process`` plays a dying GPU.
        """
        start = len([a for a in self.node_agents for _ in a.node_list])
        names = [f"{prefix}-{start + i}" for i in range(count)]
        # Pod IPs: every agent of this cluster draws from the same 127.P range, each from a block of
        # its own (2,000 addresses), so pods of two agents never share an address.
        agent = NodeAgent(
            self.kubeconfig,
            names,
            self.workdir,
            gpus_per_node,
            pool=prefix,
            ip_prefix=self.process_pod_prefix,
            first_ip=1 + self._agents_started * IPS_PER_AGENT,
        ).start()
        self._agents_started += 1
        self.node_agents.append(agent)
        self._wait(lambda: all(self.node_ready(n) for n in names), "node agent", 30)
        return agent

    def node_ready(self, name: str) -> bool:
        status, node = self.request("GET", f"/api/v1/nodes/{name}")
        if status != 200:
            return False
        conds = node.get("status", {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def set_node_ready(self, name: str, ready: bool) -> None:
        """Make a fake node NotReady (kwok stops managing it) or Ready again (kwok resumes)."""
        annotation = "fake" if ready else None
        status, body = self.request(
            "PATCH",
            f"/api/v1/nodes/{name}",
            {"metadata": {"annotations": {KWOK_NODE_ANNOTATION: annotation}}},
            content_type="application/merge-patch+json",
        )
        if status != 200:
            raise ClusterError(f"could not patch node {name}: {status} {body}")
        if ready:
            self._wait(lambda: self.node_ready(name), "kwok", 60)
            return
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        cond = {
            "type": "Ready",
            "status": "False",
            "reason": "KubeletNotReady",
            "message": "node made NotReady by localcluster",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        status, body = self.request(
            "PATCH",
            f"/api/v1/nodes/{name}/status",
            {"status": {"conditions": [cond]}},
            content_type="application/strategic-merge-patch+json",
        )
        if status != 200:
            raise ClusterError(f"could not mark node {name} NotReady: {status} {body}")


def _fake_node(name: str, gpus: int) -> dict[str, Any]:
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", GPU_RESOURCE: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_NODE_ANNOTATION: "fake"},
            "labels": {"type": "kwok", "kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true"},
        },
        "spec": {},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def _decode(payload: bytes) -> Any:
    """JSON when the body is JSON (API objects), else text (``/readyz`` answers ``ok``)."""
    try:
        return json.loads(payload or b"null")
    except json.JSONDecodeError:
        return payload.decode(errors="replace")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _terminate(pid: int, name: str, grace: float = 10.0) -> None:
    """SIGTERM the process group of ``pid``, then SIGKILL it after ``grace`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child (``down`` from another process): poll instead
            done = 0 if _alive(pid) else pid
        if done:
            return
        time.sleep(0.05)
    _log(f"{name} did not stop on SIGTERM; killing it")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_from_state(workdir: Path) -> bool:
    """Stop a cluster started by another process (``up``) from its saved state; False if none."""
    state_file = workdir / STATE_FILE
    if not state_file.exists():
        return False
    state = json.loads(state_file.read_text())
    for name, pid in reversed(list(state["pids"].items())):
        _terminate(pid, name)
    state_file.unlink()
    return True


@contextlib.contextmanager
def running(**kwargs: Any) -> Iterator[LocalCluster]:
    """``with running() as cluster:`` start a cluster and stop it afterwards."""
    cluster = LocalCluster(**kwargs)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
