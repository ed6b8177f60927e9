"""The operator's kept-alive connections to the agents, over real loopback sockets.

Scenarios: a second push to an agent goes over the connection of the first (the agent sees one
client port) and the answer's framing is read right (Content-Length, chunked, to the end of the
connection); an agent that closed an idle connection is reached on a new one; an agent whose
server closes a reused connection as the next request arrives is retried once on a new one and
the plan still arrives; an agent that accepts and never answers times out and its connection is
not kept; a connection that closed is forgotten at the next push. The answer reader is also
tested alone on malformed and incomplete input (a fast unit test of one function), and the
operator raises its open-file limit to the hard limit (a connection per agent).
"""

from __future__ import annotations

import asyncio
import resource
import socket
from typing import Any

import pytest
from aiohttp import web
from operator_factories import JOB_UID, make_spec

from megatron_contract import wire
from megatron_contract.mesh import MeshPlan
from megatron_operator.agent_connections import AnswerError, raise_open_file_limit, read_answer
from megatron_operator.planner import PodRef, plan_mesh
from megatron_operator.push import PlanPusher, PushResult


def _plan(ips: list[str], port: int, epoch: int = 1) -> MeshPlan:
    refs = [PodRef(f"p{i}", f"u{i}", ip) for i, ip in enumerate(ips)]
    plan = plan_mesh(make_spec(replicas=len(refs), spares=0), JOB_UID, refs, [], [], None).plan
    assert plan is not None
    members = [m.model_copy(update={"agent_port": port}) for m in plan.members]
    return plan.model_copy(update={"members": members, "epoch": epoch})


def _free_port(ip: str) -> int:
    with socket.socket() as probe:
        probe.bind((ip, 0))
        port: int = probe.getsockname()[1]
        return port


async def _aiohttp_agent(
    ip: str, port: int, peers: list[Any], keepalive: float, chunked: bool = False
) -> web.AppRunner:
    async def handle(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        await request.read()
        if chunked:
            resp = web.StreamResponse(status=409)
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            await resp.write(b'{"error": "not newer", ')
            await resp.write(b'"epoch": 7}')
            await resp.write_eof()
            return resp
        return web.json_response({}, status=200)

    app = web.Application()
    app.router.add_post(wire.AGENT_PLAN_PATH, handle)
    runner = web.AppRunner(app, keepalive_timeout=keepalive)
    await runner.setup()
    await web.TCPSite(runner, ip, port).start()
    return runner


def test_pushes_reuse_one_connection_per_agent_and_reconnect_after_the_agent_closed_it() -> None:
    async def run() -> None:
        ip = "127.0.0.41"
        port = _free_port(ip)
        peers: list[Any] = []
        runner = await _aiohttp_agent(ip, port, peers, keepalive=0.5)
        pusher = PlanPusher(timeout=2)
        try:
            first = await pusher.push(_plan([ip], port, epoch=1), "tok")
            second = await pusher.push(_plan([ip], port, epoch=2), "tok")
            assert pusher._connections.open_count() == 1
            await asyncio.sleep(1.0)  # the agent closes the idle connection
            assert pusher._connections.open_count() == 0
            pusher._connections.prune()
            assert not pusher._connections._idle  # forgotten
            third = await pusher.push(_plan([ip], port, epoch=3), "tok")
        finally:
            await pusher.close()
            await runner.cleanup()
        assert [o.result for o in first + second + third] == [PushResult.ACCEPTED] * 3, [
            o.detail for o in first + second + third
        ]
        assert peers[0] == peers[1]  # the second push came over the first one's connection
        assert peers[2] != peers[1]  # a new connection after the agent closed the idle one

    asyncio.run(run())


def test_a_chunked_answer_is_read_whole() -> None:
    async def run() -> None:
        ip = "127.0.0.42"
        port = _free_port(ip)
        runner = await _aiohttp_agent(ip, port, [], keepalive=5, chunked=True)
        pusher = PlanPusher(timeout=2)
        try:
            outcomes = [*(await pusher.push(_plan([ip], port, epoch=1), "tok"))]
            outcomes += await pusher.push(_plan([ip], port, epoch=2), "tok")  # the connection still usable
        finally:
            await pusher.close()
            await runner.cleanup()
        assert [(o.result, o.held_epoch) for o in outcomes] == [(PushResult.AHEAD, 7)] * 2, [o.detail for o in outcomes]

    asyncio.run(run())


class _OneAnswerPerConnection(asyncio.Protocol):
    """A raw agent that answers the first request of a connection and closes it, unanswered, when
    the second arrives: what a reused connection meets when the agent closed it at that moment."""

    requests: list[int]  # per request: the connection's number
    connections = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        type(self).connections += 1
        self.number = type(self).connections
        self.buf = b""
        self.answered = 0

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].decode().lower()
        length = int(head.split("content-length:")[1].split("\r\n")[0])
        if len(self.buf) < end + 4 + length:
            return
        self.buf = self.buf[end + 4 + length :]
        self.requests.append(self.number)
        if self.answered:
            self.transport.close()
            return
        self.answered += 1
        body = b'{"epoch": 1}'
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


