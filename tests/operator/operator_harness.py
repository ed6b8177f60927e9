"""What integration tests and the benchmark need around a real operator process.

- :class:`OperatorProcess`: ``python -m megatron_operator`` as a subprocess against a cluster's
  kubeconfig, its log in a file (dumped when a test fails).
- :class:`RecordingAgents`: stand-ins for the trainer agents. They serve the agent's plan endpoint
  at each pod's (loopback) address and record who received which plan and when, answer like an
  agent would (409 for a stale epoch, 401/403 for a bad token), and send heartbeats like an
  agent: warm spare before a plan names the pod, then a training step after another (the
  operator counts a job as training only then); holding a suspend plan, they report its checkpoint
  written at once. A test mutes a pod to speak for it itself.
- :func:`wait_for`: wait for a condition with a deadline (never a bare sleep).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web
from operator_factories import make_job

from localcluster.operator_run import token_key_file
from localcluster.waiting import wait_for
from megatron_contract import wire

REPO = Path(__file__).resolve().parents[2]
PYTHONPATH = os.pathsep.join(str(REPO / p) for p in ("contract", "operator", "trainer", "localcluster"))
JOBS = f"/apis/{wire.GROUP}/{wire.VERSION}"
POOL_LABEL = "megatron.dev/test-pool"
WAIT_SECONDS = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class OperatorProcess:
    """A real operator process; ``stop()`` ends it (SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        log_path: Path,
        *,
        report_port: int | None = None,
        lease_seconds: float = 3.0,
        identity: str | None = None,
        **env: str,
    ) -> None:
        self.report_port = report_port or free_port()
        self.log_path = log_path
        self.env = {
            **os.environ,
            "PYTHONPATH": PYTHONPATH,
            "KUBECONFIG": str(kubeconfig),
            "MEGATRON_OPERATOR_NAMESPACES": namespace,
            "MEGATRON_OPERATOR_REPORT_HOST": "127.0.0.1",
            "MEGATRON_OPERATOR_REPORT_PORT": str(self.report_port),
            "MEGATRON_OPERATOR_URL": f"http://127.0.0.1:{self.report_port}",
            "MEGATRON_OPERATOR_LEASE_NAMESPACE": namespace,
            "MEGATRON_OPERATOR_LEASE_SECONDS": str(lease_seconds),
            "MEGATRON_OPERATOR_RESYNC_SECONDS": "1",
            "MEGATRON_OPERATOR_PUSH_TIMEOUT_SECONDS": "2",
            "MEGATRON_OPERATOR_TOKEN_KEY_FILE": str(token_key_file(kubeconfig.parent)),
            **({"MEGATRON_OPERATOR_IDENTITY": identity} if identity else {}),
            **env,
        }
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.report_port}"

    def start(self) -> OperatorProcess:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_operator"],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crashed node would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclasses.dataclass
class Received:
    """One plan an agent received."""

    pod: str | None
    address: str
    epoch: int
    reason: str
    members: list[str]
    at: float  # time.monotonic() in this process
    status: int


@dataclasses.dataclass(frozen=True)
class _PushedPlan:
    """What the recording agents read from one plan body."""

    epoch: int
    reason: str
    resume_step: int
    members: list[str]  # shared by every Received of this body: never changed
    member_set: frozenset[str]
    pod_at: dict[str, str]  # address -> pod


@functools.lru_cache(maxsize=8)
def _parse_plan(raw: bytes, encoding: str) -> _PushedPlan:
    """A plan body as the recording agents read it: once per distinct body (the last few)."""
    body = json.loads(gzip.decompress(raw) if encoding == "gzip" else raw)
    members = [m["pod"] for m in body["members"]]
    return _PushedPlan(
        int(body["epoch"]),
        body["reason"],
        int(body["resumeStep"]),
        members,
        frozenset(members),
        dict(reversed([(m["address"], m["pod"]) for m in body["members"]])),  # the first wins
    )


