"""Chaos through the whole stack: a fault injector and a seeded chaos run.

:class:`FaultInjector` makes one fault happen to a running job on the local control plane: a
worker SIGKILLed or SIGSTOPped (hung), a pod's processes killed, a pod deleted, a node marked
NotReady (then Ready again), the operator killed and started again, kube-apiserver restarted, the
job's Service or token Secret deleted by hand, the newest checkpoint corrupted.

:func:`run` draws a sequence of faults from a seed (kinds, the moment each lands: during a step,
during a recovery, on the spare being promoted, around a checkpoint save, before the first
checkpoint; pauses, and faults landing together), runs a job through them next to a failure-free
twin of the same seed, and checks the invariants at the end:

- the job succeeds, or ends Failed with a reason; ``StateLost`` (no member and no checkpoint holds
  the state) only where faults hit at least as many pods as the job has members;
- every step of the job's final history was committed once, in one epoch, with exactly its
  global batch's samples and one loss all members agree on; steps trained again after a resume
  from a checkpoint are listed (``redone``), never silently doubled;
- every step's loss equals the failure-free twin's bit for bit while the mesh kept its data-parallel
  size (after a shrink, floating-point sums run in another order: the differences are reported);
- no process of the job's pods is left once the job is deleted.

The same seed draws the same faults (their timing relative to training varies with the machine).

    python -m localcluster.chaos --seed 7 --faults 50 --out benchmarks/results/chaos_50_faults.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from localcluster.cluster import REPO_ROOT, LocalCluster
from localcluster.jobs import GLOBAL_BATCH, tiny_job
from localcluster.nodeagent import NodeAgent
from localcluster.operator_run import OperatorProcess
from localcluster.waiting import wait_for

FAULTS = (
    "worker_sigkill",
    "worker_sigstop",
    "pod_kill",
    "pod_delete",
    "node_not_ready",
    "operator_restart",
    "apiserver_restart",
    "child_delete",
    "checkpoint_corrupt",
)
PHASES = ("step", "recovery", "promotion", "save", "before_checkpoint")
JOBS = "/apis/megatron.dev/v1alpha1/namespaces/{ns}/megatronjobs"
STUCK_SECONDS = 180.0  # no committed step for this long, faults or not: the job is stuck (a violation)
REPLICAS = 2  # members of the chaos job (and its twin)
NODE_DOWN_SECONDS = 8.0  # a NotReady node comes back after this (its pods kept running, or were failed)


class ChaosError(RuntimeError):
    """The run could not go on (the job never trained, a wait timed out)."""


class _Stuck(Exception):
    """The job stopped training during the run (recorded as a violation)."""


@dataclasses.dataclass
class Injected:
    """One fault as it happened."""

    index: int
    kind: str
    phase: str
    target: str
    at: float  # seconds since the run started
    step: int | None  # the job's step when it landed
    detail: str = ""


@dataclasses.dataclass
class Draw:
    kind: str
    phase: str
    together: bool  # lands with the previous fault, no pause between
    pause: float  # seconds before the next fault


def draw(seed: int, count: int) -> list[Draw]:
    """The faults of a run: kinds and phases, with pauses and some landing together."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind = rng.choice(FAULTS)
        phase = "before_checkpoint" if i == 0 and rng.random() < 0.5 else rng.choice(PHASES[:4])
        together = i > 0 and rng.random() < 0.2
        out.append(Draw(kind, phase, together, round(rng.uniform(0.0, 3.0), 2)))
    return out


