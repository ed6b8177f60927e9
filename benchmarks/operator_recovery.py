"""Benchmark: time from a pod's failure to the new plan stored and pushed, for a large job.

Starts the local control plane with kwok fake GPU nodes, runs the operator as a real process,
serves recording agents at every pod's loopback address, submits a job of ``--workers`` worker
pods (1 GPU each) with hot spares, then repeatedly deletes a random member pod and measures:

- stored: deletion → the status holds the next epoch (polled every few ms, so a little late);
- pushed: deletion → the last member's agent received the plan (timestamps taken by the agents);
- the operator's peak resident memory (VmHWM) at the end.

Between failures it waits for the spare pool to be full again, so every failure is a replacement.
Prints figures; asserts nothing about speed.

    PYTHONPATH=contract:operator:trainer:localcluster:tests/operator \\
        python benchmarks/operator_recovery.py --workers 256 --failures 30
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "operator"))

from operator_factories import make_job  # noqa: E402
from operator_harness import JobApi, OperatorProcess, RecordingAgents, wait_for  # noqa: E402

from localcluster.cluster import LocalCluster  # noqa: E402

JOB = "bench"


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
    agents: RecordingAgents | None = None
    try:
        cluster.install_crds()
        nodes = -(-(args.workers + args.spares + 8) // 8)
        t = time.monotonic()
        cluster.add_gpu_nodes(nodes, gpus_per_node=8, prefix="bench")
        print(f"{nodes} fake GPU nodes ready in {time.monotonic() - t:.1f} s", flush=True)
        ns = "bench"
        cluster.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                       "metadata": {"name": ns}})
        api = JobApi(cluster, ns)
        operator = OperatorProcess(cluster.kubeconfig, ns, tmp / "operator.log", lease_seconds=15,
                                   MEGATRON_OPERATOR_RESYNC_SECONDS="5").start()
        token: dict[str, str | None] = {"value": None}
        agents = RecordingAgents(lambda: token["value"])

        t0 = time.monotonic()
        status, body = api.create_job(make_job(JOB, ns, replicas=args.workers, spares=args.spares,
                                               min_replicas=1, global_batch=args.workers * 2))
        assert status == 201, body
        token["value"] = wait_for(lambda: api.token(JOB), 60, "the job's Secret")

        def sync_agents() -> int:
            pods = api.running_pods(JOB)
            agents.sync(pods)
            return len(pods)

        wait_for(lambda: sync_agents() >= args.workers + args.spares, 300, "all pods running", interval=0.5)
        wait_for(lambda: api.status(JOB).get("phase") == "Running", 300, "initial plan acknowledged",
                 interval=0.1)
        print(f"job of {args.workers} workers + {args.spares} spares running at epoch 1 in "
              f"{time.monotonic() - t0:.1f} s (create to every member holding the plan)", flush=True)

        stored_s: list[float] = []
        pushed_s: list[float] = []
        for i in range(args.failures):
            st = api.status(JOB)
            epoch = st["epoch"]
            members = [m["pod"] for m in st["plan"]["members"]]
            victim = rng.choice(members)
            seen = len(agents.received)
            t_fail = time.monotonic()
            api.delete_pod(victim, grace=0)
            def stored(epoch: int = epoch) -> dict[str, Any] | None:
                status = api.status(JOB)
                return status if status.get("epoch") == epoch + 1 else None

            st = wait_for(stored, 60, f"epoch {epoch + 1} stored", interval=0.005)
            t_stored = time.monotonic()
            new_members = {m["pod"] for m in st["plan"]["members"]}

            def all_pushed(new_members: set[str] = new_members, seen: int = seen, epoch: int = epoch) -> list[float]:
                got = {r.pod: r.at for r in agents.received[seen:] if r.epoch == epoch + 1 and r.status == 200}
                return list(got.values()) if new_members <= set(got) else []

            times = wait_for(all_pushed, 60, f"epoch {epoch + 1} at every member", interval=0.01)
            stored_s.append(t_stored - t_fail)
            pushed_s.append(max(times) - t_fail)
            print(f"failure {i + 1:3d}: {victim} -> epoch {epoch + 1} stored {stored_s[-1] * 1000:7.1f} ms, "
                  f"pushed to all {len(new_members)} members {pushed_s[-1] * 1000:7.1f} ms", flush=True)
            wait_for(lambda: (s := api.status(JOB)).get("sparesReady") == args.spares
                     and s.get("phase") == "Running", 120, "spare pool refilled", interval=0.05)
            wait_for(lambda: sync_agents() >= args.workers + args.spares, 60, "agents on every pod", interval=0.2)

        rss = peak_rss_mib(operator.proc.pid) if operator.proc else float("nan")
        print()
        print(f"job: {args.workers} worker pods + {args.spares} spares on {nodes} kwok nodes; "
              f"{args.failures} failures (pod deleted, grace 0)")
        for name, values in (("failure -> plan stored", stored_s), ("failure -> plan pushed to all", pushed_s)):
            print(f"{name:32s} p50 {percentile(values, 50) * 1000:7.1f} ms"
                  f"   p99 {percentile(values, 99) * 1000:7.1f} ms"
                  f"   min {min(values) * 1000:7.1f} ms   max {max(values) * 1000:7.1f} ms"
                  f"   mean {statistics.mean(values) * 1000:7.1f} ms")
        print(f"operator peak RSS (VmHWM): {rss:.1f} MiB")
        return 0
    finally:
        if agents is not None:
            agents.close()
        if operator is not None:
            operator.stop()
            print(f"operator log: {operator.log_path}")
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
