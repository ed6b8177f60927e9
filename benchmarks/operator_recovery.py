"""Benchmark: the operator at scale. For each job size, from creation to a failure's plan pushed.

Starts the local control plane with kwok fake GPU nodes, runs the operator as a real process,
serves recording agents at every pod's loopback address (they heartbeat like agents, every
``--heartbeat-seconds``: a training step more each time), submits a job of ``--workers`` worker
pods (1 GPU each) with hot spares, then repeatedly deletes a random member pod and measures:

- create: the job created → every child pod exists, → every pod running, → the first step;
- stored: deletion → a watch on the job sees the next epoch in its status;
- pushed: deletion → the last member's agent received the plan (timestamps taken by the agents,
  which run in a process of their own);
- the API server's write load from the job object while it trains without failures: status writes
  per second and the bytes of the object each write stores (every write stores the whole object);
- the operator's CPU seconds (user + system, its push processes' included) per phase and its peak
  resident memory (VmHWM), and that of each push process apart; the peak as each phase ends, to
  show which phase raised it, and its RSS twice a second by wall-clock time (to read beside its log).

Between failures it waits for the spare pool to be full again, so every failure is a replacement.
Each size runs on a fresh control plane. Prints figures, each failure split into its parts from the
operator's log (``failure_split.py``), and a table of how they grow with size; asserts nothing about
speed.

    PYTHONPATH=contract:operator:trainer:localcluster:tests/operator \\
        python benchmarks/operator_recovery.py --workers 256 1024 4096 --failures 30 \\
        --out benchmarks/results/operator_scale.json
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import zlib
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "operator")]

from failure_split import format_split, long_collections, split_failures  # noqa: E402
from operator_factories import make_job  # noqa: E402
from operator_harness import JobApi, OperatorProcess, RecordingAgents, pod_runs  # noqa: E402

from localcluster.cluster import LocalCluster  # noqa: E402
from localcluster.waiting import wait_for  # noqa: E402
from megatron_contract.wire import LABEL_JOB  # noqa: E402
from megatron_operator.settings import GC_THRESHOLDS  # noqa: E402

JOB = "bench"


def _agents_main(conn: Connection, token: str, job_uid: str, operator_url: str, period: float) -> None:
    """The recording agents, in a process of their own (so the benchmark's polling cannot slow them).
    They heartbeat like agents (warm spares, then training steps): the operator promotes only warm
    spares and counts a job as training only on committed steps."""
    agents = RecordingAgents(lambda: token)
    agents.job_uid, agents.operator_urls = job_uid, [operator_url]
    agents.start_heartbeats(period=period)
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "sync":
                agents.sync([{"metadata": {"name": n}, "status": {"podIP": ip}} for n, ip in arg])
                conn.send(None)
            elif cmd == "received":
                conn.send([(r.pod, r.epoch, r.at, r.status) for r in agents.received[arg:]])
            else:
                break
    finally:
        agents.close()


class AgentsProcess:
    """RecordingAgents in a child process; time.monotonic() is system-wide, so its stamps compare."""

    def __init__(self, token: str, job_uid: str, operator_url: str, period: float) -> None:
        self._conn, child = mp.Pipe()
        self._proc = mp.get_context("fork").Process(
            target=_agents_main, args=(child, token, job_uid, operator_url, period), daemon=True
        )
        self._proc.start()

    # Asked from the benchmark's main thread only: every process gets its question before any
    # answer is read, so the processes work on them at once.
    def ask(self, cmd: str, arg: Any) -> None:
        self._conn.send((cmd, arg))

    def answer(self) -> Any:
        return self._conn.recv()

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(("quit", None))
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


class AgentsPool:
    """The recording agents split over ``processes`` child processes, each serving the pod addresses
    that hash to it (by address, not name: kwok gives a new pod a freed pod's address, and only the
    process that listens there can serve it). In production each agent answers on its own machine;
    one Python process answering every push of a 4096-pod job (0.6-1.0 s of a core) measured
    itself, not the operator, wherever a core was free for a second one."""

    def __init__(self, processes: int, token: str, job_uid: str, operator_url: str, period: float) -> None:
        self._children = [AgentsProcess(token, job_uid, operator_url, period) for _ in range(processes)]
        self._cursors = [0] * processes

    def _share(self, address: str) -> int:
        return zlib.crc32(address.encode()) % len(self._children)

    def sync(self, pods: list[dict[str, Any]]) -> None:
        shares: list[list[tuple[str, str]]] = [[] for _ in self._children]
        for p in pods:
            name, address = p["metadata"]["name"], p["status"]["podIP"]
            shares[self._share(address)].append((name, address))
        for child, share in zip(self._children, shares, strict=True):
            child.ask("sync", share)
        for child in self._children:
            child.answer()

    def new_receipts(self) -> list[tuple[str | None, int, float, int]]:
        """Every plan the agents received since the last call: (pod, epoch, when, answer)."""
        for child, cursor in zip(self._children, self._cursors, strict=True):
            child.ask("received", cursor)
        news: list[tuple[str | None, int, float, int]] = []
        for i, child in enumerate(self._children):
            got = child.answer()
            self._cursors[i] += len(got)
            news += got
        return news

    def close(self) -> None:
        for child in self._children:
            child.close()


class RssSampler:
    """The operator's resident memory (VmRSS) twice a second, with wall-clock times to read beside
    its log: which of its actions the memory grows with."""

    def __init__(self, pid: int, every: float = 0.5) -> None:
        self.samples: list[tuple[float, float]] = []  # (time.time(), MiB)
        self._pid, self._every = pid, every
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self._every):
            try:
                self.samples.append((time.time(), proc_status(self._pid)["VmRSS"] / 1024))
            except OSError:  # the operator ended
                return

    def stop(self) -> list[tuple[float, float]]:
        self._stopped.set()
        self._thread.join(5)
        return self.samples


class _Watch:
    """A watch of one kind of object, in a thread of its own; begun again (listing every object
    again) when it ends or fails."""

    def __init__(self, name: str, list_objects: Any, *args: Any, **kwargs: Any) -> None:
        from kubernetes import watch

        self._name, self._list, self._args, self._kwargs = name, list_objects, args, kwargs
        self._watch = watch.Watch(return_type=object)  # plain dicts, not the client's model objects
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._begin()
            try:
                for event in self._watch.stream(self._list, *self._args, **self._kwargs):
                    self._event(event["type"], event["raw_object"])
            except Exception as exc:
                if not self._stopped.is_set():
                    print(f"{self._name} watch: {exc}", file=sys.stderr)
                self._stopped.wait(0.5)

    def _begin(self) -> None:
        """Each (re)start, before the listing's events."""

    def _event(self, type: str, obj: dict[str, Any]) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stopped.set()
        self._watch.stop()


class EpochWatch(_Watch):
    """Watches the job and stamps the moment each epoch first appears in its status (a lost event
    only delays a stamp)."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        from kubernetes import client, config

        api = client.CustomObjectsApi(config.new_client_from_config(str(kubeconfig)))
        super().__init__(
            "job",
            api.list_namespaced_custom_object,
            "megatron.dev",
            "v1alpha1",
            namespace,
            "megatronjobs",
            field_selector=f"metadata.name={JOB}",
            timeout_seconds=300,
        )
        self.first_seen: dict[int, float] = {}
        self.plans: dict[int, dict[str, Any]] = {}  # epoch -> the plan as first seen with it
        self.status: dict[str, Any] = {}  # the newest status seen
        self.writes: list[tuple[float, int]] = []  # (monotonic, bytes of the object) per event
        self._thread.start()

    def _event(self, type: str, obj: dict[str, Any]) -> None:
        now = time.monotonic()
        status = obj.get("status") or {}
        epoch = status.get("epoch") or 0
        self.status = status
        if epoch not in self.first_seen:
            self.plans[epoch] = status.get("plan") or {}
            self.first_seen[epoch] = now  # after the plan: a reader waits on this
        if type == "MODIFIED":
            self.writes.append((now, len(json.dumps(obj, separators=(",", ":")))))


class PodWatch(_Watch):
    """The job's pods as a watch sees them. Listing its 4100 pods (~15 MB of JSON) five times a second
    while the spare pool refilled, and reading the 0.5 MB job as often, loaded the API server the
    operator was being measured against (and this host) just before each failure."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        from kubernetes import client, config

        api = client.CoreV1Api(config.new_client_from_config(str(kubeconfig)))
        super().__init__(
            "pod", api.list_namespaced_pod, namespace, label_selector=f"{LABEL_JOB}={JOB}", timeout_seconds=3600
        )
        self._lock = threading.Lock()
        self._pods: dict[str, str | None] = {}  # name -> address while it runs, else None
        self._thread.start()

    def _begin(self) -> None:
        with self._lock:  # the listing tells every pod again; a pod deleted meanwhile would stay
            self._pods.clear()

    def _event(self, type: str, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        with self._lock:
            if type == "DELETED":
                self._pods.pop(name, None)
            else:
                self._pods[name] = pod["status"]["podIP"] if pod_runs(pod) else None

    def count(self) -> int:
        with self._lock:
            return len(self._pods)

    def running(self) -> list[dict[str, Any]]:
        """The running pods, shaped as the agents' sync takes them."""
        with self._lock:
            return [{"metadata": {"name": n}, "status": {"podIP": ip}} for n, ip in self._pods.items() if ip]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank)."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def children(pid: int) -> list[int]:
    """The live child processes of ``pid`` (the operator's: its push processes)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of a process and its children (the live ones and those it
    reaped): the operator's push processes count as the operator's."""
    total = process_cpu_seconds(pid, reaped=True)
    for child in children(pid):
        try:
            total += process_cpu_seconds(child)
        except OSError:  # it exited meanwhile
            continue
    return total


def process_cpu_seconds(pid: int, reaped: bool = False) -> float:
    """User + system CPU seconds of one process so far (``reaped``: with the children it reaped)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # the name may hold spaces
    return sum(int(f) for f in fields[11 : 15 if reaped else 13]) / os.sysconf("SC_CLK_TCK")


def proc_status(pid: int) -> dict[str, int]:
    """The numeric fields of /proc/PID/status (memory in KiB), by name."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        first = value.split()[:1]
        if first and first[0].isdigit():
            out[key] = int(first[0])
    return out


def peak_rss_mib(pid: int) -> float:
    peak = proc_status(pid).get("VmHWM")
    return peak / 1024 if peak is not None else float("nan")


def memory_now(pid: int) -> dict[str, float]:
    """What the operator's resident memory is made of at the end (MiB; its threads, counted): heap
    and other anonymous pages against mapped files (the interpreter, its libraries)."""
    status = proc_status(pid)
    mib = {"RssAnon": "anon_mib", "RssFile": "file_mib", "RssShmem": "shmem_mib"}
    return {**{name: round(status[key] / 1024, 1) for key, name in mib.items()}, "threads": status["Threads"]}


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
        "mean": statistics.mean(values),
    }


