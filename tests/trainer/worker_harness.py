"""Test harness for real worker processes: the test plays agent and operator.

It spawns ``python -m megatron_trainer.worker`` per local slot with its own socketpair, hosts the
rendezvous TCPStore (as an agent does), reads every message the workers send, sees EOF when one
dies, and builds plans with small builders. Like the agent, it starts each worker as the leader of
a process group of its own and ends the whole group, so a worker's children (the checkpoint
writer, the multiprocessing manager) never outlive it. Used by the ``test_worker_*`` modules and by the GPU
benchmark (``benchmarks/trainer_recovery.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from localcluster import waiting
from megatron_contract import wire
from megatron_contract.job import MegatronJobSpec
from megatron_contract.mesh import (
    BatchGeometry,
    HolderRun,
    MeshPlan,
    MeshSizes,
    OptimizerSourceKind,
    OptimizerStatePlan,
    PlanMember,
    PlanReason,
    Rendezvous,
    StateSource,
    StateSourceKind,
)
from megatron_trainer.agent.supervisor import signal_group
from megatron_trainer.channel import (
    Assign,
    Channel,
    CollectiveFailed,
    Hello,
    PhaseTimes,
    Progress,
    ReplicaSteps,
    Shutdown,
    ToAgent,
    WorkerStatus,
)
from megatron_trainer.faults import ENV_FAULT_LOG, ENV_FAULTS, FaultPlan
from megatronjob_builders import small_spec

REPO = Path(__file__).resolve().parents[2]
JOB_UID = "00000000-0000-0000-0000-00000000f00d"


# Steps of the tiny models take tens of milliseconds: poll often enough to see each one.
wait_for = partial(waiting.wait_for, interval=0.02)


def make_spec(
    replicas: int = 2,
    spares: int = 0,
    tp: int = 2,
    gpus_per_pod: int = 2,
    min_replicas: int = 1,
    train_iters: int = 8,
    global_batch_size: int = 8,
    collective_timeout: float = 10.0,
    training: dict[str, Any] | None = None,
    detection: dict[str, Any] | None = None,
    **model: Any,
) -> MegatronJobSpec:
    """The workers' small job (:func:`megatronjob_builders.small_spec`: a tiny GPT unless ``model``
    names a preset), with a fixed seed and learning rate.
    ``training`` adds TrainingSpec fields (optimizer, lrSchedule, ...); ``detection``
    FailureDetectionSpec fields (hang_detection_step_multiple, ...); ``model`` ModelSpec fields."""
    return small_spec(
        replicas=replicas,
        min_replicas=min_replicas,
        spares=spares,
        tp=tp,
        gpus_per_pod=gpus_per_pod,
        model=model,
        training={
            "global_batch_size": global_batch_size,
            "train_iters": train_iters,
            "lr": 1e-3,
            "seed": 1234,
            **(training or {}),
        },
        failure_detection={
            "heartbeat_interval_seconds": 1.0,
            "heartbeat_timeout_seconds": 5.0,
            "collective_timeout_seconds": collective_timeout,
            **(detection or {}),
        },
    )


def make_plan(
    spec: MegatronJobSpec,
    epoch: int,
    pods: list[str],
    store_port: int,
    resume_step: int = 0,
    reason: PlanReason = PlanReason.INITIAL,
    sources: dict[int, StateSource] | None = None,
    buddies: bool = False,
) -> MeshPlan:
    """A plan where ``pods`` (in order) hold consecutive ranks; dp follows from their number.

    ``sources`` overrides the state source of some ranks; the rest are ``init`` at epoch 1 and
    ``self`` afterwards. ``buddies`` (a first epoch, or one whose ranks keep their state) asks the
    distributed optimizer's ranks to keep buddy copies, every ``replicaIntervalSteps`` of the spec.
    """
    world = len(pods) * spec.gpus_per_pod
    dp = world // spec.model_parallel
    sizes = MeshSizes(world=world, tp=spec.tp, pp=spec.pp, cp=spec.cp, dp=dp, ep=spec.ep)
    members = [
        PlanMember(pod=p, address="127.0.0.1", ranks=list(range(i * spec.gpus_per_pod, (i + 1) * spec.gpus_per_pod)))
        for i, p in enumerate(pods)
    ]
    default = StateSourceKind.INIT if epoch == 1 else StateSourceKind.SELF
    sources = sources or {}
    state_sources = [sources.get(r) or StateSource(rank=r, kind=default) for r in range(world)]
    optimizer_state = None
    if buddies:
        if sources:
            raise ValueError("buddies in a plan with sources other than init (epoch 1) or self")
        state_sources = []  # the optimizer's source is the plan's, for every rank
        optimizer_state = OptimizerStatePlan(
            replica_interval_steps=spec.training.optimizer.replica_interval_steps,
            replica_cost_percent=spec.training.optimizer.replica_cost_percent,
            buddies=True,
            source=OptimizerSourceKind.INIT if epoch == 1 else OptimizerSourceKind.SELF,
            previous_sizes=None if epoch == 1 else sizes,
            holders=[] if epoch == 1 else HolderRun.runs_of(list(range(world))),
        )
    return MeshPlan(
        job_uid=JOB_UID,
        epoch=epoch,
        reason=reason,
        sizes=sizes,
        gpus_per_pod=spec.gpus_per_pod,
        batch=BatchGeometry.split(spec.training.global_batch_size, spec.training.micro_batch_size, dp),
        rendezvous=Rendezvous(host="127.0.0.1", port=store_port, store_prefix=Rendezvous.prefix_for(JOB_UID, epoch)),
        members=members,
        resume_step=resume_step,
        default_source=default if buddies else StateSourceKind.SELF,
        state_sources=state_sources,
        optimizer_state=optimizer_state,
    )


def peer_sources(
    spec: MegatronJobSpec, receivers: Iterable[int], donors: Iterable[int], world: int | None = None
) -> dict[int, StateSource]:
    """Each receiving rank takes state from the donor rank with the same position in its replica
    (and, given the plan's ``world``, the same expert-parallel rank: the same shard)."""
    if world is None:
        key: Callable[[int], object] = lambda r: r % spec.model_parallel  # noqa: E731
    else:
        sizes = MeshSizes(world=world, tp=spec.tp, pp=spec.pp, cp=spec.cp, dp=world // spec.model_parallel, ep=spec.ep)
        key = sizes.shard_key
    donor_by_key = {key(d): d for d in donors}
    return {r: StateSource(rank=r, kind=StateSourceKind.PEER, peer_rank=donor_by_key[key(r)]) for r in receivers}


@dataclasses.dataclass(eq=False)
class WorkerProcess:
    """One real worker process and every message it sent."""

    pod: str
    local_rank: int
    process: subprocess.Popen[bytes]
    channel: Channel
    log_path: Path
    messages: list[ToAgent] = dataclasses.field(default_factory=list)
    eof: threading.Event = dataclasses.field(default_factory=threading.Event)
    eof_at: float | None = None

    @property
    def name(self) -> str:
        return f"{self.pod}/{self.local_rank}"

    def send(self, message: Assign | Shutdown) -> None:
        with contextlib.suppress(OSError):
            self.channel.send(message)

    def of_type[M](self, kind: type[M]) -> list[M]:
        return [m for m in list(self.messages) if isinstance(m, kind)]

    def last_step(self) -> int:
        steps = self.of_type(Progress)
        return steps[-1].step if steps else 0

    def states(self) -> list[str]:
        return [m.state for m in self.of_type(WorkerStatus)]

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def spawn_with_channel(
    command: list[str], env: dict[str, str], log_path: Path
) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """Start ``command`` as the agent starts a worker: ``--channel-fd N`` appended, the other end of a
    socket pair returned with the process, output to ``log_path``, in a process group of its own."""
    ours, theirs = socket.socketpair()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*command, "--channel-fd", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            process_group=0,
        )
    theirs.close()
    return process, ours


def run_rank_scripts(script: str, rank_args: Callable[[int], list[str]], world: int, timeout: float) -> list[Any]:
    """Run ``python -c script *rank_args(r)`` for every rank ``r`` of ``world``, each in a process
    group of its own, and return the JSON each printed last; a rank that fails fails the test with
    its stderr. Every group still running at the end (one failed, others wait for it) is killed."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *rank_args(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            process_group=0,
        )
        for r in range(world)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-4000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                signal_group(p.pid, signal.SIGKILL)
                p.wait()
    return results


#: The ``make_cluster`` fixture (conftest.py): ``WorkerCluster``'s arguments, closed after the test.
MakeCluster = Callable[..., "WorkerCluster"]


def fault_env(workdir: Path, faults: FaultPlan) -> dict[str, str]:
    """Workers' environment that injects ``faults`` and logs each one that fires (:func:`fired`)."""
    return {ENV_FAULTS: faults.to_env(), ENV_FAULT_LOG: str(workdir / "faults.jsonl")}


def fired(workdir: Path) -> list[dict[str, Any]]:
    """The faults of :func:`fault_env` that fired so far, in order."""
    path = workdir / "faults.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def failure_free_losses(
    spec: MegatronJobSpec, workdir: Path, extra_env: dict[str, str] | None = None
) -> dict[int, float]:
    """Loss of every step of a run of ``spec`` over pods ``a`` and ``b`` without faults: what a run
    with the same seed and mesh must reproduce. Its logs are printed if it fails."""
    pods = ["a", "b"]
    cluster = WorkerCluster(spec, workdir, extra_env)
    try:
        cluster.boot(pods)
        cluster.assign(cluster.plan(pods))
        cluster.wait_succeeded(pods)
        losses = cluster.losses(pods)
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.close()
    assert sorted(losses) == list(range(1, spec.training.train_iters + 1))
    return losses


