"""The operator's HTTP sides, over real loopback sockets: plan pushes and the report endpoint;
and the conflict retry of the pod-serial reservation (API call faked: a fast unit test of one function).

Scenarios: a plan goes to every member at once with the bearer token, serialized as the contract's
wire form and gzipped; 2xx and a 409 from an agent holding this epoch count as delivered; a 409 from an agent
holding a newer epoch (the operator's status is behind it), or one for another reason (a finished
pod, no epoch in the answer), 401/403, 5xx and a closed port do not; with more members than
concurrent pushes, each push's timeout starts when it gets its turn; the report
endpoint refuses a missing token (401), a wrong one (403), an unknown job (404) and a bad body
(400), accepts one report or a batch and answers with the epoch in force; a serial reservation
that conflicts is retried with a fresh read, never goes below the floor, and gives up with a
clear error after repeated conflicts.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from aiohttp import ClientSession, web
from kubernetes.client.exceptions import ApiException
from operator_factories import JOB_UID, make_spec

from megatron_contract import wire
from megatron_contract.agent import AgentReport
from megatron_contract.mesh import MeshPlan
from megatron_operator import kube
from megatron_operator.builders import ANNOTATION_NEXT_SERIAL
from megatron_operator.planner import PodRef, plan_mesh
from megatron_operator.push import PlanPusher, PushResult
from megatron_operator.reports import build_app


def _plan(refs: list[PodRef]) -> MeshPlan:
    plan = plan_mesh(make_spec(replicas=len(refs), spares=0), JOB_UID, refs, [], [], None).plan
    assert plan is not None
    return plan


async def _agent(
    ip: str, port: int, status: int, seen: list[tuple[str, dict[str, Any]]], answer: dict[str, Any] | None = None
) -> web.AppRunner:
    async def handle(request: web.Request) -> web.Response:
        assert request.headers.get("Content-Encoding") == "gzip"  # aiohttp decompresses it, as in the agents
        seen.append((request.headers.get(wire.AUTH_HEADER, ""), await request.json()))
        return web.json_response(answer or {}, status=status)

    app = web.Application()
    app.router.add_post(wire.AGENT_PLAN_PATH, handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, ip, port).start()
    return runner


def test_push_reaches_every_member_and_classifies_answers() -> None:
    async def run() -> None:
        answers: dict[str, tuple[int, dict[str, Any]]] = {
            "127.0.0.11": (200, {}),
            "127.0.0.12": (409, {"error": "not newer", "epoch": 1}),  # holds this epoch
            "127.0.0.13": (403, {}),
            "127.0.0.14": (500, {}),
            "127.0.0.16": (409, {"error": "not newer", "epoch": 4}),  # holds a newer epoch
            "127.0.0.17": (409, {"error": "this pod has finished training", "epoch": 0}),
            "127.0.0.18": (409, {}),
        }
        refs = [PodRef(f"p{i}", f"u{i}", ip) for i, ip in enumerate([*answers, "127.0.0.15"])]
        plan = _plan(refs)
        assert plan.epoch == 1
        with socket.socket() as probe:  # a port free on these loopback addresses
            probe.bind(("127.0.0.11", 0))
            port = probe.getsockname()[1]
        plan = plan.model_copy(update={"members": [m.model_copy(update={"agent_port": port}) for m in plan.members]})
        seen: list[tuple[str, dict[str, Any]]] = []
        runners = [await _agent(ip, port, code, seen, answer) for ip, (code, answer) in answers.items()]
        pusher = PlanPusher(timeout=2)
        try:
            pushed = await pusher.push(plan, "tok")
            outcomes = {o.pod: o.result for o in pushed}
        finally:
            await pusher.close()
            for r in runners:
                await r.cleanup()
        assert outcomes == {
            "p0": PushResult.ACCEPTED,
            "p1": PushResult.ALREADY_HELD,
            "p2": PushResult.UNAUTHORIZED,
            "p3": PushResult.ERROR,
            "p4": PushResult.AHEAD,
            "p5": PushResult.REFUSED,
            "p6": PushResult.REFUSED,
            "p7": PushResult.ERROR,
        }
        assert {o.pod: o.held_epoch for o in pushed if o.held_epoch is not None} == {"p1": 1, "p4": 4, "p5": 0}
        assert {r for r in PushResult if r.delivered} == {PushResult.ACCEPTED, PushResult.ALREADY_HELD}
        assert len(seen) == 7 and all(auth == "Bearer tok" for auth, _ in seen)
        assert MeshPlan.model_validate(seen[0][1]) == plan

    asyncio.run(run())


def test_a_push_to_more_members_than_slots_times_each_request_not_its_wait_for_a_slot() -> None:
    async def run() -> None:
        ips = [f"127.0.0.{i}" for i in range(21, 29)]
        plan = _plan([PodRef(f"p{i}", f"u{i}", ip) for i, ip in enumerate(ips)])
        with socket.socket() as probe:
            probe.bind((ips[0], 0))
            port = probe.getsockname()[1]
        plan = plan.model_copy(update={"members": [m.model_copy(update={"agent_port": port}) for m in plan.members]})
        in_flight, most = 0, 0

        async def slow(request: web.Request) -> web.Response:  # an agent answering after 0.4 s
            nonlocal in_flight, most
            in_flight += 1
            most = max(most, in_flight)
            await request.read()
            await asyncio.sleep(0.4)
            in_flight -= 1
            return web.json_response({})

        runners = []
        for ip in ips:
            app = web.Application()
            app.router.add_post(wire.AGENT_PLAN_PATH, slow)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, ip, port).start()
            runners.append(runner)
        # Two slots for eight members: the last two wait 1.2 s for theirs, longer than the timeout.
        pusher = PlanPusher(timeout=1.0, concurrency=2)
        try:
            pushed = await pusher.push(plan, "tok")
        finally:
            await pusher.close()
            for r in runners:
                await r.cleanup()
        assert [o.result for o in pushed] == [PushResult.ACCEPTED] * 8, [o.detail for o in pushed]
        assert most == 2
        assert max(o.seconds for o in pushed) < 1.0  # each push is timed from its slot

    asyncio.run(run())


class _Sink:
    def __init__(self) -> None:
        self.got: list[AgentReport] = []

    def token_for(self, job_uid: str) -> str | None:
        return "secret" if job_uid == JOB_UID else None

    def accept_reports(self, job_uid: str, reports: list[AgentReport]) -> int:
        self.got.extend(reports)
        return 7


def test_report_endpoint_authenticates_and_answers_the_epoch() -> None:
    async def run() -> None:
        sink = _Sink()
        runner = web.AppRunner(build_app(sink))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}{wire.OPERATOR_REPORT_PATH}"
        report = {"jobUid": JOB_UID, "pod": "p0", "epoch": 3, "state": "training", "step": 5}
        try:
            async with ClientSession() as s:

                async def post(body: Any, token: str | None) -> tuple[int, Any]:
                    headers = {wire.AUTH_HEADER: f"Bearer {token}"} if token else {}
                    async with s.post(url, json=body, headers=headers) as resp:
                        return resp.status, await resp.json()

                assert (await post(report, None))[0] == 401
                assert (await post(report, "wrong"))[0] == 403
                assert (await post({**report, "jobUid": "other"}, "secret"))[0] == 404
                assert (await post({**report, "epoch": -1}, "secret"))[0] == 400
                assert (await post({"reports": []}, "secret"))[0] == 400
                assert await post(report, "secret") == (200, {"epoch": 7, "accepted": 1})
                batch = {"reports": [report, {**report, "pod": "p1"}]}
                assert await post(batch, "secret") == (200, {"epoch": 7, "accepted": 2})
        finally:
            await runner.cleanup()
        assert [r.pod for r in sink.got] == ["p0", "p0", "p1"]

    asyncio.run(run())


def test_serial_reservation_retries_conflicts(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    written: list[dict[str, Any]] = []

    async def fake_get(namespace: str, name: str) -> dict[str, Any]:
        reads.append(name)
        return {
            "metadata": {
                "name": name,
                "resourceVersion": str(len(reads)),
                "annotations": {ANNOTATION_NEXT_SERIAL: "10"},
            }
        }

    conflicts = iter([True, True, False])

    async def fake_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        written.append(args[-1])
        if next(conflicts):
            raise ApiException(status=409, reason="Conflict")
        return args[-1]

    monkeypatch.setattr(kube, "get_job", fake_get)
    monkeypatch.setattr(kube, "_call", fake_call)
    monkeypatch.setattr(kube, "_custom", lambda: type("C", (), {"patch_namespaced_custom_object": None})())
    assert asyncio.run(kube.reserve_serials("ns", "job", 3, floor=4)) == 10
    assert len(reads) == 3
    # Each attempt carries the resourceVersion it read, so a stale one is refused, not applied.
    assert [w["metadata"]["resourceVersion"] for w in written] == ["1", "2", "3"]
    assert written[-1]["metadata"]["annotations"] == {ANNOTATION_NEXT_SERIAL: "13"}
    # A floor above the annotation wins: a lost reservation never re-uses a name.
    conflicts = iter([False])
    assert asyncio.run(kube.reserve_serials("ns", "job", 1, floor=20)) == 20

    async def always_conflict(fn: Any, *args: Any, **kwargs: Any) -> Any:
        raise ApiException(status=409, reason="Conflict")

    monkeypatch.setattr(kube, "_call", always_conflict)
    with pytest.raises(kube.KubeError, match="still conflicting"):
        asyncio.run(kube.reserve_serials("ns", "job", 1, floor=0))
