"""Large plans pushed from the push processes, to real agents' servers over loopback.

Scenarios: the first large push goes out from the operator's process while the push processes
start; once they are ready, every member gets each push exactly once, through them, over the same
kept connection from push to push (an agent's share stays in one process), and the connections
of the operator's process are closed; an agent's refusal
(409, a newer epoch) comes back through them as it would from the operator's process; a plan of
fewer members than the threshold is pushed from the operator's process; a push process killed
between pushes is started anew, that push going from the operator's process meanwhile; a push
process that hangs (SIGSTOP) is killed once its answer is overdue, its share pushed from the
operator's process, and started anew; closing the pusher ends every push process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections import Counter
from typing import Any

import pytest
from aiohttp import web
from operator_factories import JOB_UID, make_spec

from megatron_contract import wire
from megatron_contract.mesh import MeshPlan
from megatron_operator import push_processes
from megatron_operator.planner import PodRef, plan_mesh
from megatron_operator.push import PUSH_CONCURRENCY, PlanPusher, PushOutcome, PushResult
from megatron_operator.push_processes import PushProcesses

IPS = [f"127.0.0.{60 + i}" for i in range(8)]
AHEAD_EPOCH = 99


def _plan(port: int, epoch: int, count: int = len(IPS)) -> MeshPlan:
    refs = [PodRef(f"p{i}", f"u{i}", ip) for i, ip in enumerate(IPS[:count])]
    plan = plan_mesh(make_spec(replicas=len(refs), spares=0), JOB_UID, refs, [], [], None).plan
    assert plan is not None
    members = [m.model_copy(update={"agent_port": port}) for m in plan.members]
    return plan.model_copy(update={"members": members, "epoch": epoch})


def _free_port(processes: int = 1) -> int:
    """A free port at which the agents' addresses fall to every one of ``processes`` push
    processes (shares go by address and port: some ports leave a process without one)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind((IPS[0], 0))
            port: int = probe.getsockname()[1]
        if len({push_processes._share_of(("", ip, port), processes) for ip in IPS}) == processes:
            return port
    raise AssertionError(f"no port of 100 gives each of {processes} push processes a share")


async def _agents(port: int, seen: dict[str, list[tuple[int, Any]]], ahead: set[str]) -> list[web.AppRunner]:
    """One aiohttp agent per address: records (epoch, client address) of each push; an agent in
    ``ahead`` refuses, holding a newer epoch."""
    runners = []
    for ip in IPS:

        async def handle(request: web.Request, ip: str = ip) -> web.Response:
            assert request.headers[wire.AUTH_HEADER] == f"{wire.AUTH_SCHEME} tok"
            plan = MeshPlan.model_validate_json(await request.read())  # aiohttp un-gzips it
            peer = request.transport.get_extra_info("peername") if request.transport else None
            seen.setdefault(ip, []).append((plan.epoch, peer))
            if ip in ahead:
                return web.json_response({"error": "not newer", "epoch": AHEAD_EPOCH}, status=409)
            return web.json_response({"epoch": plan.epoch})

        app = web.Application()
        app.router.add_post(wire.AGENT_PLAN_PATH, handle)
        runner = web.AppRunner(app, keepalive_timeout=60)
        await runner.setup()
        await web.TCPSite(runner, ip, port).start()
        runners.append(runner)
    return runners


async def _until_ready(pool: PushProcesses) -> None:
    deadline = time.monotonic() + 30
    while not pool.ready():
        assert time.monotonic() < deadline, "the push processes did not start in 30 s"
        await asyncio.sleep(0.05)


def _by_pod(outcomes: list[PushOutcome]) -> dict[str, PushResult]:
    pods = [o.pod for o in outcomes]
    assert len(pods) == len(set(pods)), f"a member pushed twice: {sorted(pods)}"
    return {o.pod: o.result for o in outcomes}


