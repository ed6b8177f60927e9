"""Heartbeats to the operator: an ``AgentReport`` every interval, and at once on a failure.

The operator answers ``200 {"epoch": N}``; an N above the agent's epoch means a push was missed,
and the operator re-pushes (the agent only records it). A report that fails to send is not
retried on its own: the next one carries the same failed peers, since they are cleared only when
a report that contained them was acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Callable

import aiohttp

from megatron_contract import wire
from megatron_contract.agent import AgentReport
from megatron_trainer.agent.metrics import AgentMetrics

log = logging.getLogger(__name__)


class HeartbeatSender:
    """Posts reports built by ``build_report`` to ``url`` with the job's bearer token."""

    def __init__(
        self,
        url: str,
        token: str,
        interval_seconds: float,
        build_report: Callable[[], AgentReport],
        on_acknowledged: Callable[[AgentReport, int | None], None],
        metrics: AgentMetrics,
    ) -> None:
        self.url = url
        self.interval_seconds = interval_seconds
        self._headers = {wire.AUTH_HEADER: f"{wire.AUTH_SCHEME} {token}"}
        self._build_report = build_report
        self._on_acknowledged = on_acknowledged
        self._metrics = metrics
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._failures_in_a_row = 0

    def start(self) -> None:
        """Begin the periodic loop (the first report goes out at once)."""
        # A report must never outlive its interval by much: a slow operator should see the next.
        timeout = aiohttp.ClientTimeout(total=max(1.0, 2 * self.interval_seconds))
        self._session = aiohttp.ClientSession(timeout=timeout)
        self._task = asyncio.create_task(self._loop(), name="heartbeat")

    def send_soon(self) -> None:
        """Send the next report now instead of at the end of the interval (a failure to report)."""
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            await self.send_once()
            # +-10% jitter: thousands of pods started together must not report in lockstep.
            period = self.interval_seconds * random.uniform(0.9, 1.1)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=period)

    async def send_once(self) -> bool:
        """Build and post one report; True when the operator acknowledged it."""
        if self._session is None:
            return False
        report = self._build_report()
        try:
            async with self._session.post(self.url, json=report.to_wire(), headers=self._headers) as response:
                body = await response.read()
                if response.status // 100 != 2:
                    raise aiohttp.ClientResponseError(
                        response.request_info, (), status=response.status, message=body[:200].decode(errors="replace")
                    )
                epoch = _epoch_of(body)
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            self._metrics.heartbeats.labels(outcome="error").inc()
            self._failures_in_a_row += 1
            # Log the first failure and then every tenth: an operator restart should not flood the log.
            if self._failures_in_a_row % 10 == 1:
                log.warning(
                    "heartbeat to %s failed (%d in a row): %s: %s",
                    self.url,
                    self._failures_in_a_row,
                    type(err).__name__,
                    err,
                )
            return False
        if self._failures_in_a_row:
            log.info("heartbeats reach the operator again after %d failures", self._failures_in_a_row)
        self._failures_in_a_row = 0
        self._metrics.heartbeats.labels(outcome="ok").inc()
        self._on_acknowledged(report, epoch)
        return True

    async def close(self) -> None:
        """Stop the loop and close the HTTP session."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()


def _epoch_of(body: bytes) -> int | None:
    """The operator's epoch from its answer, or None when it sent none (tolerated, not required)."""
    try:
        value = json.loads(body or b"null")
    except ValueError:
        return None
    epoch = value.get("epoch") if isinstance(value, dict) else None
    return epoch if isinstance(epoch, int) else None