class WorkerCluster:
    """Pods of real workers, the rendezvous store, and the operator's bookkeeping."""

    def __init__(
        self, spec: MegatronJobSpec, workdir: Path, extra_env: dict[str, str] | None = None, python: str | None = None
    ) -> None:
        import torch.distributed as dist

        self.spec = spec
        self.workdir = workdir
        self.extra_env = dict(extra_env or {})
        self.python = python or sys.executable
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.store_port = self.store.port
        self.pods: dict[str, list[WorkerProcess]] = {}
        self.sample_dir = workdir / "samples"
        self.sample_dir.mkdir(parents=True, exist_ok=True)
        self.epoch = 0

    # -- processes -------------------------------------------------------------------------------

    def env(self, pod: str) -> dict[str, str]:
        roots = [str(REPO / r) for r in ("contract", "trainer")]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")]),
            wire.ENV_JOB_SPEC: json.dumps(self.spec.to_wire()),
            wire.ENV_POD_NAME: pod,
            "MEGATRON_WORKER_SAMPLE_LOG": str(self.sample_dir),
            "OMP_NUM_THREADS": "1",  # two CPU cores shared by every worker of a test
            "PYTHONUNBUFFERED": "1",
        }
        env.update(self.extra_env)
        return env

    def start_pod(self, pod: str, env: dict[str, str] | None = None) -> list[WorkerProcess]:
        """Spawn one worker per local slot of a pod (``env`` adds to its environment, e.g. the
        pod's CUDA_VISIBLE_DEVICES)."""
        workers = []
        for local_rank in range(self.spec.gpus_per_pod):
            log_path = self.workdir / f"{pod}-{local_rank}.log"
            command = [self.python, "-m", "megatron_trainer.worker", "--local-rank", str(local_rank)]
            process, ours = spawn_with_channel(command, {**self.env(pod), **(env or {})}, log_path)
            worker = WorkerProcess(pod, local_rank, process, Channel(ours), log_path)
            threading.Thread(target=self._pump, args=(worker,), daemon=True).start()
            workers.append(worker)
        self.pods[pod] = workers
        return workers

    def _pump(self, worker: WorkerProcess) -> None:
        while True:
            try:
                message = worker.channel.recv_to_agent()
            except (OSError, ValueError):
                message = None
            if message is None:
                worker.eof_at = time.time()
                worker.eof.set()
                return
            worker.messages.append(message)

    def workers(self, pods: Iterable[str] | None = None) -> list[WorkerProcess]:
        names = self.pods if pods is None else pods
        return [w for p in names for w in self.pods[p]]

    def boot(self, pods: Sequence[str]) -> None:
        """Start ``pods`` and wait until all their workers are ready (warm spares, no plan yet)."""
        for pod in pods:
            self.start_pod(pod)
        self.wait_ready(pods)

    def wait_ready(self, pods: Iterable[str], timeout: float = 180.0) -> None:
        """Wait for every worker's Hello (imports done, warm model built)."""
        for w in self.workers(pods):
            wait_for(lambda w=w: w.of_type(Hello) or self._dead(w), timeout, f"hello from {w.name}")

    def _dead(self, w: WorkerProcess) -> bool:
        if w.eof.is_set():
            raise AssertionError(f"worker {w.name} exited early:\n{w.log_tail()}")
        return False

    def kill_pod(self, pod: str, sig: int = signal.SIGKILL) -> None:
        """What the agent/kubelet does to a failed pod: kill every worker of it, children included."""
        for w in self.pods[pod]:
            signal_group(w.process.pid, sig)
        for w in self.pods[pod]:
            w.process.wait(timeout=30)
            w.eof.wait(timeout=30)

    def fail_pod_on_injected_kill(
        self, pod: str, local_rank: int, timeout: float, survivors: Sequence[str] = ()
    ) -> None:
        """The injected SIGKILL of worker ``local_rank`` of ``pod`` happens within ``timeout``; the pod
        is then failed as a whole (as its agent does) and every worker of ``survivors`` reports
        the failed collective of the current epoch."""
        victim = self.pods[pod][local_rank]
        assert victim.eof.wait(timeout), "the injected SIGKILL did not happen"
        assert victim.process.wait(10) == -signal.SIGKILL
        self.kill_pod(pod)
        self.wait_failed_reports(survivors, epoch=self.epoch)

    # -- plans -----------------------------------------------------------------------------------

    def assign(self, plan: MeshPlan, pods: Iterable[str] | None = None) -> None:
        """Push a plan to the workers of ``pods`` (default: every live pod)."""
        self.epoch = plan.epoch
        for w in self.workers(pods if pods is not None else self.live_pods()):
            w.send(Assign(plan=plan, pod=w.pod))

    def replace_with_spare(self, spare: str, survivor: str) -> int:
        """The operator's part after the first pod of a two-pod mesh failed: plan ``spare`` into its
        ranks, with state from their DP peers on ``survivor``, from the step the survivor holds
        (returned)."""
        resume = max(w.last_step() for w in self.workers([survivor]))
        gpus = self.spec.gpus_per_pod
        sources = peer_sources(self.spec, range(gpus), range(gpus, 2 * gpus))
        self.assign(self.plan([spare, survivor], resume, reason=PlanReason.REPLACE, sources=sources), [spare, survivor])
        return resume

    def live_pods(self) -> list[str]:
        return [p for p, ws in self.pods.items() if not any(w.eof.is_set() for w in ws)]

    def plan(self, pods: list[str], resume_step: int = 0, **kwargs: Any) -> MeshPlan:
        return make_plan(self.spec, self.epoch + 1, pods, self.store_port, resume_step=resume_step, **kwargs)

    # -- observations ----------------------------------------------------------------------------

    def wait_failed_reports(self, pods: Iterable[str], epoch: int, timeout: float = 120.0) -> None:
        """Wait until every worker of ``pods`` reported a failed collective in ``epoch``."""
        for w in self.workers(pods):
            wait_for(
                lambda w=w: any(m.epoch == epoch for m in w.of_type(CollectiveFailed)) or self._dead(w),
                timeout,
                f"collective failure report from {w.name}",
            )

    def wait_steps(self, pods: Iterable[str], step: int, timeout: float = 180.0) -> None:
        """Wait until every worker of ``pods`` completed ``step`` steps."""
        for w in self.workers(pods):
            wait_for(lambda w=w: w.last_step() >= step or self._failed(w), timeout, f"{w.name} to reach step {step}")

    def wait_first_step(self, epoch: int, pods: Iterable[str], timeout: float = 300.0) -> float:
        """Wait until every worker of ``pods`` completed a step of ``epoch`` (polled every 2 ms);
        returns when it saw that (``time.time()``)."""
        workers = self.workers(pods)

        def done() -> bool:
            for w in workers:
                self.raise_if_failed(w)
            return all(any(p.epoch == epoch for p in w.of_type(Progress)) for w in workers)

        wait_for(done, timeout, f"first step of epoch {epoch}", interval=0.002)
        return time.time()

    def wait_succeeded(self, pods: Iterable[str], timeout: float = 180.0) -> None:
        for w in self.workers(pods):
            wait_for(lambda w=w: "succeeded" in w.states() or self._failed(w), timeout, f"{w.name} to succeed")

    def _failed(self, w: WorkerProcess) -> bool:
        self.raise_if_failed(w)
        return self._dead(w)

    def raise_if_failed(self, w: WorkerProcess) -> None:
        """Raise with the worker's log when it reported the failed state."""
        if "failed" in w.states():
            raise AssertionError(f"worker {w.name} failed:\n{w.log_tail()}")

    def losses(self, pods: Iterable[str]) -> dict[int, float]:
        """Loss of each completed step as the workers of ``pods`` reported it (they must agree)."""
        out: dict[int, float] = {}
        for w in self.workers(pods):
            for p in w.of_type(Progress):
                if p.step in out and out[p.step] != p.loss:
                    raise AssertionError(f"step {p.step}: {w.name} reports loss {p.loss!r}, another {out[p.step]!r}")
                out[p.step] = p.loss
        return out

    def phase_times(self) -> list[PhaseTimes]:
        return [m for w in self.workers() for m in w.of_type(PhaseTimes)]

    def sample_records(self) -> list[dict[str, Any]]:
        """Every committed step's samples, as the first rank of each replica logged them."""
        records = []
        for path in sorted(self.sample_dir.glob("*.jsonl")):
            records.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
        return records

    def logs(self) -> str:
        return "\n".join(f"===== {w.name} =====\n{w.log_tail()}" for w in self.workers())

    def close(self) -> None:
        """Shut every worker down; kill what does not exit."""
        for w in self.workers():
            w.send(Shutdown(reason="test over"))
        deadline = time.monotonic() + 20
        for w in self.workers():
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            signal_group(w.process.pid, signal.SIGKILL)  # a SIGSTOPped worker too, and any child left
            w.process.wait(timeout=10)
            with contextlib.suppress(OSError):
                w.channel.close()
        del self.store


