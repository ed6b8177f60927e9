"""Benchmark: time from a pod's failure to the new plan stored and pushed, for a large job.

Starts the local control plane with kwok fake GPU nodes, runs the operator as a real process,
serves recording agents at every pod's loopback address, submits a job of ``--workers`` worker
pods (1 GPU each) with hot spares, then repeatedly deletes a random member pod and measures:

- stored: deletion → a watch on the job sees the next epoch in its status;
- pushed: deletion → the last member's agent received the plan (timestamps taken by the agents,
  which run in a process of their own);
- the operator's peak resident memory (VmHWM) at the end.

Between failures it waits for the spare pool to be full again, so every failure is a replacement.
Prints figures; asserts nothing about speed.

    PYTHONPATH=contract:operator:trainer:localcluster:tests/operator \\
        python benchmarks/operator_recovery.py --workers 256 --failures 30
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "operator")]

from operator_factories import make_job  # noqa: E402
from operator_harness import JobApi, OperatorProcess, RecordingAgents  # noqa: E402

from localcluster.cluster import LocalCluster  # noqa: E402
from localcluster.waiting import wait_for  # noqa: E402

JOB = "bench"


def _agents_main(conn: Connection, token: str, job_uid: str, operator_url: str) -> None:
    """The recording agents, in a process of their own (so the benchmark's polling cannot slow them).
    They heartbeat like agents (warm spares, then training steps): the operator promotes only warm
    spares and counts a job as training only on committed steps."""
    agents = RecordingAgents(lambda: token)
    agents.job_uid, agents.operator_urls = job_uid, [operator_url]
    agents.start_heartbeats(period=0.5)
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

    def __init__(self, token: str, job_uid: str, operator_url: str) -> None:
        self._conn, child = mp.Pipe()
        self._proc = mp.get_context("fork").Process(
            target=_agents_main, args=(child, token, job_uid, operator_url), daemon=True
        )
        self._proc.start()
        self._lock = threading.Lock()

    def _ask(self, cmd: str, arg: Any) -> Any:
        with self._lock:
            self._conn.send((cmd, arg))
            return self._conn.recv()

    def sync(self, pods: list[dict[str, Any]]) -> None:
        self._ask("sync", [(p["metadata"]["name"], p["status"]["podIP"]) for p in pods])

    def received(self, since: int = 0) -> list[tuple[str | None, int, float, int]]:
        result: list[tuple[str | None, int, float, int]] = self._ask("received", since)
        return result

    def close(self) -> None:
        if self._proc.is_alive():
            with self._lock:
                self._conn.send(("quit", None))
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


class EpochWatch:
    """Watches the job and stamps the moment each epoch first appears in its status."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        from kubernetes import client, config, watch

        self._api = client.CustomObjectsApi(config.new_client_from_config(str(kubeconfig)))
        self._watch = watch.Watch()
        self.first_seen: dict[int, float] = {}
        self._ns = namespace
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                for event in self._watch.stream(
                    self._api.list_namespaced_custom_object,
                    "megatron.dev",
                    "v1alpha1",
                    self._ns,
                    "megatronjobs",
                    field_selector=f"metadata.name={JOB}",
                    timeout_seconds=300,
                ):
                    epoch = ((event["object"].get("status") or {}).get("epoch")) or 0
                    self.first_seen.setdefault(epoch, time.monotonic())
            except Exception as exc:  # the watch restarts; a lost event only delays a stamp
                if not self._stopped.is_set():
                    print(f"watch: {exc}", file=sys.stderr)
                self._stopped.wait(0.5)

    def stop(self) -> None:
        self._stopped.set()
        self._watch.stop()


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank)."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=256, help="worker pods (1 GPU each)")
    parser.add_argument("--spares", type=int, default=4, help="hot-spare pods")
    parser.add_argument("--failures", type=int, default=30, help="failures to measure")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    cluster = LocalCluster()
    cluster.start()
    tmp = Path(tempfile.mkdtemp(prefix="operator-bench-"))
    operator: OperatorProcess | None = None
    agents: AgentsProcess | None = None
    watch: EpochWatch | None = None
    try:
        cluster.install_crds()
        nodes = -(-(args.workers + args.spares + 8) // 8)
        t = time.monotonic()
        cluster.add_gpu_nodes(nodes, gpus_per_node=8, prefix="bench")
        print(f"{nodes} fake GPU nodes ready in {time.monotonic() - t:.1f} s", flush=True)
        ns = "bench"
        cluster.request(
            "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
        )
        api = JobApi(cluster, ns)
        operator = OperatorProcess(
            cluster.kubeconfig, ns, tmp / "operator.log", lease_seconds=15, MEGATRON_OPERATOR_RESYNC_SECONDS="5"
        ).start()
        t0 = time.monotonic()
        status, body = api.create_job(
            make_job(JOB, ns, replicas=args.workers, spares=args.spares, min_replicas=1, global_batch=args.workers * 2)
        )
        assert status == 201, body
        agents = AgentsProcess(
            wait_for(lambda: api.token(JOB), 60, "the job's Secret"), api.job(JOB)["metadata"]["uid"], operator.url
        )
        watch = EpochWatch(cluster.kubeconfig, ns)  # after the fork above: the child needs no threads

        def sync_agents() -> int:
            pods = api.running_pods(JOB)
            agents.sync(pods)
            return len(pods)

        wait_for(lambda: sync_agents() >= args.workers + args.spares, 300, "all pods running", interval=0.5)
        wait_for(lambda: api.status(JOB).get("phase") == "Running", 300, "the first step of epoch 1", interval=0.1)
        print(
            f"job of {args.workers} workers + {args.spares} spares running at epoch 1 in "
            f"{time.monotonic() - t0:.1f} s (create to every member reporting a training step)",
            flush=True,
        )

        stored_s: list[float] = []
        excluded: list[str] = []
        pushed_s: list[float] = []
        for i in range(args.failures):
            st = api.status(JOB)
            epoch = st["epoch"]
            members = [m["pod"] for m in st["plan"]["members"]]
            victim = rng.choice(members)
            seen = len(agents.received())
            t_fail = time.monotonic()
            api.delete_pod(victim, grace=0)
            t_stored = wait_for(
                lambda epoch=epoch: watch.first_seen.get(epoch + 1), 60, f"epoch {epoch + 1} stored", interval=0.01
            )
            plan = api.status(JOB)["plan"]
            new_members = {m["pod"] for m in plan["members"]}

            def all_pushed(new_members: set[str] = new_members, seen: int = seen, epoch: int = epoch) -> list[float]:
                got = {pod: at for pod, ep, at, code in agents.received(seen) if ep == epoch + 1 and code == 200}
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
                and len(new_members) == args.workers
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
            wait_for(
                lambda: (s := api.status(JOB)).get("sparesReady") == args.spares and s.get("phase") == "Running",
                120,
                "spare pool refilled",
                interval=0.1,
            )
            wait_for(lambda: sync_agents() >= args.workers + args.spares, 60, "agents on every pod", interval=0.2)

        rss = peak_rss_mib(operator.proc.pid) if operator.proc else float("nan")
        print()
        print(
            f"job: {args.workers} worker pods + {args.spares} spares on {nodes} kwok nodes; "
            f"{args.failures} failures (pod deleted, grace 0), {len(stored_s)} measured, "
            f"{len(excluded)} excluded"
        )
        for line in excluded:
            print(f"  excluded {line}")
        for name, values in (("failure -> plan stored", stored_s), ("failure -> plan pushed to all", pushed_s)):
            print(
                f"{name:32s} p50 {percentile(values, 50) * 1000:7.1f} ms"
                f"   p99 {percentile(values, 99) * 1000:7.1f} ms"
                f"   min {min(values) * 1000:7.1f} ms   max {max(values) * 1000:7.1f} ms"
                f"   mean {statistics.mean(values) * 1000:7.1f} ms"
            )
        print(f"operator peak RSS (VmHWM): {rss:.1f} MiB")
        return 0
    finally:
        # Every step runs even if one fails: a leaked operator or cluster would push plans into
        # the next run's loopback addresses.
        steps = [
            watch.stop if watch is not None else None,
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


if __name__ == "__main__":
    sys.exit(main())
