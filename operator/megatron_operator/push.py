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

import aiohttp

from megatron_contract import wire
from megatron_contract.mesh import MeshPlan, PlanMember

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


def agent_plan_url(member: PlanMember) -> str:
    """The plan endpoint of a member's agent."""
    host = f"[{member.address}]" if ":" in member.address else member.address
    return f"http://{host}:{member.agent_port}{wire.AGENT_PLAN_PATH}"


class PlanPusher:
    """Sends plans over one pooled HTTP client session, ``concurrency`` at a time.

    A push's ``timeout`` starts when it gets one of those slots: aiohttp counts the wait for a pooled
    connection into its ``connect`` and ``total`` timeouts, so with more members than slots the
    later pushes timed out in the queue while the first were answered (a 1024-member plan: most
    of them, at every retry) and every retry queued them again."""

    def __init__(self, timeout: float = 5.0, concurrency: int = 512) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, 2.0))
        self._concurrency = concurrency
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None  # made with the session, in its event loop

    async def _get_session(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        """The session, and its slots: as many as the connector's limit, so no push waits in its pool."""
        if self._session is None or self._session.closed or self._slots is None:
            connector = aiohttp.TCPConnector(limit=self._concurrency, limit_per_host=4, force_close=False)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
            self._slots = asyncio.Semaphore(self._concurrency)
        return self._session, self._slots

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def push(self, plan: MeshPlan, token: str, pods: set[str] | None = None) -> list[PushOutcome]:
        """Push ``plan`` to its members (or only to ``pods`` among them), all at once."""
        session, slots = await self._get_session()
        # Serialized and compressed once for every member: a 4096-pod plan is 0.4-0.6 MB of JSON,
        # sent to all 4096 members; gzip (level 1: ~1-3 ms) makes it 4-8 times smaller on the wire.
        # The agents' server (aiohttp) decompresses it, and holds the result to MAX_BODY_BYTES.
        body = gzip.compress(plan.model_dump_json(by_alias=True, exclude_none=True).encode(), compresslevel=1)
        headers = {
            wire.AUTH_HEADER: f"{wire.AUTH_SCHEME} {token}",
            "Content-Type": "application/json",
            "Content-Encoding": "gzip",
        }
        targets = [m for m in plan.members if pods is None or m.pod in pods]
        return list(
            await asyncio.gather(*(self._push_one(session, slots, m, body, headers, plan.epoch) for m in targets))
        )

    async def _push_one(
        self,
        session: aiohttp.ClientSession,
        slots: asyncio.Semaphore,
        member: PlanMember,
        body: bytes,
        headers: dict[str, str],
        epoch: int,
    ) -> PushOutcome:
        async with slots:
            return await self._post(session, member, body, headers, epoch)

    async def _post(
        self, session: aiohttp.ClientSession, member: PlanMember, body: bytes, headers: dict[str, str], epoch: int
    ) -> PushOutcome:
        start = time.monotonic()
        held: int | None = None
        try:
            async with session.post(agent_plan_url(member), data=body, headers=headers) as resp:
                text = await resp.text()
                if 200 <= resp.status < 300:
                    result = PushResult.ACCEPTED
                elif resp.status == 409:
                    held = held_epoch(text)
                    result = refusal(epoch, held)
                elif resp.status in (401, 403):
                    result = PushResult.UNAUTHORIZED
                else:
                    result = PushResult.ERROR
                detail = f"HTTP {resp.status} {text[:200]}".strip()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            result, detail = PushResult.ERROR, f"{type(exc).__name__}: {exc}"
        return PushOutcome(member.pod, result, detail, time.monotonic() - start, held)


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
