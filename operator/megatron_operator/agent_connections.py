"""Keep-alive HTTP/1.1 connections to the trainer agents, for pushing plans.

A push sends one request shape: a POST of the same gzipped plan to every member, answered with a
small JSON body. aiohttp's client spent 230-550 µs of the operator's CPU per member on it (a
4096-member push: 0.94-1.43 s over reused connections, 1.58-2.24 s over new ones), most of it in
request machinery this request does not use (URL objects, cookies, tracing, payload objects). Here
the request's bytes are written as they are and the answer is read by its Content-Length (or
chunked, or to the end): 0.35 s of CPU for 4096 members (``benchmarks/plan_push.py``).

Connections stay open between pushes, one per agent at a time (more while pushes to it overlap):
a failure's push reaches thousands of agents that were pushed to before, and opening a
connection costs the operator about as much as the request. The agents keep an idle connection an hour
(``megatron_trainer.agent.server``); TCP keep-alive probes close one whose peer vanished without
closing it (a node gone), and a reused connection that the agent closed meanwhile is retried once
on a new one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import resource
import socket
import typing

log = logging.getLogger(__name__)

#: The most bytes of an answer read (the agents answer with a few bytes of JSON).
MAX_ANSWER_BYTES = 1 << 20
#: TCP keep-alive: the first probe after this many idle seconds, then every KEEPALIVE_INTERVAL.
KEEPALIVE_IDLE = 60
KEEPALIVE_INTERVAL = 10
KEEPALIVE_PROBES = 6


def raise_open_file_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; the new soft limit.

    One connection is kept per agent: a 4096-pod job needs 4096 descriptors, and some container
    runtimes start a process with a soft limit of 1024 (and a hard one far above)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


class AnswerError(Exception):
    """The agent's answer could not be read (malformed, too large, or the connection closed)."""


@dataclasses.dataclass(frozen=True)
class Answer:
    """An agent's answer: status code and body."""

    status: int
    body: bytes


def read_answer(buf: bytearray, at_eof: bool) -> tuple[Answer, bool] | None:
    """The first complete answer in ``buf`` (consumed from it) and whether the agent closes the
    connection after it; None while incomplete. ``at_eof``: no more bytes will come."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if at_eof or len(buf) > MAX_ANSWER_BYTES:
            raise AnswerError("connection closed before an answer" if at_eof else "answer head too large")
        return None
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise AnswerError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
    status = int(parts[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    closes = headers.get("connection", "").lower() == "close" or parts[0] == "HTTP/1.0"
    start = end + 4
    if "chunked" in headers.get("transfer-encoding", "").lower():
        chunked = _read_chunked(buf, start, at_eof)
        if chunked is None:
            return None
        body, stop = chunked
    elif "content-length" in headers:
        length = headers["content-length"]
        if not length.isdigit() or int(length) > MAX_ANSWER_BYTES:
            raise AnswerError(f"bad Content-Length: {length[:40]!r}")
        stop = start + int(length)
        if len(buf) < stop:
            if at_eof:
                raise AnswerError("connection closed inside an answer")
            return None
        body = bytes(buf[start:stop])
    elif status in (204, 304) or status < 200:
        body, stop = b"", start
    else:  # the body runs to the end of the connection
        if len(buf) - start > MAX_ANSWER_BYTES:
            raise AnswerError("answer too large")
        if not at_eof:
            return None
        body, stop, closes = bytes(buf[start:]), len(buf), True
    del buf[:stop]
    return Answer(status, body), closes


def _read_chunked(buf: bytearray, pos: int, at_eof: bool) -> tuple[bytes, int] | None:
    """A chunked body starting at ``pos``: (body, where it ends), or None while incomplete."""
    body = bytearray()
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            break
        size_text = bytes(buf[pos:eol]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise AnswerError(f"bad chunk size: {size_text[:20]!r}") from None
        if size == 0:  # the last chunk, then trailers up to an empty line
            end = buf.find(b"\r\n\r\n", eol)
            if end < 0:
                break
            return bytes(body), end + 4
        if len(body) + size > MAX_ANSWER_BYTES:
            raise AnswerError("answer too large")
        if len(buf) < eol + 2 + size + 2:
            break
        body += buf[eol + 2 : eol + 2 + size]
        pos = eol + 2 + size + 2
    if at_eof:
        raise AnswerError("connection closed inside a chunked answer")
    return None


class AgentConnection(asyncio.Protocol):
    """One connection to an agent; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.used = False  # has carried an answer: a failure before the next answer may be a stale connection
        self._buf = bytearray()
        self._waiter: asyncio.Future[tuple[Answer, bool]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _keep_alive(sock)

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:  # bytes nobody asked for: the next answer could not be told apart
            self.close()
            return
        self._buf += data
        self._deliver(at_eof=False)

    def eof_received(self) -> bool:
        self._deliver(at_eof=True)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(AnswerError(f"connection closed before an answer ({exc or 'EOF'})"))

    def _deliver(self, at_eof: bool) -> None:
        if self._waiter is None or self._waiter.done():
            return  # at the end, connection_lost follows and marks the connection lost
        try:
            answer = read_answer(self._buf, at_eof)
        except AnswerError as exc:
            self._waiter.set_exception(exc)
            return
        if answer is not None:
            self._waiter.set_result(answer)

    async def exchange(self, request: list[bytes]) -> Answer:
        """Send one request (its parts, written as they are) and read its answer."""
        assert self.transport is not None and self._waiter is None
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            self.transport.writelines(request)
            answer, closes = await self._waiter
        finally:
            self._waiter = None
        self.used = True
        if closes:
            self.close()
        return answer

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


def _keep_alive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        if hasattr(socket, name):  # Linux; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class AgentConnections:
    """Idle connections by agent (host, port), reused by the next request to that agent."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[AgentConnection]] = {}

    async def post(self, host: str, port: int, path: str, headers: bytes, body: bytes) -> Answer:
        """POST ``body`` with ``headers`` (``Name: value\\r\\n`` lines, Content-Length added) to an
        agent. Raises AnswerError or OSError; a caller's timeout cancels it (the connection is
        then closed: its state is unknown)."""
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Length: {len(body)}\r\n".encode() + headers + b"\r\n"
        )
        key = (host, port)
        while True:
            conn = self._take(key)
            if conn is None:
                transport, conn = await asyncio.get_running_loop().create_connection(AgentConnection, host, port)
                if conn.transport is None:  # uvloop calls connection_made after create_connection returns
                    conn.connection_made(transport)
            try:
                answer = await conn.exchange([head, body])
            except AnswerError:
                conn.close()
                if not conn.used:  # a new connection: only a reused one may have gone stale
                    raise
                continue  # the agent closed a connection idle since the last push: once more, on a new one
            except BaseException:
                conn.close()
                raise
            if not conn.lost:
                self._idle.setdefault(key, []).append(conn)
            return answer

    def _take(self, key: tuple[str, int]) -> AgentConnection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.lost:
                return conn
        self._idle.pop(key, None)
        return None

    def prune(self) -> None:
        """Forget the connections that closed (an agent that left, or closed an idle one)."""
        for key in [k for k, conns in self._idle.items() if any(c.lost for c in conns)]:
            live = [c for c in self._idle[key] if not c.lost]
            if live:
                self._idle[key] = live
            else:
                del self._idle[key]

    def open_count(self) -> int:
        """Idle connections held open."""
        return sum(1 for conns in self._idle.values() for c in conns if not c.lost)

    def close(self) -> None:
        """Close every idle connection."""
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
