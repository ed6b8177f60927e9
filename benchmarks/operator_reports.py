"""Benchmark: how many agent heartbeats the operator's report endpoint takes per second.

A 4096-pod job reporting every 2 s sends about 2,048 reports/s. This starts the operator's real
report endpoint (aiohttp, the heartbeat book, a job controller's report intake with a 4096-member
plan) in this process and drives it from ``--clients`` client processes that post reports as fast
as they can, one report per request or ``--batch`` per request. No API server is involved: reports
never touch it. Prints figures; asserts nothing.

    PYTHONPATH=contract:operator:trainer:localcluster:tests/operator \\
        python benchmarks/operator_reports.py --pods 4096 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "operator")]

from operator_factories import JOB_UID, make_job, make_pod_refs, make_spec  # noqa: E402

from megatron_contract import wire  # noqa: E402
from megatron_operator import handlers  # noqa: E402
from megatron_operator.builders import JobRef  # noqa: E402
from megatron_operator.controller import JobController  # noqa: E402
from megatron_operator.planner import plan_mesh  # noqa: E402
from megatron_operator.reports import start_server  # noqa: E402
from megatron_operator.settings import OperatorSettings  # noqa: E402

TOKEN = "bench-token"


def _client(port: int, pods: list[str], batch: int, seconds: float, out: mp.Queue) -> None:  # type: ignore[type-arg]
    import aiohttp

    async def run() -> int:
        sent = 0
        url = f"http://127.0.0.1:{port}{wire.OPERATOR_REPORT_PATH}"
        headers = {wire.AUTH_HEADER: f"{wire.AUTH_SCHEME} {TOKEN}"}
        deadline = time.monotonic() + seconds
        async with aiohttp.ClientSession() as session:

            async def worker(offset: int) -> None:
                nonlocal sent
                i = offset
                while time.monotonic() < deadline:
                    reports = [
                        {
                            "jobUid": JOB_UID,
                            "pod": pods[(i + k) % len(pods)],
                            "epoch": 1,
                            "state": "training",
                            "step": i,
                            "stepTimeSeconds": 0.7,
                        }
                        for k in range(batch)
                    ]
                    body = reports[0] if batch == 1 else {"reports": reports}
                    async with session.post(url, json=body, headers=headers) as resp:
                        if resp.status == 200:
                            sent += batch
                    i += batch

            await asyncio.gather(*(worker(j * 97) for j in range(16)))
        return sent

    out.put(asyncio.run(run()))


async def serve(pods: int) -> tuple[handlers.Registry, int, object]:
    registry = handlers.Registry(OperatorSettings(leader_election=False))
    spec = make_spec(replicas=pods, spares=0, global_batch=pods * 2)
    plan = plan_mesh(spec, JOB_UID, make_pod_refs(pods), [], [], None).plan
    assert plan is not None
    body = make_job(
        replicas=pods, spares=0, global_batch=pods * 2, status={"phase": "Running", "epoch": 1, "plan": plan.to_wire()}
    )
    job = JobRef.of(body)
    ctl = JobController(job, body, registry.settings, registry.book, registry.pusher, pods_of=list, nodes=dict)
    ctl.token = TOKEN
    ctl.delivery.acked_epoch = 1
    ctl.delivery.acked = {m.pod for m in plan.members}
    registry.by_uid[job.uid] = ctl
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runner = await start_server(registry, "127.0.0.1", port)
    return registry, port, runner


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=4096)
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    pod_names = [r.name for r in make_pod_refs(args.pods)]

    for batch in (1, 64):
        loop = asyncio.new_event_loop()
        registry, port, runner = loop.run_until_complete(serve(args.pods))
        queue: mp.Queue = mp.Queue()  # type: ignore[type-arg]
        procs = [
            mp.get_context("fork").Process(
                target=_client, args=(port, pod_names[c :: args.clients], batch, args.seconds, queue)
            )
            for c in range(args.clients)
        ]
        start = time.monotonic()
        for p in procs:
            p.start()

        async def wait_clients(procs: list[mp.process.BaseProcess] = procs) -> None:
            while any(p.is_alive() for p in procs):
                await asyncio.sleep(0.05)  # the server keeps running in this loop meanwhile

        loop.run_until_complete(wait_clients())
        elapsed = time.monotonic() - start
        sent = sum(queue.get() for _ in procs)
        loop.run_until_complete(runner.cleanup())  # type: ignore[attr-defined]
        loop.close()
        held = len(registry.book.epochs(JOB_UID))
        print(
            f"batch {batch:3d}: {sent / elapsed:9.0f} reports/s accepted ({sent} in {elapsed:.1f} s, "
            f"{args.clients} client processes), heartbeats held for {held} pods; "
            f"a {args.pods}-pod job at a 2 s interval needs {args.pods / 2:.0f}/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
