"""Builders and fixtures-in-a-class for the agent's tests: specs, plans, agent processes, and a
recording endpoint that plays the operator.

Agents run as real processes (``python -m megatron_trainer.agent``), each bound to its own
loopback address with the standard ports, as pods of the local control plane are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from localcluster import waiting
from megatron_contract import wire
from megatron_contract.agent import AgentReport
from megatron_contract.job import MegatronJobSpec
from megatron_contract.mesh import (
    BatchGeometry,
    MeshPlan,
    MeshSizes,
    PlanMember,
    PlanReason,
    Rendezvous,
    StateSource,
    StateSourceKind,
)
from megatronjob_builders import small_spec

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
FAKE_WORKER = [PYTHON, str(Path(__file__).with_name("agent_fake_worker.py"))]
JOB_UID = "00000000-0000-0000-0000-0000000a9e57"
TOKEN = "test-token-" + "x" * 24
SOURCE_ROOTS = ["contract", "operator", "trainer", "localcluster"]


# An agent that is not up yet refuses connections or answers half a state: that is "not yet".
wait_for = partial(waiting.wait_for, error=AssertionError, retry_on=(OSError, KeyError, ValueError))


def make_spec(
    *,
    tp: int = 1,
    gpus_per_pod: int = 1,
    replicas: int = 2,
    spares: int = 1,
    train_iters: int = 10_000,
    global_batch: int = 8,
    collective_timeout: float = 30.0,
    heartbeat_interval: float = 0.2,
    **extra: Any,
) -> MegatronJobSpec:
    """The agents' small spec (:func:`megatronjob_builders.small_spec`), with fast heartbeats and
    training that lasts until the test stops it."""
    return small_spec(
        replicas=replicas,
        spares=spares,
        tp=tp,
        gpus_per_pod=gpus_per_pod,
        training={"global_batch_size": global_batch, "train_iters": train_iters},
        failure_detection={
            "heartbeat_interval_seconds": heartbeat_interval,
            "heartbeat_timeout_seconds": max(10 * heartbeat_interval, 1.0),
            "collective_timeout_seconds": collective_timeout,
        },
        **extra,
    )


@dataclasses.dataclass(frozen=True)
class PodAddress:
    """A trainer pod as a plan names it."""

    name: str
    address: str


def make_plan(
    spec: MegatronJobSpec,
    pods: Sequence[PodAddress],
    *,
    epoch: int = 1,
    reason: PlanReason = PlanReason.INITIAL,
    resume_step: int = 0,
    store: PodAddress | None = None,
    sources: dict[int, StateSource] | None = None,
    job_uid: str = JOB_UID,
) -> MeshPlan:
    """A valid plan over ``pods`` in order (ranks dealt out pod by pod), state from init by default.

    ``sources`` overrides the state source of individual ranks (peer, self, checkpoint).
    """
    world = len(pods) * spec.gpus_per_pod
    dp = world // (spec.tp * spec.pp * spec.cp)
    rendezvous_pod = store or pods[0]
    kind = StateSourceKind.INIT if reason is PlanReason.INITIAL else StateSourceKind.SELF
    state = {r: StateSource(rank=r, kind=kind) for r in range(world)}
    state.update(sources or {})
    return MeshPlan(
        job_uid=job_uid,
        epoch=epoch,
        reason=reason,
        sizes=MeshSizes(world=world, tp=spec.tp, pp=spec.pp, cp=spec.cp, dp=dp),
        gpus_per_pod=spec.gpus_per_pod,
        batch=BatchGeometry.split(spec.training.global_batch_size, spec.training.micro_batch_size, dp),
        rendezvous=Rendezvous(
            host=rendezvous_pod.address, port=wire.RENDEZVOUS_PORT, store_prefix=Rendezvous.prefix_for(job_uid, epoch)
        ),
        members=[
            PlanMember(
                pod=p.name, address=p.address, ranks=list(range(i * spec.gpus_per_pod, (i + 1) * spec.gpus_per_pod))
            )
            for i, p in enumerate(pods)
        ],
        resume_step=resume_step,
        state_sources=[state[r] for r in range(world)],
    )


def process_gone(pid: int) -> bool:
    """True once ``pid`` no longer exists or is a zombie (nobody will run it again)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True


