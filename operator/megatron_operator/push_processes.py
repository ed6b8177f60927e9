"""Pushing a large plan from several processes at once.

A push costs the operator ~70 µs of CPU per member, almost all of it asyncio's machinery for one
request and its answer (``benchmarks/plan_push.py``): ~0.3 s of one core at 4096 members, the
largest share of failure → pushed once the plan is stored. Processes of their own (the GIL
serializes threads) each push a share of the members, split by agent address so that each
agent's kept-alive connection stays in the process that opened it; the operator's process waits
for their outcomes in threads, its event loop free.

The processes are started with the first push of at least ``min_members`` members, which goes out
from the operator's own process while they start (~0.2 s: they import the push modules only, no
kopf or pydantic). A process that dies or does not answer in time is killed, its share pushed from
the operator's process, and it is started anew for the next push. A process ends when the
operator closes its end of the pipe, or dies.

Run as ``python -m megatron_operator.push_processes FD TIMEOUT CONCURRENCY``: one push process,
its requests and answers pickled over the socket ``FD``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import zlib
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from pathlib import Path

from megatron_operator.agent_connections import raise_open_file_limit
from megatron_operator.push import PlanPusher, PushOutcome, PushRequest, PushResult, Target

log = logging.getLogger(__name__)

#: How long a push process may take to answer beyond its share's worst case (every request timed
#: out, and retried once on a new connection).
ANSWER_SLACK_SECONDS = 10.0
#: How long a closing push process gets to exit before it is killed.
EXIT_SECONDS = 2.0

Fallback = Callable[[PushRequest], Awaitable[list[PushOutcome]]]


class PushProcess:
    """One push process, from the operator's side: its pipe, and whether it said it is ready."""

    def __init__(self, timeout: float, concurrency: int) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), str(timeout), str(concurrency)],
                pass_fds=(theirs.fileno(),),
                env=_child_env(),
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.ready = False
        # One push at a time through the pipe: two jobs may push at once (the second waits).
        self._lock = threading.Lock()

    def poll_ready(self) -> bool:
        """Whether the process has said it is ready (never blocks)."""
        if not self.ready and self.proc.poll() is None and self.conn.poll(0):
            self.ready = self.conn.recv() == "ready"
        return self.ready

    def exchange(self, request: PushRequest, limit: float) -> list[PushOutcome]:
        """Send one push and wait up to ``limit`` seconds for its outcomes (in a thread)."""
        with self._lock:
            self.conn.send(request)
            if not self.conn.poll(limit):
                raise TimeoutError(f"no answer in {limit:.0f} s")
            outcomes = self.conn.recv()
        if not isinstance(outcomes, list):
            raise RuntimeError(f"unexpected answer {outcomes!r:.200}")
        return outcomes

    def close(self) -> None:
        """Close the pipe (the process exits when it reads its end), then wait, then kill."""
        self.conn.close()
        try:
            self.proc.wait(EXIT_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class PushProcesses:
    """``count`` push processes, for pushes to at least ``min_members`` members."""

    def __init__(self, count: int, min_members: int, timeout: float, concurrency: int) -> None:
        if count < 1:
            raise ValueError(f"push processes: count must be at least 1, not {count}")
        self.count = count
        self.min_members = min_members
        self.timeout = timeout
        self.concurrency = concurrency
        self._procs: list[PushProcess | None] = [None] * count
        self._threads = concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix="push-process")
        self.pushes = 0  # pushes made through the processes (tests, logs)

    def ready(self) -> bool:
        """Whether every process runs and said it is ready; starts those that do not run."""
        for i, proc in enumerate(self._procs):
            if proc is None or proc.proc.poll() is not None:
                if proc is not None:
                    log.warning("push process %d exited (%s); starting it again", proc.proc.pid, proc.proc.returncode)
                    proc.close()
                self._procs[i] = PushProcess(self.timeout, self.concurrency)
        return all(p is not None and p.poll_ready() for p in self._procs)

    async def push(self, request: PushRequest, fallback: Fallback) -> list[PushOutcome] | None:
        """Push ``request`` from the processes, each to its share of the targets; None while they
        are not all ready (then push from this process). A process that fails has its share pushed
        by ``fallback``."""
        if not self.ready():
            return None
        shares: list[list[Target]] = [[] for _ in self._procs]
        for target in request.targets:
            shares[_share_of(target, self.count)].append(target)
        loop = asyncio.get_running_loop()

        async def one(i: int, share: list[Target]) -> list[PushOutcome]:
            proc = self._procs[i]
            assert proc is not None
            limit = 2 * self.timeout * math.ceil(len(share) / self.concurrency) + ANSWER_SLACK_SECONDS
            part = dataclasses.replace(request, targets=share)
            try:
                return await loop.run_in_executor(self._threads, proc.exchange, part, limit)
            except (OSError, EOFError, TimeoutError, RuntimeError) as exc:
                log.warning(
                    "push process %d failed (%s: %s); its %d members are pushed from the operator's process",
                    proc.proc.pid,
                    type(exc).__name__,
                    exc,
                    len(share),
                )
                proc.proc.kill()
                proc.close()
                self._procs[i] = None  # started anew by the next push
                return await fallback(part)

        results = await asyncio.gather(*(one(i, share) for i, share in enumerate(shares) if share))
        self.pushes += 1
        return [o for outcomes in results for o in outcomes]

    def pids(self) -> list[int]:
        """The processes' PIDs (running or not)."""
        return [p.proc.pid for p in self._procs if p is not None]

    def close(self) -> None:
        """End every process."""
        for i, proc in enumerate(self._procs):
            if proc is not None:
                proc.close()
                self._procs[i] = None
        self._threads.shutdown(wait=False, cancel_futures=True)


def _share_of(target: Target, count: int) -> int:
    """The process that pushes to ``target``: by agent address, stable from push to push."""
    _, address, port = target
    return zlib.crc32(f"{address}:{port}".encode()) % count


def _child_env() -> dict[str, str]:
    """The operator's environment, with the directories of its packages first on PYTHONPATH (a
    source checkout has them only on the operator's sys.path)."""
    import megatron_contract
    import megatron_operator

    dirs = [str(Path(m.__file__ or "").resolve().parents[1]) for m in (megatron_operator, megatron_contract)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        dict.fromkeys([*dirs, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    )
    return env


def serve(conn: Connection, timeout: float, concurrency: int) -> None:
    """A push process: take pushes from ``conn`` until it closes; answer each with its outcomes."""
    raise_open_file_limit()
    pusher = PlanPusher(timeout=timeout, concurrency=concurrency, origin=os.getpid())
    loop = asyncio.new_event_loop()  # kept between pushes: the connections to the agents live on it
    conn.send("ready")
    try:
        while True:
            try:
                request: PushRequest = conn.recv()
            except (EOFError, OSError):
                return
            try:
                outcomes = loop.run_until_complete(pusher.push_targets(request))
            except Exception as exc:  # answered, not raised: the operator decides what to do
                detail = f"push process: {exc!r}"[:300]
                outcomes = [
                    PushOutcome(pod, PushResult.ERROR, detail, 0.0, origin=pusher.origin)
                    for pod, _, _ in request.targets
                ]
            conn.send(outcomes)
    finally:
        loop.run_until_complete(pusher.close())
        loop.close()


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), float(sys.argv[2]), int(sys.argv[3]))