def copy_steps(cluster: WorkerCluster, epoch: int) -> dict[str, list[int]]:
    """By pod, the steps every worker of it last reported complete copies of in ``epoch``, as the
    pod's agent reports them to the operator."""
    out: dict[str, list[int]] = {}
    for pod, workers in cluster.pods.items():
        reports = [[m.steps for m in w.of_type(ReplicaSteps) if m.epoch == epoch] for w in workers]
        if reports and all(reports):
            out[pod] = sorted(set.intersection(*(set(r[-1]) for r in reports)))
    return out


def in_memory_plan(
    cluster: WorkerCluster, pods: list[str], previous: MeshPlan, resume: int, reason: PlanReason
) -> MeshPlan:
    """The plan the operator makes with in-memory restore: its optimizer state from the operator's
    planner (imported here: benchmarks use this harness without the operator's sources)."""
    from megatron_operator.optimizer_sources import optimizer_sources

    base = cluster.plan(pods, resume_step=resume, reason=reason, buddies=len(pods) > 1)
    found = optimizer_sources(
        base.sizes,
        cluster.spec.gpus_per_pod,
        base.members,
        previous,
        interval_steps=cluster.spec.training.optimizer.replica_interval_steps,
        survivors_step=resume,
        previous_trained=True,
        copy_steps=copy_steps(cluster, previous.epoch),
        in_memory=True,
    )
    assert not found.reload, f"the planner reloads the checkpoint: {found}"
    assert found.resume_step is not None
    return MeshPlan.model_validate(
        base.model_dump() | {"optimizer_state": found.state, "resume_step": found.resume_step, "state_sources": []}
    )