def test_a_reused_connection_closed_by_the_agent_is_retried_once_on_a_new_one() -> None:
    async def run() -> None:
        ip = "127.0.0.43"
        port = _free_port(ip)
        _OneAnswerPerConnection.requests, _OneAnswerPerConnection.connections = [], 0
        server = await asyncio.get_running_loop().create_server(_OneAnswerPerConnection, ip, port)
        pusher = PlanPusher(timeout=2)
        try:
            first = await pusher.push(_plan([ip], port, epoch=1), "tok")
            second = await pusher.push(_plan([ip], port, epoch=2), "tok")
        finally:
            await pusher.close()
            server.close()
            await server.wait_closed()
        assert [o.result for o in first + second] == [PushResult.ACCEPTED] * 2, [o.detail for o in first + second]
        # Connection 1 carried the first push and the second's first try; connection 2 its retry.
        assert _OneAnswerPerConnection.requests == [1, 1, 2]

    asyncio.run(run())


def test_an_agent_that_never_answers_times_out_and_its_connection_is_dropped() -> None:
    async def run() -> None:
        ip = "127.0.0.44"
        port = _free_port(ip)
        accepted: list[asyncio.BaseTransport] = []

        class Silent(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                accepted.append(transport)

        server = await asyncio.get_running_loop().create_server(Silent, ip, port)
        pusher = PlanPusher(timeout=0.5)
        try:
            outcomes = await pusher.push(_plan([ip], port), "tok")
            assert pusher._connections.open_count() == 0
        finally:
            await pusher.close()
            server.close()
            for t in accepted:
                t.close()
            await server.wait_closed()
        assert [o.result for o in outcomes] == [PushResult.ERROR]
        assert outcomes[0].detail.startswith("TimeoutError") and 0.4 < outcomes[0].seconds < 1.5

    asyncio.run(run())


def test_read_answer_frames_and_refuses() -> None:
    buf = bytearray(b'HTTP/1.1 409 Conflict\r\nContent-Length: 12\r\n\r\n{"epoch": 3}HTTP/1.1 200')
    answer = read_answer(buf, at_eof=False)
    assert answer is not None and answer[0].status == 409 and answer[0].body == b'{"epoch": 3}' and not answer[1]
    assert buf == b"HTTP/1.1 200"  # the rest stays for the next answer
    assert read_answer(bytearray(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab"), at_eof=False) is None
    chunked = bytearray(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n")
    answer = read_answer(chunked, at_eof=False)
    assert answer is not None and answer[0].body == b"abcde" and chunked == b""
    to_end = bytearray(b"HTTP/1.0 500 Oops\r\n\r\nbroken")
    assert read_answer(to_end, at_eof=False) is None
    answer = read_answer(to_end, at_eof=True)
    assert answer is not None and answer[0].status == 500 and answer[0].body == b"broken" and answer[1]
    closing = read_answer(bytearray(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"), at_eof=False)
    assert closing is not None and closing[0].body == b"" and closing[1]
    for bad, at_eof in [
        (b"SSH-2.0-OpenSSH\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort", True),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", False),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", True),
        (b"HTTP/1.1 200 O", True),
    ]:
        with pytest.raises(AnswerError):
            read_answer(bytearray(bad), at_eof)


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
        assert raise_open_file_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