def test_a_large_plan_goes_out_from_the_push_processes_each_member_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(push_processes, "ANSWER_SLACK_SECONDS", 0.5)

    async def run() -> None:
        port = _free_port(processes=3)
        seen: dict[str, list[tuple[int, Any]]] = {}
        ahead = {IPS[3]}
        runners = await _agents(port, seen, ahead)
        pusher = PlanPusher(timeout=2.0, concurrency=4, processes=3, process_min_members=4)
        pool = pusher.processes
        assert pool is not None and (pool.timeout, pool.concurrency) == (2.0, 4)
        everyone = {f"p{i}" for i in range(len(IPS))}
        try:
            # Not ready yet: this push goes from this process, and starts them.
            from_here = await pusher.push(_plan(port, 1), "tok")
            first = _by_pod(from_here)
            assert pool.pushes == 0 and set(first) == everyone
            assert {o.origin for o in from_here} == {None}
            await _until_ready(pool)
            pids = pool.pids()
            assert len(pids) == 3
            second = await pusher.push(_plan(port, 2), "tok")
            third = await pusher.push(_plan(port, 3), "tok")
            # Each outcome names the push process that made it (what the delivery log counts).
            assert {o.origin for o in (*second, *third)} == set(pids)
            assert pool.pushes == 2
            assert pusher._connections.open_count() == 0  # the first push's, closed: the processes push now
            for outcomes in (second, third):
                results = _by_pod(outcomes)
                assert set(results) == everyone
                assert results.pop("p3") is PushResult.AHEAD
                assert set(results.values()) == {PushResult.ACCEPTED}, [o.detail for o in outcomes]
            assert {o.held_epoch for o in second if o.pod == "p3"} == {AHEAD_EPOCH}
            # Each agent got epochs 2 and 3 over one connection: its share stayed in one process.
            for ip in IPS:
                (e2, peer2), (e3, peer3) = seen[ip][1:3]
                assert (e2, e3) == (2, 3) and peer2 == peer3, seen[ip]
            # Below the threshold: from this process.
            below = await pusher.push(_plan(port, 4, count=3), "tok")
            small = _by_pod(below)
            assert pool.pushes == 2 and set(small) == {"p0", "p1", "p2"} and {o.origin for o in below} == {None}

            # A push process killed between pushes: started anew; meanwhile this process pushes.
            os.kill(pids[0], signal.SIGKILL)
            await asyncio.sleep(0.2)
            after_kill = await pusher.push(_plan(port, 5), "tok")
            assert set(_by_pod(after_kill)) == everyone and pool.pushes == 2
            assert sum(o.result.delivered for o in after_kill) == len(IPS) - 1
            await _until_ready(pool)
            assert pids[0] not in pool.pids() and len(pool.pids()) == 3

            # A push process that hangs: killed when its answer is overdue (2 s timeout x 2 + the
            # slack), its share pushed from this process; started anew for the next push.
            shares = Counter(push_processes._share_of((f"p{i}", ip, port), 3) for i, ip in enumerate(IPS))
            stopped = pool.pids()[shares.most_common(1)[0][0]]
            os.kill(stopped, signal.SIGSTOP)
            start = time.monotonic()
            hung = await pusher.push(_plan(port, 6), "tok")
            assert 4.0 < time.monotonic() - start < 15.0
            assert set(_by_pod(hung)) == everyone and pool.pushes == 3
            assert sum(o.result.delivered for o in hung) == len(IPS) - 1, [o.detail for o in hung]
            # The hung process's share came from this process, the rest from the other two.
            by_origin = Counter(o.origin for o in hung)
            assert by_origin[None] == shares.most_common(1)[0][1] and len(by_origin) == 3
            assert all(seen[ip][-1][0] == 6 for ip in IPS)
            await _until_ready(pool)
            assert stopped not in pool.pids() and len(pool.pids()) == 3
            again = await pusher.push(_plan(port, 7), "tok")
            assert pool.pushes == 4 and sum(o.result.delivered for o in again) == len(IPS) - 1
            live = pool.pids()
        finally:
            await pusher.close()
            for runner in runners:
                await runner.cleanup()
        assert pool.pids() == []
        for pid in live:  # reaped by close(): no such process any more
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            raise AssertionError(f"push process {pid} still runs after close")

    asyncio.run(run())


def test_a_large_job_has_its_push_processes_ready_by_its_first_plan() -> None:
    """Prepared for a job of at least the threshold's members, the push processes start at once,
    and its first plan goes out from them (their connections kept for the next); for a smaller job
    none starts."""

    async def run() -> None:
        port = _free_port(processes=2)
        seen: dict[str, list[tuple[int, Any]]] = {}
        runners = await _agents(port, seen, set())
        pusher = PlanPusher(timeout=2.0, concurrency=4, processes=2, process_min_members=len(IPS))
        pool = pusher.processes
        assert pool is not None
        try:
            pusher.prepare(len(IPS) - 1)
            assert pool.pids() == []
            pusher.prepare(len(IPS))
            assert len(pool.pids()) == 2
            await _until_ready(pool)
            first = await pusher.push(_plan(port, 1), "tok")
            assert pool.pushes == 1 and {o.origin for o in first} == set(pool.pids())
            assert set(_by_pod(first).values()) == {PushResult.ACCEPTED}
        finally:
            await pusher.close()
            for runner in runners:
                await runner.cleanup()

    asyncio.run(run())


def test_the_operator_pushes_from_a_quarter_of_its_cpus_up_to_four_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_operator.handlers import Registry
    from megatron_operator.settings import OperatorSettings

    def count(cpus: int, setting: int | None = None) -> int:
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cpus)))
        settings = OperatorSettings(push_processes=setting, push_process_min_members=512, push_timeout_seconds=3)
        pool = Registry(settings).pusher.processes
        if pool is None:
            return 0
        assert pool.min_members == 512 and pool.pids() == []  # nothing started before a push
        assert (pool.timeout, pool.concurrency) == (3, PUSH_CONCURRENCY)  # the pusher's own
        pool.close()
        return pool.count

    assert [count(n) for n in (1, 2, 3, 4, 8, 16, 64)] == [0, 0, 0, 1, 2, 4, 4]
    assert count(2, setting=3) == 3 and count(64, setting=0) == 0