class RecordingAgents:
    """Fake agents on the pods' loopback addresses, in a background event loop.

    One process answers for every pod, so each distinct plan body is decompressed and parsed once:
    a push sends the same gzipped bytes to all members, and reading each copy (4096 x 0.4-0.6 MB
    of JSON) would make this process, not the operator, what a scale benchmark measures."""

    def __init__(self, token: Callable[[], str | None]) -> None:
        self._token = token
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="recording-agents", daemon=True)
        self._thread.start()
        self._sites: dict[str, web.AppRunner] = {}
        self.pod_at: dict[str, str] = {}  # address -> pod name
        self.held: dict[str, int] = {}  # pod -> epoch held
        self.received: list[Received] = []
        self.refuse: set[str] = set()  # addresses that answer 503 (an agent not up yet)
        self.running: set[str] = set()  # pods running at the last sync
        self.members: dict[str, frozenset[str]] = {}  # pod -> members of the plan it holds
        self.mute: set[str] = set()  # pods whose heartbeats the test sends itself (or withholds)
        self.suspend_at: dict[str, int] = {}  # pod -> step of the suspend plan it holds
        # When set, members report a complete checkpoint every this many of their steps (the
        # operator restores from it when no peer holds the state any more).
        self.checkpoint_interval: int | None = None
        self.job_uid: str | None = None
        self.operator_urls: list[str] = []
        self._lock = threading.Lock()
        self._session: ClientSession | None = None
        self._beats: threading.Thread | None = None
        self._beating = threading.Event()

    def _run(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def sync(self, pods: list[dict[str, Any]]) -> None:
        """Serve at the address of every running pod; a new pod at an old address starts with no plan."""
        with self._lock:
            self.running = {p["metadata"]["name"] for p in pods if (p.get("status") or {}).get("podIP")}
        for pod in pods:
            ip = (pod.get("status") or {}).get("podIP")
            name = pod["metadata"]["name"]
            if not ip:
                continue
            with self._lock:
                self.pod_at[ip] = name
            if ip not in self._sites:
                try:
                    self._sites[ip] = self._run(self._serve(ip))
                except OSError as exc:
                    # Another local cluster (another test run) may use the same loopback pod
                    # address; the next sync tries again.
                    print(f"recording agent for {name} at {ip}: {exc}", file=sys.stderr)

    async def _serve(self, ip: str) -> web.AppRunner:
        async def plan(request: web.Request) -> web.Response:
            body = _parse_plan(await request.read(), request.headers.get("Content-Encoding", ""))
            auth = request.headers.get(wire.AUTH_HEADER, "")
            epoch = body.epoch
            # The plan names the pod at this address; pod names are never re-used, addresses are.
            pod = body.pod_at.get(ip, self.pod_at.get(ip))
            token = self._token()
            if token is None or auth != f"{wire.AUTH_SCHEME} {token}":
                status = 403
            elif ip in self.refuse:
                status = 503
            else:
                with self._lock:
                    status = 409 if epoch <= self.held.get(pod or ip, 0) else 200
                    if status == 200:
                        self.held[pod or ip] = epoch
                        self.members[pod or ip] = body.member_set
                        if body.reason == "suspend":
                            self.suspend_at[pod or ip] = body.resume_step
                        else:
                            self.suspend_at.pop(pod or ip, None)
            with self._lock:
                self.received.append(Received(pod, ip, epoch, body.reason, body.members, time.monotonic(), status))
            return web.json_response({"epoch": self.held.get(pod or ip, 0)}, status=status)

        app = web.Application(client_max_size=wire.MAX_BODY_BYTES)
        app.router.add_post(wire.AGENT_PLAN_PATH, plan)
        # Bodies as sent (gzipped): each distinct one is decompressed once, in _parse.
        runner = web.AppRunner(
            app, access_log=None, auto_decompress=False, keepalive_timeout=wire.AGENT_KEEPALIVE_SECONDS
        )
        await runner.setup()
        await web.TCPSite(runner, ip, wire.AGENT_PORT, reuse_address=True).start()
        return runner

    def plans_for(self, pod: str, status: int | None = 200) -> list[int]:
        """Epochs a pod accepted (or received with the given answer; None: all)."""
        with self._lock:
            return [r.epoch for r in self.received if r.pod == pod and (status is None or r.status == status)]

    def report(
        self,
        operator_url: str,
        token: str,
        job_uid: str,
        pod: str,
        epoch: int,
        *,
        state: str = "training",
        step: int | None = None,
        failed_peers: list[dict[str, Any]] | None = None,
        healthy: bool = True,
        checkpoint_step: int | None = None,
    ) -> tuple[int, Any]:
        """Send one heartbeat to the operator as the pod's agent would."""
        report = {"jobUid": job_uid, "pod": pod, "epoch": epoch, "state": state, "healthy": healthy}
        if step is not None:
            report["step"] = step
        if checkpoint_step is not None:
            report["checkpointStep"] = checkpoint_step
        if failed_peers:
            report["failedPeers"] = failed_peers

        result: tuple[int, Any] = self._run(self._post(operator_url, token, report))
        return result

    def start_heartbeats(self, period: float = 0.25) -> None:
        """Send every running, unmuted pod's heartbeat each ``period`` to every operator in
        ``operator_urls``, once ``job_uid`` and the token are known: a spare before a plan names
        the pod, afterwards a training step more each time."""
        self._beating.set()
        self._beats = threading.Thread(target=self._beat_loop, args=(period,), name="recording-heartbeats", daemon=True)
        self._beats.start()

    def _beat_loop(self, period: float) -> None:
        steps: dict[str, int] = {}
        while self._beating.is_set():
            time.sleep(period)
            token, uid = self._token(), self.job_uid
            if token is None or uid is None:
                continue
            reports = []
            with self._lock:
                for pod in sorted(self.running - self.mute):
                    epoch = self.held.get(pod, 0)
                    report: dict[str, Any] = {"jobUid": uid, "pod": pod, "epoch": epoch, "healthy": True}
                    if pod in self.suspend_at:
                        # A suspend plan: its checkpoint written and verified at once, training stopped.
                        report.update(state="training", step=steps.get(pod, 0))
                        report.update(checkpointStep=self.suspend_at[pod], suspendStep=self.suspend_at[pod])
                    elif pod in self.members.get(pod, set()):
                        steps[pod] = steps.get(pod, 0) + 1
                        report.update(state="training", step=steps[pod])
                        if self.checkpoint_interval and steps[pod] >= self.checkpoint_interval:
                            report["checkpointStep"] = steps[pod] - steps[pod] % self.checkpoint_interval
                    else:
                        report["state"] = "spare"
                    reports.append(report)
            if not reports:
                continue
            for url in list(self.operator_urls):
                with contextlib.suppress(Exception):  # a standby or a stopped operator: no matter
                    self._run(self._post(url, token, {"reports": reports}), timeout=5)

    async def _post(self, operator_url: str, token: str, body: dict[str, Any]) -> tuple[int, Any]:
        if self._session is None:
            self._session = ClientSession(timeout=ClientTimeout(total=5))
        async with self._session.post(
            f"{operator_url}{wire.OPERATOR_REPORT_PATH}",
            json=body,
            headers={wire.AUTH_HEADER: f"{wire.AUTH_SCHEME} {token}"},
        ) as resp:
            return resp.status, await resp.json()

    def close(self) -> None:
        self._beating.clear()
        if self._beats is not None:
            self._beats.join(10)

        async def shutdown() -> None:
            for runner in self._sites.values():
                await runner.cleanup()
            if self._session is not None:
                await self._session.close()

        self._run(shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def pod_runs(pod: dict[str, Any]) -> bool:
    """Whether a pod (as the API server returns it) runs, has its address, and is not being deleted."""
    status = pod.get("status") or {}
    return bool(
        status.get("phase") == "Running" and status.get("podIP") and not pod["metadata"].get("deletionTimestamp")
    )


class JobApi:
    """Small helpers over LocalCluster.request for one namespace."""

    def __init__(self, cluster: Any, namespace: str) -> None:
        self.cluster = cluster
        self.ns = namespace

    def create_job(self, body: dict[str, Any]) -> tuple[int, Any]:
        meta = body["metadata"]
        for key in ("uid", "resourceVersion", "generation"):
            meta.pop(key, None)
        meta["namespace"] = self.ns
        result: tuple[int, Any] = self.cluster.request("POST", f"{JOBS}/namespaces/{self.ns}/{wire.PLURAL}", body)
        return result

    def job(self, name: str) -> dict[str, Any]:
        status, body = self.cluster.request("GET", f"{JOBS}/namespaces/{self.ns}/{wire.PLURAL}/{name}")
        assert status == 200, body
        job: dict[str, Any] = body
        return job

    def status(self, name: str) -> dict[str, Any]:
        return self.job(name).get("status") or {}

    def delete_job(self, name: str) -> None:
        self.cluster.request("DELETE", f"{JOBS}/namespaces/{self.ns}/{wire.PLURAL}/{name}")

    def pods(self, job: str | None = None) -> list[dict[str, Any]]:
        selector = f"?labelSelector={wire.LABEL_JOB}%3D{job}" if job else ""
        status, body = self.cluster.request("GET", f"/api/v1/namespaces/{self.ns}/pods{selector}")
        assert status == 200, body
        items: list[dict[str, Any]] = body["items"]
        return items

    def running_pods(self, job: str) -> list[dict[str, Any]]:
        return [p for p in self.pods(job) if pod_runs(p)]

    def delete_pod(self, name: str, grace: int | None = 0) -> None:
        query = f"?gracePeriodSeconds={grace}" if grace is not None else ""
        self.cluster.request("DELETE", f"/api/v1/namespaces/{self.ns}/pods/{name}{query}")

    def patch_pod_status(self, name: str, status: dict[str, Any]) -> tuple[int, Any]:
        result: tuple[int, Any] = self.cluster.request(
            "PATCH",
            f"/api/v1/namespaces/{self.ns}/pods/{name}/status",
            {"status": status},
            content_type="application/merge-patch+json",
        )
        return result

    def get(self, path: str) -> Any:
        status, body = self.cluster.request("GET", path)
        return body if status == 200 else None

    def token(self, job: str) -> str | None:
        body = self.get(f"/api/v1/namespaces/{self.ns}/secrets/{job}-token")
        if not body:
            return None
        return base64.b64decode(body["data"][wire.TOKEN_SECRET_KEY]).decode()

    def events(self) -> list[dict[str, Any]]:
        body = self.get(f"/api/v1/namespaces/{self.ns}/events")
        return body["items"] if body else []

    def dump(self) -> str:
        """Everything a failing test should show: jobs, pods, events."""
        out = []
        for path in (f"{JOBS}/namespaces/{self.ns}/{wire.PLURAL}", f"/api/v1/namespaces/{self.ns}/pods"):
            body = self.get(path) or {}
            for item in body.get("items", []):
                slim = {k: item.get(k) for k in ("metadata", "status")}
                slim["metadata"] = {k: slim["metadata"].get(k) for k in ("name", "labels", "deletionTimestamp")}
                out.append(json.dumps(slim, default=str)[:3000])
        for ev in self.events()[-40:]:
            out.append(
                f"event {ev.get('type')} {ev.get('reason')} {ev['involvedObject'].get('name')}: {ev.get('message')}"
            )
        return "\n".join(out)


class Harness:
    """An operator process, recording agents kept in sync with the pods, private fake GPU nodes."""

    def __init__(self, cluster: Any, namespace: str, tmp: Path, job: str = "train") -> None:
        self.job = job
        self.cluster = cluster
        self.ns = namespace
        self.api = JobApi(cluster, namespace)
        self.tmp = tmp
        self.operators: list[OperatorProcess] = []
        self.nodes: list[str] = []
        self._token: str | None = None
        self.agents = RecordingAgents(self.token)
        self.agents.start_heartbeats()
        self._stop = threading.Event()
        self._syncer = threading.Thread(target=self._sync_loop, daemon=True)
        self._syncer.start()

    def token(self) -> str | None:
        if self._token is None:
            self._token = self.api.token(self.job)
        return self._token

    def _sync_loop(self) -> None:
        while not self._stop.wait(0.05):
            try:
                if self.agents.job_uid is None:
                    self.agents.job_uid = (
                        (self.api.get(f"{JOBS}/namespaces/{self.ns}/{wire.PLURAL}/{self.job}") or {}).get("metadata")
                        or {}
                    ).get("uid")
                self.agents.sync(self.api.running_pods(self.job))
            except Exception as exc:  # the cluster may be busy; the next round retries
                print(f"agent sync: {exc}", file=sys.stderr)

    def add_nodes(self, count: int) -> list[str]:
        names = self.cluster.add_gpu_nodes(count, gpus_per_node=8, prefix=f"{self.ns}-n")
        for name in names:
            self.cluster.request(
                "PATCH",
                f"/api/v1/nodes/{name}",
                {"metadata": {"labels": {POOL_LABEL: self.ns}}},
                content_type="application/merge-patch+json",
            )
        self.nodes.extend(names)
        return names

    def cordon(self, names: list[str], unschedulable: bool = True) -> None:
        for name in names:
            self.cluster.request(
                "PATCH",
                f"/api/v1/nodes/{name}",
                {"spec": {"unschedulable": unschedulable}},
                content_type="application/merge-patch+json",
            )

    def start_operator(self, **env: str) -> OperatorProcess:
        op = OperatorProcess(
            self.cluster.kubeconfig, self.ns, self.tmp / f"operator-{len(self.operators)}.log", **env
        ).start()
        self.operators.append(op)
        self.agents.operator_urls.append(op.url)
        return op

    def submit(self, **spec: Any) -> dict[str, Any]:
        spec.setdefault("node_selector", {POOL_LABEL: self.ns})
        status, body = self.api.create_job(make_job(self.job, self.ns, **spec))
        assert status == 201, body
        return body

    # -- waits -------------------------------------------------------------------------------------

    def wait_status(self, check: Any, what: str, timeout: float = WAIT_SECONDS) -> dict[str, Any]:
        return wait_for(lambda: (s := self.api.status(self.job)) and check(s) and s, timeout, what)

    def wait_running(self, epoch: int, timeout: float = WAIT_SECONDS) -> dict[str, Any]:
        return self.wait_status(
            lambda s: s.get("phase") == "Running" and s.get("epoch") == epoch,
            f"phase Running at epoch {epoch}",
            timeout,
        )

    def members(self, status: dict[str, Any]) -> list[str]:
        return [m["pod"] for m in status["plan"]["members"]]

    def pod_names(self) -> set[str]:
        return {p["metadata"]["name"] for p in self.api.pods(self.job) if not p["metadata"].get("deletionTimestamp")}

    def close(self, failed: bool) -> None:
        if failed:
            print("=" * 30, "objects of", self.ns)
            print(self.api.dump())
            for op in self.operators:
                print("=" * 30, op.log_path)
                print(op.log_text()[-20000:])
        for op in self.operators:  # first: a leaked operator would push into later tests' addresses
            op.stop()
        self._stop.set()
        self._syncer.join(5)
        try:
            self.agents.close()
        finally:
            self.api.delete_job(self.job)
            for name in self.nodes:
                self.cluster.request("DELETE", f"/api/v1/nodes/{name}")


@contextlib.contextmanager
def open_harness(cluster: Any, namespace: str, tmp: Path, job: str, request: Any = None) -> Iterator[Harness]:
    """A Harness closed when the block is left; it dumps logs and objects when the test failed: an
    exception left the block, or (given pytest's ``request``) pytest counted a failure meanwhile (a
    fixture's teardown sees no exception)."""
    failed_before = request.session.testsfailed if request is not None else 0
    harness = Harness(cluster, namespace, tmp, job)
    failed = False
    try:
        yield harness
    except BaseException:
        failed = True
        raise
    finally:
        counted = request is not None and request.session.testsfailed > failed_before
        harness.close(failed=failed or counted)


def harness_for_test(cluster: Any, namespace: str, tmp: Path, request: Any, job: str) -> Iterator[Harness]:
    """A Harness for one test's fixture (``yield from`` it); dumps logs and objects when the test failed."""
    with open_harness(cluster, namespace, tmp, job, request) as harness:
        yield harness