def run_size(args: argparse.Namespace, workers: int) -> dict[str, Any]:
    """One job of ``workers`` pods on a fresh control plane; its figures."""
    rng = random.Random(args.seed)
    cluster = LocalCluster()
    cluster.start()
    tmp = Path(tempfile.mkdtemp(prefix="operator-bench-"))
    operator: OperatorProcess | None = None
    agents: AgentsPool | None = None
    watch: EpochWatch | None = None
    pod_watch: PodWatch | None = None
    result: dict[str, Any] = {"workers": workers, "spares": args.spares}
    try:
        cluster.install_crds()
        nodes = -(-(workers + args.spares + 8) // 8)
        t = time.monotonic()
        cluster.add_gpu_nodes(nodes, gpus_per_node=8, prefix="bench")
        print(f"{nodes} fake GPU nodes ready in {time.monotonic() - t:.1f} s", flush=True)
        result["nodes"] = nodes
        ns = "bench"
        cluster.request(
            "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
        )
        api = JobApi(cluster, ns)
        push_env = {}
        if args.push_processes is not None:
            push_env["MEGATRON_OPERATOR_PUSH_PROCESSES"] = str(args.push_processes)
        if args.push_process_min_members is not None:
            push_env["MEGATRON_OPERATOR_PUSH_PROCESS_MIN_MEMBERS"] = str(args.push_process_min_members)
        operator = OperatorProcess(
            cluster.kubeconfig,
            ns,
            tmp / "operator.log",
            lease_seconds=15,
            MEGATRON_OPERATOR_RESYNC_SECONDS="5",
            **push_env,
        ).start()
        assert operator.proc is not None
        pid = operator.proc.pid
        cpu: dict[str, float] = {"start": cpu_seconds(pid)}
        rss_sampler = RssSampler(pid)
        t0 = time.monotonic()
        status, body = api.create_job(
            make_job(JOB, ns, replicas=workers, spares=args.spares, min_replicas=1, global_batch=workers * 2)
        )
        assert status == 201, body
        agents = AgentsPool(
            args.agent_processes,
            wait_for(lambda: api.token(JOB), 60, "the job's Secret"),
            api.job(JOB)["metadata"]["uid"],
            operator.url,
            args.heartbeat_seconds,
        )
        watch = EpochWatch(cluster.kubeconfig, ns)  # after the forks above: the children need no threads
        pod_watch = PodWatch(cluster.kubeconfig, ns)
        result["agent_processes"] = args.agent_processes
        result["operator_log"] = str(operator.log_path)
        result["job"] = f"{ns}/{JOB}"
        result["push_processes"] = args.push_processes  # None: the operator's default
        print(f"recording agents in {args.agent_processes} process(es)", flush=True)
        total = workers + args.spares

        synced: list[dict[str, Any]] = []

        def sync_agents() -> int:
            pods = pod_watch.running()
            if pods != synced:  # the agents' processes told only of a change
                agents.sync(pods)
                synced[:] = pods
            return len(pods)

        create: dict[str, float] = {}
        wait_for(lambda: pod_watch.count() >= total, 900, "every pod created", interval=0.5)
        create["every_pod_created_s"] = time.monotonic() - t0
        peak_by_phase = {"every pod created": peak_rss_mib(pid)}  # the peak so far: where it grows
        print(f"every pod created in {create['every_pod_created_s']:.1f} s", flush=True)
        wait_for(lambda: sync_agents() >= total, 900, "all pods running", interval=0.5)
        create["every_pod_running_s"] = time.monotonic() - t0
        peak_by_phase["every pod running"] = peak_rss_mib(pid)
        print(f"every pod running in {create['every_pod_running_s']:.1f} s", flush=True)
        wait_for(lambda: watch.status.get("phase") == "Running", 300, "the first step of epoch 1", interval=0.1)
        create["first_step_s"] = time.monotonic() - t0
        peak_by_phase["first step"] = peak_rss_mib(pid)
        cpu["create"] = cpu_seconds(pid) - cpu["start"]
        result["create"] = create
        print(
            f"job of {workers} workers + {args.spares} spares running at epoch 1 in "
            f"{create['first_step_s']:.1f} s (create to every member reporting a training step)",
            flush=True,
        )

        # Training without failures: what the job object costs the API server.
        cpu_before, t_steady = cpu_seconds(pid), time.monotonic()
        time.sleep(args.steady_seconds)
        writes = [size for at, size in watch.writes if at >= t_steady]
        span = time.monotonic() - t_steady
        cpu["steady"] = cpu_seconds(pid) - cpu_before
        peak_by_phase["training"] = peak_rss_mib(pid)
        result["steady"] = {
            "seconds": span,
            "job_writes": len(writes),
            "writes_per_s": len(writes) / span,
            "object_bytes_max": max(writes, default=0),
            "bytes_per_s": sum(writes) / span,
            "operator_cpu_fraction": cpu["steady"] / span,
        }
        print(
            f"training, no failure, {span:.0f} s: {len(writes)} writes of the job "
            f"({len(writes) / span:.2f}/s, object up to {max(writes, default=0) / 1024:.0f} KiB, "
            f"{sum(writes) / span / 1024:.1f} KiB/s stored); operator CPU {cpu['steady'] / span * 100:.1f} %",
            flush=True,
        )

        stored_s: list[float] = []
        excluded: list[str] = []
        pushed_s: list[float] = []
        # Each failure by wall-clock time, to read beside the operator log's lines for its plan.
        timeline: list[dict[str, Any]] = []
        cpu_before = cpu_seconds(pid)
        for i in range(args.failures):
            st = watch.status
            epoch = st["epoch"]
            members = [m["pod"] for m in st["plan"]["members"]]
            victim = rng.choice(members)
            agents.new_receipts()  # what arrived before this failure
            t_fail, wall_fail = time.monotonic(), time.time()
            api.delete_pod(victim, grace=0)
            deleted = time.monotonic() - t_fail  # the API server's answer
            t_stored = wait_for(
                lambda epoch=epoch: watch.first_seen.get(epoch + 1), 60, f"epoch {epoch + 1} stored", interval=0.01
            )
            # The plan from the watch's event: a GET of the job here (0.5 MB at 4096 pods) loaded
            # the API server and this process while the push it measures was under way.
            plan = watch.plans[epoch + 1]
            new_members = {m["pod"] for m in plan["members"]}

            # Asked for what arrived since the last look only: fetching every answer since the failure at
            # each look (50 a second, thousands of records once the operator retries) took the agents'
            # process enough CPU to slow its answers, and so the pushes it measures.
            got: dict[str, float] = {}  # member -> when it first accepted the plan

            def all_pushed(
                new_members: set[str] = new_members,
                got: dict[str, float] = got,
                epoch: int = epoch,
            ) -> list[float]:
                for pod, ep, at, code in agents.new_receipts():
                    if pod is not None and ep == epoch + 1 and code == 200:
                        got.setdefault(pod, at)
                return list(got.values()) if new_members <= set(got) else []

            times = wait_for(all_pushed, 60, f"epoch {epoch + 1} at every member", interval=0.02)
            stored, pushed = t_stored - t_fail, max(times) - t_fail
            # Only a plan made for this failure counts: on an overloaded machine kwok may let a node go
            # NotReady, and a plan made for that (or one the victim's failure was folded into) says
            # nothing about this failure.
            clean = (
                plan["epoch"] == epoch + 1
                and plan["reason"] == "replace"
                and victim not in new_members
                and len(new_members) == workers
            )
            if clean:
                stored_s.append(stored)
                pushed_s.append(pushed)
            else:
                excluded.append(f"failure {i + 1}: plan {plan['epoch']} ({plan['reason']}, {len(new_members)} members)")
            print(
                f"failure {i + 1:3d}: {victim} -> epoch {epoch + 1} stored {stored * 1000:7.1f} ms, "
                f"pushed to all {len(new_members)} members {pushed * 1000:7.1f} ms"
                + ("" if clean else "  (excluded: not a plan for this failure alone)"),
                flush=True,
            )
            timeline.append(
                {
                    "victim": victim,
                    "deleted_at": time.strftime("%H:%M:%S", time.localtime(wall_fail))
                    + f".{int(wall_fail % 1 * 1000):03d}",
                    "deleted_at_unix": round(wall_fail, 3),
                    "epoch": plan["epoch"],
                    "delete_answered_ms": round(deleted * 1000, 1),
                    "stored_ms": round(stored * 1000, 1),
                    "pushed_ms": round(pushed * 1000, 1),
                    "measured": clean,
                }
            )
            if i == 0:
                peak_by_phase["first failure"] = peak_rss_mib(pid)
            # A spare counts as ready once its agent reports: serve the new pod's address meanwhile.
            wait_for(
                lambda: (
                    sync_agents() >= total
                    and (s := watch.status).get("sparesReady") == args.spares
                    and s.get("phase") == "Running"
                ),
                300,
                "spare pool refilled",
                interval=0.2,
            )
        cpu["failures"] = cpu_seconds(pid) - cpu_before
        cpu["total"] = cpu_seconds(pid) - cpu.pop("start")
        rss = peak_by_phase["failures"] = peak_rss_mib(pid)
        series = rss_sampler.stop()
        memory = memory_now(pid)
        push_rss = [peak_rss_mib(child) for child in children(pid)]
        result.update(
            failures=args.failures,
            measured=len(stored_s),
            excluded=excluded,
            timeline=timeline,
            stored_s=summary(stored_s),
            pushed_s=summary(pushed_s),
            operator_cpu_s=cpu,
            operator_peak_rss_mib=rss,
            operator_peak_rss_mib_by_phase=peak_by_phase,
            operator_rss_mib_series=[(round(t, 2), round(m, 1)) for t, m in series],
            operator_memory_at_end=memory,
            push_processes_peak_rss_mib=push_rss,
        )
        print()
        print(
            f"job: {workers} worker pods + {args.spares} spares on {nodes} kwok nodes; "
            f"{args.failures} failures (pod deleted, grace 0), {len(stored_s)} measured, "
            f"{len(excluded)} excluded"
        )
        for line in excluded:
            print(f"  excluded {line}")
        for name, values in (("failure -> plan stored", stored_s), ("failure -> plan pushed to all", pushed_s)):
            if values:
                print(
                    f"{name:32s} p50 {percentile(values, 50) * 1000:7.1f} ms"
                    f"   p99 {percentile(values, 99) * 1000:7.1f} ms"
                    f"   min {min(values) * 1000:7.1f} ms   max {max(values) * 1000:7.1f} ms"
                    f"   mean {statistics.mean(values) * 1000:7.1f} ms"
                )
        print(
            "operator CPU seconds (its push processes' included): "
            + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())
            + f"; peak RSS {rss:.1f} MiB"
            + (f", push processes {' + '.join(f'{r:.1f}' for r in push_rss)} MiB" if push_rss else ""),
            flush=True,
        )
        print("operator peak RSS up to: " + ", ".join(f"{k} {v:.1f}" for k, v in peak_by_phase.items()) + " MiB")
        print("operator memory at the end: " + ", ".join(f"{k} {v}" for k, v in memory.items()))
        stamps = {time.strftime("%H:%M:%S", time.localtime(t)): m for t, m in series[::10]}  # every 5 s
        print("operator RSS (MiB) by wall-clock time: " + ", ".join(f"{k} {v:.0f}" for k, v in stamps.items()))
        return result
    finally:
        # Every step runs even if one fails: a leaked operator or cluster would push plans into
        # the next run's loopback addresses.
        steps = [
            watch.stop if watch is not None else None,
            pod_watch.stop if pod_watch is not None else None,
            agents.close if agents is not None else None,
            operator.stop if operator is not None else None,
            cluster.stop,
        ]
        for step in steps:
            if step is None:
                continue
            try:
                step()
            except Exception as exc:
                print(f"cleanup: {exc!r}", file=sys.stderr)
        if operator is not None:
            print(f"operator log: {operator.log_path}")


