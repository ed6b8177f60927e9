"""Pushing plans to the trainer agents: in parallel, authenticated with the job's token.

An agent answers 2xx when it takes the plan, 409 when it already holds this epoch or a newer one
(so for the operator the plan has arrived), and 401/403 for a bad token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time

import aiohttp

from megatron_contract import wire
from megatron_contract.mesh import MeshPlan, PlanMember

log = logging.getLogger(__name__)


class PushResult(enum.StrEnum):
    """How one push ended."""

    ACCEPTED = "accepted"
    ALREADY_HELD = "already-held"  # 409: the agent holds this epoch or a newer one
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


def agent_plan_url(member: PlanMember) -> str:
    """The plan endpoint of a member's agent."""
    host = f"[{member.address}]" if ":" in member.address else member.address
    return f"http://{host}:{member.agent_port}{wire.AGENT_PLAN_PATH}"


class PlanPusher:
    """Sends plans over one pooled HTTP client session."""

    def __init__(self, timeout: float = 5.0, concurrency: int = 512) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout, connect=min(timeout, 2.0))
        self._concurrency = concurrency
        self._session: aiohttp.ClientSession | None = None

    async def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._concurrency, limit_per_host=4, force_close=False)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def push(self, plan: MeshPlan, token: str, pods: set[str] | None = None) -> list[PushOutcome]:
        """Push ``plan`` to its members (or only to ``pods`` among them), all at once."""
        session = await self._get_session()
        # Serialized once for every member: a 4096-pod plan is about a megabyte.
        body = plan.model_dump_json(by_alias=True, exclude_none=True).encode()
        headers = {wire.AUTH_HEADER: f"{wire.AUTH_SCHEME} {token}", "Content-Type": "application/json"}
        targets = [m for m in plan.members if pods is None or m.pod in pods]
        return list(await asyncio.gather(*(self._push_one(session, m, body, headers) for m in targets)))

    async def _push_one(
        self, session: aiohttp.ClientSession, member: PlanMember, body: bytes, headers: dict[str, str]
    ) -> PushOutcome:
        start = time.monotonic()
        try:
            async with session.post(agent_plan_url(member), data=body, headers=headers) as resp:
                text = (await resp.text())[:200]
                if 200 <= resp.status < 300:
                    result = PushResult.ACCEPTED
                elif resp.status == 409:
                    result = PushResult.ALREADY_HELD
                elif resp.status in (401, 403):
                    result = PushResult.UNAUTHORIZED
                else:
                    result = PushResult.ERROR
                detail = f"HTTP {resp.status} {text}".strip()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            result, detail = PushResult.ERROR, f"{type(exc).__name__}: {exc}"
        return PushOutcome(member.pod, result, detail, time.monotonic() - start)