class FaultInjector:
    """Makes faults happen to one job's pods, nodes, operator, API server, children and checkpoints."""

    def __init__(
        self,
        cluster: LocalCluster,
        nodes: NodeAgent,
        operator: OperatorProcess,
        namespace: str,
        job: str,
        checkpoint_dir: Path | None,
        rng: random.Random,
    ) -> None:
        self.cluster, self.nodes, self.operator = cluster, nodes, operator
        self.namespace, self.job, self.checkpoint_dir, self.rng = namespace, job, checkpoint_dir, rng
        self.victims: set[str] = set()  # pods whose processes a fault killed or stopped
        self._timers: list[threading.Timer] = []

    # -- what there is to hit -------------------------------------------------------------------------

    def pods(self, role: str | None = None) -> list[dict[str, Any]]:
        selector = f"megatron.dev/job={self.job}" + (f",megatron.dev/role={role}" if role else "")
        code, body = self.cluster.request("GET", f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={selector}")
        if code != 200:
            return []
        return [p for p in body["items"] if p.get("status", {}).get("phase") == "Running"]

    def status(self) -> dict[str, Any]:
        code, body = self.cluster.request("GET", JOBS.format(ns=self.namespace) + f"/{self.job}")
        return (body.get("status") or {}) if code == 200 else {}

    def _worker_pids(self, pod: str) -> list[int]:
        with self.nodes._lock:
            running = next(
                (p for p in self.nodes.pods.values() if p.namespace == self.namespace and p.name == pod), None
            )
        if running is None:
            return []
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getsid(int(entry.name)) != running.proc.pid:
                    continue
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except (OSError, ProcessLookupError):
                continue
            if b"megatron_trainer.worker" in cmdline:
                pids.append(int(entry.name))
        return pids

    # -- faults ---------------------------------------------------------------------------------------

    def inject(self, kind: str, target: str | None = None) -> tuple[str, str]:
        """Make ``kind`` happen (to ``target``, a pod, where it takes one; a random member by
        default); returns (target, detail)."""
        if kind in ("worker_sigkill", "worker_sigstop", "pod_kill", "pod_delete", "node_not_ready"):
            pod = target or self._random_pod()
            if pod is None:
                return "-", "no running pod to hit"
            if kind in ("worker_sigkill", "worker_sigstop"):
                pids = self._worker_pids(pod)
                if not pids:
                    return pod, "no worker process found"
                pid = self.rng.choice(pids)
                os.kill(pid, signal.SIGKILL if kind == "worker_sigkill" else signal.SIGSTOP)
                self.victims.add(pod)
                return pod, f"pid {pid}"
            if kind == "pod_kill":
                try:
                    self.nodes.kill_pod_process(self.namespace, pod, signal.SIGKILL)
                except KeyError:
                    return pod, "not running on the node agent"
                self.victims.add(pod)
                return pod, ""
            if kind == "pod_delete":
                code, _ = self.cluster.request("DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{pod}")
                self.victims.add(pod)
                return pod, f"HTTP {code}"
            node = self._node_of(pod)
            if node is None:
                return pod, "not scheduled"
            self.nodes.set_ready(False, [node])
            timer = threading.Timer(NODE_DOWN_SECONDS, self.nodes.set_ready, args=(True, [node]))
            timer.daemon = True
            timer.start()
            self._timers.append(timer)
            self.victims.add(pod)
            return f"node {node}", f"(pod {pod}) Ready again after {NODE_DOWN_SECONDS:.0f} s"
        if kind == "operator_restart":
            down = round(self.rng.uniform(0.2, 3.0), 2)
            self.operator.kill()
            time.sleep(down)
            self.operator.start()
            return "operator", f"down {down} s"
        if kind == "apiserver_restart":
            down = round(self.rng.uniform(0.0, 2.0), 2)
            self.cluster.restart_apiserver(down_seconds=down)
            return "kube-apiserver", f"down {down} s"
        if kind == "child_delete":
            which = self.rng.choice(("services", "secrets"))
            name = self.job if which == "services" else f"{self.job}-token"
            code, _ = self.cluster.request("DELETE", f"/api/v1/namespaces/{self.namespace}/{which}/{name}")
            return f"{which}/{name}", f"HTTP {code}"
        if kind == "checkpoint_corrupt":
            return self._corrupt_newest_checkpoint()
        raise ValueError(f"unknown fault {kind!r}; known: {', '.join(FAULTS)}")

    def _random_pod(self) -> str | None:
        members = [m["pod"] for m in (self.status().get("plan") or {}).get("members", [])]
        running = {p["metadata"]["name"] for p in self.pods()}
        fresh = [p for p in members if p in running and p not in self.victims]
        choice = fresh or [p for p in members if p in running] or sorted(running)
        return self.rng.choice(choice) if choice else None

    def _node_of(self, pod: str) -> str | None:
        code, body = self.cluster.request("GET", f"/api/v1/namespaces/{self.namespace}/pods/{pod}")
        return body.get("spec", {}).get("nodeName") if code == 200 else None

    def _corrupt_newest_checkpoint(self) -> tuple[str, str]:
        if self.checkpoint_dir is None:
            return "-", "the job writes no checkpoints"
        steps = sorted(
            (int(d.name.removeprefix("step-")), d)
            for d in self.checkpoint_dir.glob("step-*")
            if d.name.removeprefix("step-").isdigit()
        )
        if not steps:
            return "-", "no complete checkpoint yet"
        step, directory = steps[-1]
        files = sorted(
            (f for f in directory.rglob("*") if f.is_file() and f.name != "manifest.json"),
            key=lambda f: f.stat().st_size,
        )
        if not files:
            return directory.name, "no data file"
        victim = files[-1]
        # A random offset: flipping the same byte twice would mend the checkpoint.
        offset = self.rng.randrange(victim.stat().st_size) if victim.stat().st_size else 0
        with victim.open("r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([(byte[0] if byte else 0) ^ 0xFF]))
        where = f"{directory.name}/{victim.relative_to(directory)}"
        return where, f"byte {offset} flipped (checkpoint of step {step})"

    def heal(self) -> None:
        """Undo what outlives a fault: nodes back to Ready, stopped workers continued."""
        for timer in self._timers:
            timer.cancel()
        self.nodes.set_ready(True)
        for pod in list(self.victims):
            for pid in self._worker_pids(pod):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)


# -- the run --------------------------------------------------------------------------------------------


def chaos_job(name: str, pool: str, samples: Path, iters: int, spares: int, checkpoint: Path | None) -> dict[str, Any]:
    """The local tiny job (:func:`localcluster.jobs.tiny_job`) with the chaos run's stricter failure
    detection and no limit on recoveries, logging every committed step's samples and loss."""
    spec: dict[str, Any] = {
        "failureDetection": {
            "heartbeatIntervalSeconds": 1,
            "heartbeatTimeoutSeconds": 10,
            "collectiveTimeoutSeconds": 8,
            # CPU steps of processes sharing two cores stall for seconds: a hang is a stall past 4 s.
            "hangDetectionFloorSeconds": 4,
        },
        "maxRecoveries": 1000,
    }
    if checkpoint is not None:
        spec["checkpoint"] = {"path": str(checkpoint), "intervalSteps": 10, "keep": 3}
    return tiny_job(name, pool=pool, replicas=REPLICAS, spares=spares, train_iters=iters, samples=samples, **spec)


def read_samples(directory: Path) -> dict[tuple[int, int], list[dict[str, Any]]]:
    """(epoch, step) -> the records of every data-parallel rank that logged that step."""
    out: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for path in directory.glob("*.jsonl"):
        pod = path.stem.rsplit("-", 1)[0]
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                record["pod"] = pod
                out.setdefault((record["epoch"], record["step"]), []).append(record)
    return out


def check_history(
    records: dict[tuple[int, int], list[dict[str, Any]]], iters: int, global_batch: int, victims: set[str]
) -> tuple[list[str], dict[int, int], list[int]]:
    """Violations of the sample invariant; the final history (step -> epoch); steps trained again.

    A step's final epoch is the newest that committed it. Within it the step has exactly the samples
    [step*G, (step+1)*G), none twice, and one loss. A pod a fault killed after a step's last
    collective contributed to it but may not have logged it: only the step after such a pod's last
    logged one may lack samples, at most that pod's share.
    """
    problems: list[str] = []
    final: dict[int, int] = {}
    epochs_of: dict[int, set[int]] = {}
    for epoch, step in records:
        final[step] = max(final.get(step, epoch), epoch)
        epochs_of.setdefault(step, set()).add(epoch)
    missing = sorted(set(range(iters)) - set(final))
    if missing:
        problems.append(f"steps never committed: {missing[:20]}")
    extra = sorted(set(final) - set(range(iters)))
    if extra:
        problems.append(f"steps beyond the last: {extra[:20]}")
    last_logged: dict[tuple[str, int], tuple[int, int]] = {}  # (victim pod, epoch) -> (last step, share)
    for (epoch, step), recs in records.items():
        for r in recs:
            if r["pod"] in victims:
                key = (r["pod"], epoch)
                last_logged[key] = max(last_logged.get(key, (-1, 0)), (step, len(r["samples"])))
    for step, epoch in sorted(final.items()):
        recs = records[(epoch, step)]
        got = [s for r in recs for s in r["samples"]]
        want = set(range(step * global_batch, (step + 1) * global_batch))
        unlogged = sum(share for (pod, e), (last, share) in last_logged.items() if e == epoch and last + 1 == step)
        if len(got) != len(set(got)) or not set(got) <= want or len(want) - unlogged > len(got):
            problems.append(f"step {step} (epoch {epoch}) consumed {sorted(got)}, not {sorted(want)}")
        if len({r["loss"] for r in recs}) != 1:
            problems.append(f"step {step} (epoch {epoch}): members disagree on the loss")
    redone = sorted(s for s, es in epochs_of.items() if len(es) > 1)
    return problems, final, redone


def compare_losses(
    records: dict[tuple[int, int], list[dict[str, Any]]],
    final: dict[int, int],
    reference: dict[tuple[int, int], list[dict[str, Any]]],
) -> dict[str, Any]:
    """The final history's losses against the failure-free twin's: bitwise while every epoch so far
    trained at the twin's data-parallel size; after the first smaller mesh, the largest relative
    difference."""
    ref = {step: recs[0]["loss"] for (_, step), recs in reference.items()}
    ref_dp = max((r["dpRank"] for recs in reference.values() for r in recs), default=0) + 1
    shrunk_from: int | None = None
    unequal: list[int] = []
    worst = 0.0
    for step in sorted(final):
        recs = records[(final[step], step)]
        dp = max(r["dpRank"] for r in recs) + 1
        if dp < ref_dp and shrunk_from is None:
            shrunk_from = step
        loss, want = recs[0]["loss"], ref.get(step)
        if want is None:
            continue
        if shrunk_from is None and loss != want:
            unequal.append(step)
        elif shrunk_from is not None and want:
            worst = max(worst, abs(loss - want) / abs(want))
    return {
        "referenceDp": ref_dp,
        "bitwiseUntil": shrunk_from if shrunk_from is not None else (max(final) + 1 if final else 0),
        "unequalWhileFullMesh": unequal,
        "firstStepAtSmallerMesh": shrunk_from,
        "largestRelativeDifferenceAfter": worst,
    }


def leftover_processes(pod_prefixes: tuple[str, ...]) -> list[str]:
    """Processes whose environment names a pod of these jobs (MEGATRON_POD_NAME)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"MEGATRON_POD_NAME="):
                pod = item.split(b"=", 1)[1].decode(errors="replace")
                if pod.startswith(pod_prefixes):
                    found.append(f"pid {entry.name} ({pod})")
    return found


# A chaos run polls the API server; a timeout is the run's own error (some are expected: a stuck job).
_wait = partial(wait_for, interval=0.2, error=ChaosError)


def run(
    cluster: LocalCluster,
    nodes: NodeAgent,
    reference_nodes: NodeAgent,
    namespace: str,
    workdir: Path,
    seed: int,
    faults: int,
    iters: int,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """One chaos run (see the module's docstring); returns its record, with ``violations`` empty
    when every invariant held."""
    started = time.monotonic()
    rng = random.Random(seed + 1)
    name, ref_name = "chaos", "chaos-reference"
    samples, ref_samples, checkpoints = workdir / "samples", workdir / "samples-reference", workdir / "checkpoints"
    for directory in (samples, ref_samples, checkpoints):
        directory.mkdir(parents=True, exist_ok=True)
    pool, ref_pool = nodes.pool, reference_nodes.pool
    operator = OperatorProcess(cluster, namespace, workdir / "operator.log").start()
    injector = FaultInjector(cluster, nodes, operator, namespace, name, checkpoints, rng)
    injected: list[Injected] = []
    violations: list[str] = []
    record: dict[str, Any] = {"seed": seed, "faults": faults, "iters": iters}
    try:
        for body in (
            chaos_job(name, pool, samples, iters, spares=2, checkpoint=checkpoints),
            chaos_job(ref_name, ref_pool, ref_samples, iters, spares=0, checkpoint=None),
        ):
            code, resp = cluster.request("POST", JOBS.format(ns=namespace), body)
            if code != 201:
                raise ChaosError(f"could not create {body['metadata']['name']}: {code} {resp}")
        _wait(lambda: (injector.status().get("step") or 0) >= 3, 300, "the job to train 3 steps")
        progress = (3, time.monotonic())  # (newest step seen, when): a job that stops training is stuck
        previous_epoch = injector.status().get("epoch", 0)
        for i, d in enumerate(draw(seed, faults)):
            status = injector.status()
            if status.get("phase") in ("Succeeded", "Failed"):
                say(f"[chaos] the job ended before fault {i + 1}; {len(injected)} faults injected")
                break
            target = _await_phase(injector, d, previous_epoch, iters)
            status = injector.status()
            step = status.get("step") or 0
            if step > progress[0]:
                progress = (step, time.monotonic())
            elif time.monotonic() - progress[1] > STUCK_SECONDS:
                stuck = (
                    f"no step committed for {time.monotonic() - progress[1]:.0f} s (at step {step}, phase "
                    f"{status.get('phase')}, epoch {status.get('epoch')}) after fault {len(injected)}"
                )
                say(f"[chaos] {stuck}: stopping")
                violations.append(f"the job is stuck: {stuck}")
                break
            previous_epoch = status.get("epoch", previous_epoch)
            try:
                where, detail = injector.inject(d.kind, target)
            except Exception as err:  # a fault that cannot be made is recorded, not fatal
                where, detail = target or "-", f"not injected: {type(err).__name__}: {err}"
            fault = Injected(
                i + 1, d.kind, d.phase, where, round(time.monotonic() - started, 2), status.get("step"), detail
            )
            injected.append(fault)
            say(
                f"[chaos] {fault.index:>3} t={fault.at:7.2f}s step={fault.step} {d.kind} ({d.phase}) -> {where} "
                f"{detail}"
            )
            if not d.together:
                time.sleep(d.pause)
        if violations:  # stuck: no point waiting for the end
            raise _Stuck

        def ended_or_stuck() -> dict[str, Any] | None:
            nonlocal progress
            s = injector.status()
            if s.get("phase") in ("Succeeded", "Failed"):
                return s
            if (s.get("step") or 0) > progress[0]:
                progress = (s.get("step") or 0, time.monotonic())
            elif time.monotonic() - progress[1] > STUCK_SECONDS:
                stuck = (
                    f"no step committed for {STUCK_SECONDS:.0f} s after the last fault (at step "
                    f"{s.get('step')}, phase {s.get('phase')}, epoch {s.get('epoch')})"
                )
                say(f"[chaos] {stuck}")
                violations.append(f"the job is stuck: {stuck}")
                raise _Stuck
            return None

        final = _wait(ended_or_stuck, max(600.0, iters * 1.5), "the job to end")
        _wait(
            lambda: (
                (cluster.request("GET", JOBS.format(ns=namespace) + f"/{ref_name}")[1].get("status") or {}).get("phase")
                in ("Succeeded", "Failed")
            ),
            600,
            "the failure-free twin to end",
        )
        record["phase"] = final["phase"]
        record["recoveries"] = final.get("recoveries")
        record["goodput"] = final.get("goodput")
        if final["phase"] != "Succeeded":
            reason: dict[str, Any] = next((c for c in final.get("conditions", []) if c["type"] == "Failed"), {})
            record["reason"] = reason
            if not reason.get("reason") or not reason.get("message"):
                violations.append(f"the job ended {final['phase']} without a reason: {final.get('conditions')}")
            elif reason["reason"] == "StateLost" and len(injector.victims) < REPLICAS:
                # Every copy of the state is gone only when faults hit every member (before a checkpoint).
                violations.append(
                    f"the job lost its state though faults hit only {sorted(injector.victims)}: {reason['message']}"
                )
        else:
            records, ref_records = read_samples(samples), read_samples(ref_samples)
            problems, history, redone = check_history(records, iters, GLOBAL_BATCH, injector.victims)
            violations += problems
            record["redoneSteps"] = redone
            record["losses"] = compare_losses(records, history, ref_records)
            if record["losses"]["unequalWhileFullMesh"]:
                violations.append(
                    f"losses differ from the failure-free run at steps "
                    f"{record['losses']['unequalWhileFullMesh'][:20]} (full mesh)"
                )
    except (_Stuck, ChaosError) as err:
        if not isinstance(err, _Stuck):
            violations.append(str(err))
        record["phase"] = injector.status().get("phase")
    finally:
        injector.heal()
        for job in (name, ref_name):
            cluster.request("DELETE", JOBS.format(ns=namespace) + f"/{job}")
        try:
            _wait(
                lambda: not any(p.namespace == namespace for a in (nodes, reference_nodes) for p in a.pods.values()),
                90,
                "the jobs' pods to go",
            )
        except ChaosError as err:
            violations.append(str(err))
        operator.stop()
        left = leftover_processes((f"{name}-",))
        if left:
            violations.append(f"processes left behind: {left}")
    record["injected"] = [dataclasses.asdict(f) for f in injected]
    record["violations"] = violations
    record["seconds"] = round(time.monotonic() - started, 1)
    return record


def _await_phase(injector: FaultInjector, d: Draw, previous_epoch: int, iters: int) -> str | None:
    """Wait for the moment ``d.phase`` names; the pod to hit when the phase picks one."""

    def training() -> bool:
        s = injector.status()
        return s.get("phase") in ("Running", "Degraded") and s.get("committedEpoch") == s.get("epoch")

    if d.together:
        return None
    if d.phase == "recovery":
        return None  # right after the previous fault: its recovery, if any, is under way
    if d.phase == "promotion":
        # The newest plan's members that were spares before it: hit one while it joins.
        try:
            s = _wait(lambda: (s := injector.status()).get("epoch", 0) > previous_epoch and s, 15, "a new plan")
        except ChaosError:
            return None
        members = [m["pod"] for m in s["plan"]["members"]]
        promoted = [p for p in members if p not in injector.victims]
        return injector.rng.choice(promoted) if promoted else None
    try:
        _wait(training, 120, "the job to train")
    except ChaosError:
        return None  # faults keep coming while a job is stuck: that is the point
    if d.phase == "save":
        step = injector.status().get("step") or 0
        boundary = (step // 10 + 1) * 10
        if boundary < iters:
            with contextlib.suppress(ChaosError):
                _wait(lambda: (injector.status().get("step") or 0) >= boundary - 1, 60, "a save")
    else:
        time.sleep(injector.rng.uniform(0.0, 0.8))  # somewhere inside a step
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--iters", type=int, default=0, help="training steps (default: 12 per fault, at least 160)")
    parser.add_argument("--out", type=Path, help="write the run's record (JSON) here")
    args = parser.parse_args(argv)
    iters = args.iters or max(160, 12 * args.faults)
    workdir = REPO_ROOT / ".localcluster" / "chaos"
    cluster = LocalCluster(workdir)
    try:
        cluster.start()
        cluster.install_crds()
        nodes = cluster.add_process_nodes(6, gpus_per_node=1, prefix="chaos")
        reference_nodes = cluster.add_process_nodes(2, gpus_per_node=1, prefix="chaosref")
        for stale in ("samples", "samples-reference", "checkpoints"):
            for f in sorted((workdir / stale).rglob("*"), reverse=True):
                f.unlink() if f.is_file() else f.rmdir()
        record = run(cluster, nodes, reference_nodes, "default", workdir, args.seed, args.faults, iters)
    except ChaosError as err:
        print(f"chaos: {err} (seed {args.seed}; logs in {workdir})", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
    print(json.dumps({k: v for k, v in record.items() if k != "injected"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    if record["violations"]:
        print(
            f"chaos: {len(record['violations'])} invariant(s) broken; reproduce with --seed {args.seed}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