def table(results: list[dict[str, Any]]) -> str:
    """How each figure grows with the job's size."""
    rows = [
        "| worker pods | every pod created | first step | plan stored p50 / p99 | pushed p50 / p99 "
        "| job writes/s, object, stored | operator CPU s (create, failures) | peak RSS |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        st, pu, steady, cpu = r["stored_s"], r["pushed_s"], r["steady"], r["operator_cpu_s"]
        rows.append(
            f"| {r['workers']} | {r['create']['every_pod_created_s']:.1f} s | {r['create']['first_step_s']:.1f} s "
            f"| {st.get('p50', 0) * 1000:.0f} / {st.get('p99', 0) * 1000:.0f} ms "
            f"| {pu.get('p50', 0) * 1000:.0f} / {pu.get('p99', 0) * 1000:.0f} ms "
            f"| {steady['writes_per_s']:.2f}/s, {steady['object_bytes_max'] / 1024:.0f} KiB, "
            f"{steady['bytes_per_s'] / 1024:.1f} KiB/s "
            f"| {cpu['create']:.1f}, {cpu['failures']:.1f} | {r['operator_peak_rss_mib']:.0f} MiB |"
        )
    return "\n".join(rows)


def main() -> int:
    # The operator's collector thresholds (megatron_operator.settings) here too, and so in the
    # agents' process forked from this one: every process of the run collects alike.
    gc.set_threshold(*GC_THRESHOLDS)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[256], help="worker pods (1 GPU each); several sizes")
    parser.add_argument("--spares", type=int, default=4, help="hot-spare pods")
    parser.add_argument("--failures", type=int, default=30, help="failures to measure per size")
    parser.add_argument("--steady-seconds", type=float, default=30.0, help="training without failures, measured")
    parser.add_argument(
        "--heartbeat-seconds", type=float, default=2.0, help="agents' heartbeat period (the job spec's default: 2 s)"
    )
    parser.add_argument(
        "--agent-processes",
        type=int,
        default=max(1, min(8, (os.cpu_count() or 1) // 4)),
        help="processes the recording agents are split over (default: a quarter of the cores, 1 to 8)",
    )
    parser.add_argument(
        "--push-processes", type=int, help="the operator's MEGATRON_OPERATOR_PUSH_PROCESSES (its default when unset)"
    )
    parser.add_argument(
        "--push-process-min-members",
        type=int,
        help="the operator's MEGATRON_OPERATOR_PUSH_PROCESS_MIN_MEMBERS (its default when unset)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write the figures of every size here (JSON)")
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    for workers in args.workers:
        print(f"=== {workers} worker pods", flush=True)
        result = run_size(args, workers)
        # Once the operator has stopped: its log then holds every plan's and push's line.
        log = Path(result["operator_log"]).read_text(errors="replace")
        result["failure_split"] = split_failures(result["timeline"], log, result["job"])
        result["long_collections"] = long_collections(log, result["timeline"])
        print("\neach failure, split (ms; from the operator log, joined by wall-clock time):")
        print(format_split(result["failure_split"], result["long_collections"]), flush=True)
        results.append(result)
        if args.out:  # after each size: a later size that fails keeps the earlier figures
            args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "sizes": results}, indent=1))
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