def _bindable(address: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def free_pod_address() -> str:
    """A loopback address on which the agent's and the store's standard ports are both free."""
    for _ in range(200):
        address = f"127.{random.randint(100, 250)}.{random.randint(0, 255)}.{random.randint(1, 254)}"
        if _bindable(address, wire.AGENT_PORT) and _bindable(address, wire.RENDEZVOUS_PORT):
            return address
    raise RuntimeError("no free loopback address for an agent")


def http_json(
    method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None, timeout: float = 10.0
) -> tuple[int, Any]:
    """One HTTP request; (status, decoded JSON or raw text) for any status."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


class AgentProcess:
    """``python -m megatron_trainer.agent`` for one pod, with its log in a file."""

    def __init__(
        self,
        pod: str,
        spec: MegatronJobSpec,
        log_dir: Path,
        *,
        operator_url: str | None = None,
        worker_command: Sequence[str] | None = FAKE_WORKER,
        extra_env: dict[str, str] | None = None,
        role: str = wire.ROLE_WORKER,
    ) -> None:
        self.pod = PodAddress(pod, free_pod_address())
        self.spec = spec
        self.log_path = log_dir / f"agent-{pod}.log"
        env = {
            **os.environ,
            # The sources first, then what the caller's path had (packages installed beside the
            # image's, as on the GPU machines).
            "PYTHONPATH": os.pathsep.join(
                [*(str(REPO / root) for root in SOURCE_ROOTS), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            wire.ENV_JOB_NAME: "test-job",
            wire.ENV_JOB_NAMESPACE: "test",
            wire.ENV_JOB_UID: JOB_UID,
            wire.ENV_JOB_TOKEN: TOKEN,
            wire.ENV_POD_NAME: pod,
            wire.ENV_POD_IP: self.pod.address,
            wire.ENV_POD_ROLE: role,
            wire.ENV_JOB_SPEC: json.dumps(spec.to_wire()),
            wire.ENV_GPUS_PER_POD: str(spec.gpus_per_pod),
            "MEGATRON_SHUTDOWN_GRACE_SECONDS": "5",
        }
        if operator_url:
            env[wire.ENV_OPERATOR_URL] = operator_url
        if worker_command is not None:
            env["MEGATRON_WORKER_COMMAND"] = json.dumps(list(worker_command))
        env.update(extra_env or {})
        self._log = self.log_path.open("wb")
        self._terminated = False
        self.process = subprocess.Popen(
            [PYTHON, "-m", "megatron_trainer.agent"], env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT
        )

    @property
    def url(self) -> str:
        """Base URL of the control port."""
        return f"http://{self.pod.address}:{wire.AGENT_PORT}"

    def state(self) -> dict[str, Any]:
        """``GET /v1/state``."""
        status, body = http_json("GET", self.url + wire.AGENT_STATE_PATH, timeout=5)
        assert status == 200, f"{self.pod.name}: /v1/state answered {status}: {body}"
        return body  # type: ignore[no-any-return]

    def metrics(self) -> str:
        """``GET /metrics`` as text."""
        with urllib.request.urlopen(self.url + wire.AGENT_METRICS_PATH, timeout=5) as response:
            return response.read().decode()  # type: ignore[no-any-return]

    def post_plan(
        self, plan: MeshPlan | bytes, token: str | None = TOKEN, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """``POST /v1/plan`` with the given token (None: no Authorization header)."""
        body = plan if isinstance(plan, bytes) else json.dumps(plan.to_wire()).encode()
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        if token is not None:
            all_headers[wire.AUTH_HEADER] = f"{wire.AUTH_SCHEME} {token}"
        return http_json("POST", self.url + wire.AGENT_PLAN_PATH, body, all_headers)

    def wait_state(self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        """Poll ``/v1/state`` until ``predicate`` holds; fail at once, with the agent's log, when
        the agent exited (it would never get there). A failed state is waited through: the agent
        may restart its workers."""

        def check() -> dict[str, Any] | None:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"{self.pod.name}: agent exited with {self.process.returncode}:\n{self.log()[-4000:]}"
                )
            s = self.state()
            return s if predicate(s) else None

        return wait_for(check, timeout, f"{self.pod.name}: {what}")

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        """Until the control port answers and every worker said Hello (state spare)."""
        return self.wait_state(lambda s: s["state"] == "spare", timeout, "workers ready (spare)")

    def worker_pid(self, local_rank: int = 0) -> int:
        """Pid of one local worker, from ``/v1/state``."""
        return int(next(w["pid"] for w in self.state()["workers"] if w["localRank"] == local_rank))

    def log(self) -> str:
        """The agent's (and its workers') output so far."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        """SIGTERM once, without waiting: the agent shuts down while the caller goes on."""
        if self.process.poll() is None and not self._terminated:
            self.process.send_signal(signal.SIGTERM)
        self._terminated = True

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; SIGKILL the agent if it does not end (its workers see EOF and exit)."""
        self.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self._log.close()
        return self.process.returncode


@contextlib.contextmanager
def running_agents(agents: Sequence[AgentProcess]) -> Iterator[Sequence[AgentProcess]]:
    """Stop every agent at the end; print their logs if the block failed."""
    try:
        yield agents
    except BaseException:
        for agent in agents:
            print(f"===== log of {agent.pod.name} ({agent.pod.address}) =====\n{agent.log()[-20000:]}")
        raise
    finally:
        for agent in agents:
            agent.stop()


class RecordingOperator:
    """Plays the operator's report endpoint: records every AgentReport, answers ``{"epoch": N}``."""

    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch
        self.reports: list[AgentReport] = []
        self.received_at: list[float] = []  # time.time() of each report's arrival, same order
        self.refused = 0
        self._lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != wire.OPERATOR_REPORT_PATH or self.headers.get(wire.AUTH_HEADER) != f"Bearer {TOKEN}":
                    with outer._lock:
                        outer.refused += 1
                    self.send_response(401)
                    self.end_headers()
                    return
                report = AgentReport.model_validate_json(body)
                with outer._lock:
                    outer.reports.append(report)
                    outer.received_at.append(time.time())
                answer = json.dumps({"epoch": outer.epoch}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(answer)  # the agent gave up waiting (its timeout); it will report again

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """What agents get as MEGATRON_OPERATOR_URL."""
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def arrival_of(self, report: AgentReport) -> float:
        """Wall-clock time at which ``report`` arrived."""
        with self._lock:
            return next(t for r, t in zip(self.reports, self.received_at, strict=True) if r is report)

    def reports_from(self, pod: str) -> list[AgentReport]:
        """Every report of one pod, oldest first."""
        with self._lock:
            return [r for r in self.reports if r.pod == pod]

    def wait_report(self, pod: str, predicate: Callable[[AgentReport], bool], timeout: float, what: str) -> AgentReport:
        """The first report of ``pod`` matching ``predicate``."""
        return wait_for(
            lambda: next((r for r in self.reports_from(pod) if predicate(r)), None),
            timeout,
            f"a heartbeat from {pod} with {what}",
        )

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
