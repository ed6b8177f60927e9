"""Pushing plans to the trainer agents: in parallel, authenticated with the job's token.

An agent answers 2xx when it takes the plan, 401/403 for a bad token, and 409 when it refuses a
plan that is not newer than the one it holds, or when it has finished training; the body of a 409
carries the epoch the agent holds. Only a 409 from an agent holding this very epoch means the plan
has arrived (a second push after an operator restart). An agent holding a newer epoch did not take
the plan and never will: the operator's status is behind the job, and the controller stops acting
on it instead of pushing again (skew.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import gzip
import json
import logging
import time
from typing import TYPE_CHECKING

from megatron_operator.agent_connections import AgentConnections, AnswerError

# The push processes import this module and nothing of the contract: it would load pydantic and
# every model into each of them (~20 MB apiece).
if TYPE_CHECKING:
    from megatron_contract.mesh import MeshPlan
    from megatron_operator.push_processes import PushProcesses

log = logging.getLogger(__name__)


class PushResult(enum.StrEnum):
    """How one push ended."""

    ACCEPTED = "accepted"
    ALREADY_HELD = "already-held"  # 409: the agent holds this epoch
    AHEAD = "ahead"  # 409: the agent holds a newer epoch
    REFUSED = "refused"  # 409 for another reason: a pod that finished, an answer without the agent's epoch
    UNAUTHORIZED = "unauthorized"
    ERROR = "error"

    @property
    def delivered(self) -> bool:
        """Whether the agent now holds the plan."""
        return self in (PushResult.ACCEPTED, PushResult.ALREADY_HELD)


@dataclasses.dataclass(frozen=True)
class PushOutcome:
    """One push to one member."""

    pod: str
    result: PushResult
    detail: str
    seconds: float
    held_epoch: int | None = None  # the epoch the agent said it holds (a 409's body)
    origin: int | None = None  # PID of the push process that made it (None: the operator's own process)


#: Pushes in flight at once, per pushing process.
PUSH_CONCURRENCY = 512

#: One member to push to: its pod, and its agent's address and port.
Target = tuple[str, str, int]


@dataclasses.dataclass(frozen=True)
class PushRequest:
    """One push: the same POST (a plan of ``epoch``, as :func:`plan_body` made it) to every target."""

    epoch: int
    path: str
    headers: bytes  # "Name: value\r\n" lines
    body: bytes
    targets: list[Target]


def plan_body(plan: MeshPlan) -> bytes:
    """A plan as pushed, serialized and compressed once for every member: a 4096-pod plan is
    0.4-0.6 MB of JSON, sent to all 4096 members; gzip (level 1: ~1-3 ms) makes it 4-8 times
    smaller on the wire. The agents' server (aiohttp) decompresses it, and holds the result to
    MAX_BODY_BYTES."""
    return gzip.compress(plan.model_dump_json(by_alias=True, exclude_none=True).encode(), compresslevel=1)


class PlanPusher:
    """Sends plans over kept-alive connections to the agents, ``concurrency`` at a time.

    A push's ``timeout`` starts when it gets one of those slots, so with more members than slots
    the later pushes are not timed out by their wait in the queue. With ``processes`` (a count), a
    push to at least ``process_min_members`` members is split among that many push processes
    (push_processes.py), which push with the same timeout and concurrency."""

    def __init__(
        self,
        timeout: float = 5.0,
        concurrency: int = PUSH_CONCURRENCY,
        processes: int = 0,
        process_min_members: int = 1,
        origin: int | None = None,
    ) -> None:
        """``origin``: the PID a push process marks its outcomes with (None in the operator)."""
        self.timeout = timeout
        self.origin = origin
        self.concurrency = concurrency
        self.processes: PushProcesses | None = None
        if processes:
            from megatron_operator.push_processes import PushProcesses  # not at the top: it imports this module

            self.processes = PushProcesses(processes, process_min_members, timeout, concurrency)
        self._connections = AgentConnections()
        self._slots: asyncio.Semaphore | None = None  # made in the event loop that pushes

    async def close(self) -> None:
        """Close the connections to the agents, and end the push processes."""
        self._connections.close()
        if self.processes is not None:
            self.processes.close()

    def prepare(self, members: int) -> None:
        """A job of ``members`` members runs: start the push processes now when its plans will go
        through them. Started by its first plan instead, they were not ready for it: that push went
        from this process, whose connections were then closed, and the first failure's push opened
        every connection anew (at 4096 members on 16 cores: 713 ms, against ~400 ms later)."""
        if self.processes is not None and members >= self.processes.min_members:
            self.processes.ready()

    async def push(self, plan: MeshPlan, token: str, pods: set[str] | None = None) -> list[PushOutcome]:
        """Push ``plan`` to its members (or only to ``pods`` among them), all at once."""
        from megatron_contract import wire  # not at the top: see the imports

        body = plan_body(plan)
        headers = (
            f"{wire.AUTH_HEADER}: {wire.AUTH_SCHEME} {token}\r\n"
            "Content-Type: application/json\r\nContent-Encoding: gzip\r\n"
        ).encode()
        targets = [(m.pod, m.address, m.agent_port) for m in plan.members if pods is None or m.pod in pods]
        request = PushRequest(plan.epoch, wire.AGENT_PLAN_PATH, headers, body, targets)
        if self.processes is not None and len(targets) >= self.processes.min_members:
            outcomes = await self.processes.push(request, self.push_targets)
            if outcomes is not None:
                # The connections this process opened to them (its pushes while the push processes
                # started) would stay open an hour unused: thousands of sockets and buffers.
                self._connections.close()
                return outcomes
        return await self.push_targets(request)

    async def push_targets(self, request: PushRequest) -> list[PushOutcome]:
        """Make ``request``'s POSTs from this process."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        slots = self._slots
        outcomes = await asyncio.gather(*(self._push_one(slots, t, request) for t in request.targets))
        self._connections.prune()
        return list(outcomes)

    async def _push_one(self, slots: asyncio.Semaphore, target: Target, request: PushRequest) -> PushOutcome:
        pod, address, port = target
        async with slots:
            start = time.monotonic()
            held: int | None = None
            try:
                async with asyncio.timeout(self.timeout):
                    answer = await self._connections.post(address, port, request.path, request.headers, request.body)
            except (AnswerError, TimeoutError, OSError) as exc:
                detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                return PushOutcome(pod, PushResult.ERROR, detail, time.monotonic() - start, origin=self.origin)
            text = answer.body.decode("utf-8", errors="replace")
            if 200 <= answer.status < 300:
                result = PushResult.ACCEPTED
            elif answer.status == 409:
                held = held_epoch(text)
                result = refusal(request.epoch, held)
            elif answer.status in (401, 403):
                result = PushResult.UNAUTHORIZED
            else:
                result = PushResult.ERROR
            detail = f"HTTP {answer.status} {text[:200]}".strip()
            return PushOutcome(pod, result, detail, time.monotonic() - start, held, self.origin)


def held_epoch(text: str) -> int | None:
    """The epoch an agent's answer says it holds, or None when it says none."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    epoch = value.get("epoch") if isinstance(value, dict) else None
    return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None


def refusal(plan_epoch: int, held: int | None) -> PushResult:
    """What a 409 means: delivered only when the agent holds this very epoch."""
    if held == plan_epoch:
        return PushResult.ALREADY_HELD
    if held is not None and held > plan_epoch:
        return PushResult.AHEAD
    return PushResult.REFUSED
