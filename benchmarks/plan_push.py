"""Benchmark: one plan pushed to every member's agent, the operator's push alone.

Serves recording agents (the test harness's, aiohttp servers as in the trainer's agent) at
``--members`` loopback addresses in a process of their own, then pushes a plan of that many
members with the operator's PlanPusher ``--pushes`` times, ``--interval`` seconds apart, each a
newer epoch: the first over new connections, the rest over the connections kept from the one
before. Per push: the wall time until every agent answered and the pushing process's CPU time
(serializing and gzipping the plan included). No control plane: ``operator_recovery.py`` measures
failure → pushed with one. Prints figures; asserts nothing about speed.

    PYTHONPATH=contract:operator:trainer:localcluster:tests/operator \\
        python benchmarks/plan_push.py --members 1024 4096 --pushes 30 --out benchmarks/results/plan_push.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "operator")]

from operator_factories import JOB_UID, make_pod_refs, make_spec  # noqa: E402
from operator_harness import RecordingAgents  # noqa: E402
from operator_recovery import percentile, process_cpu_seconds  # noqa: E402

from megatron_operator.agent_connections import raise_open_file_limit  # noqa: E402
from megatron_operator.planner import plan_mesh  # noqa: E402
from megatron_operator.push import PlanPusher, plan_body  # noqa: E402
from megatron_operator.push_processes import PushProcesses  # noqa: E402

TOKEN = "bench-token"


def _agents_main(conn: Connection, addresses: list[tuple[str, str]]) -> None:
    raise_open_file_limit()
    agents = RecordingAgents(lambda: TOKEN)
    try:
        agents.sync([{"metadata": {"name": name}, "status": {"podIP": ip}} for name, ip in addresses])
        conn.send(len(agents._sites))
        conn.recv()  # until told to stop
    finally:
        agents.close()


def pushing_cpu(pool: PushProcesses | None) -> float:
    """CPU seconds of this process and of the push processes."""
    return time.process_time() + sum(process_cpu_seconds(pid) for pid in (pool.pids() if pool is not None else []))


def run_size(members: int, pushes: int, interval: float, processes: int) -> dict[str, Any]:
    refs = make_pod_refs(members)
    plan = plan_mesh(make_spec(replicas=members, spares=0), JOB_UID, refs, [], [], None).plan
    assert plan is not None
    conn, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=_agents_main, args=(child, [(r.name, r.address) for r in refs]))
    proc.start()
    try:
        served = conn.recv()
        if served != members:
            raise RuntimeError(f"only {served} of {members} agents could be served")
        walls: list[float] = []
        cpus: list[float] = []

        async def pushes_loop() -> None:
            pusher = PlanPusher(processes=processes)
            pool = pusher.processes
            try:
                if pool is not None:  # started now, ready before the first push
                    while not pool.ready():
                        await asyncio.sleep(0.05)
                for i in range(pushes):
                    if i:
                        await asyncio.sleep(interval)
                    p = plan.model_copy(update={"epoch": plan.epoch + i})
                    cpu, t = pushing_cpu(pool), time.monotonic()
                    outcomes = await pusher.push(p, TOKEN)
                    walls.append(time.monotonic() - t)
                    cpus.append(pushing_cpu(pool) - cpu)
                    delivered = sum(o.result.delivered for o in outcomes)
                    if delivered != members:
                        failed = [o.detail for o in outcomes if not o.result.delivered][:3]
                        raise RuntimeError(f"push {i}: {delivered} of {members} delivered: {failed}")
                    print(
                        f"  push {i + 1:3d}: {walls[-1] * 1000:7.1f} ms, CPU {cpus[-1] * 1000:6.1f} ms"
                        + (" (new connections)" if i == 0 else ""),
                        flush=True,
                    )
            finally:
                await pusher.close()

        asyncio.run(pushes_loop())
    finally:
        if proc.is_alive():
            conn.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    warm_wall, warm_cpu = walls[1:], cpus[1:]
    result: dict[str, Any] = {
        "members": members,
        "push_processes": processes,
        "plan_gzip_bytes": len(plan_body(plan)),
        "first_push_ms": {"wall": walls[0] * 1000, "cpu": cpus[0] * 1000},
        "kept_connections_ms": {
            "wall_p50": percentile(warm_wall, 50) * 1000,
            "wall_p99": percentile(warm_wall, 99) * 1000,
            "cpu_p50": percentile(warm_cpu, 50) * 1000,
            "cpu_p99": percentile(warm_cpu, 99) * 1000,
            "n": len(warm_wall),
        }
        if warm_wall
        else {},
    }
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--pushes", type=int, default=30, help="pushes per size (the first over new connections)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between pushes")
    parser.add_argument(
        "--push-processes", type=int, default=0, help="push from this many processes (the operator's push_processes)"
    )
    parser.add_argument("--out", type=Path, help="write the figures here (JSON)")
    args = parser.parse_args()
    limit = raise_open_file_limit()
    if limit < 2 * max(args.members) + 256:
        print(f"the open-file limit ({limit}) is too low for {max(args.members)} agents", file=sys.stderr)
        return 2
    results = []
    for members in args.members:
        print(f"=== {members} members", flush=True)
        r = run_size(members, args.pushes, args.interval, args.push_processes)
        results.append(r)
        warm = r["kept_connections_ms"]
        print(
            f"{members} members, plan {r['plan_gzip_bytes'] / 1024:.0f} KiB gzipped: first push (new connections) "
            f"{r['first_push_ms']['wall']:.0f} ms, CPU {r['first_push_ms']['cpu']:.0f} ms; over kept connections "
            f"p50 {warm.get('wall_p50', 0):.0f} / p99 {warm.get('wall_p99', 0):.0f} ms, "
            f"CPU p50 {warm.get('cpu_p50', 0):.0f} / p99 {warm.get('cpu_p99', 0):.0f} ms (n={warm.get('n', 0)})",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "sizes": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
