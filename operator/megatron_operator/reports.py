"""The operator's endpoint for agent reports: heartbeats and failed peers, over HTTP.

``POST {wire.OPERATOR_REPORT_PATH}`` with ``Authorization: Bearer <job token>`` and one
:class:`AgentReport` as body, or ``{"reports": [...]}`` for a batch (all of one job). The answer
carries the epoch the operator holds for the job, so an agent can tell at once that it is behind.
Reports stay in memory: no API-server write per heartbeat.
"""

from __future__ import annotations

import hmac
import logging
from typing import Protocol

from aiohttp import web
from pydantic import ValidationError

from megatron_contract import wire
from megatron_contract.agent import AgentReport
from megatron_operator.health import HEALTH_PATH, healthz

log = logging.getLogger(__name__)


class ReportSink(Protocol):
    """Who the endpoint hands reports to (the controller registry)."""

    def token_for(self, job_uid: str) -> str | None:
        """The job's token, or None when the job is unknown here."""

    def accept_reports(self, job_uid: str, reports: list[AgentReport]) -> int:
        """Take a batch of reports of one job; returns the epoch of its plan in force."""


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get(wire.AUTH_HEADER, "")
    scheme, _, token = header.partition(" ")
    if scheme != wire.AUTH_SCHEME or not token:
        return None
    return token.strip()


def build_app(sink: ReportSink) -> web.Application:
    """The aiohttp application serving the report endpoint (and ``/healthz``, for readiness)."""

    async def reports(request: web.Request) -> web.Response:
        token = _bearer(request)
        if token is None:
            return web.json_response({"error": "missing bearer token"}, status=401)
        try:
            raw = await request.json()
            items = raw["reports"] if isinstance(raw, dict) and "reports" in raw else [raw]
            batch = [AgentReport.model_validate(item) for item in items]
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            return web.json_response({"error": f"bad report: {exc}"[:2000]}, status=400)
        if not batch:
            return web.json_response({"error": "empty batch"}, status=400)
        uids = {r.job_uid for r in batch}
        if len(uids) != 1:
            return web.json_response({"error": "a batch must hold reports of one job"}, status=400)
        job_uid = uids.pop()
        expected = sink.token_for(job_uid)
        if expected is None:
            return web.json_response({"error": f"unknown job {job_uid}"}, status=404)
        if not hmac.compare_digest(expected.encode(), token.encode()):
            return web.json_response({"error": "bad token"}, status=403)
        epoch = sink.accept_reports(job_uid, batch)
        return web.json_response({"epoch": epoch, "accepted": len(batch)})

    app = web.Application(client_max_size=wire.MAX_BODY_BYTES)
    app.router.add_post(wire.OPERATOR_REPORT_PATH, reports)
    app.router.add_get(HEALTH_PATH, healthz)  # the readiness probe: only the leader serves reports
    return app


async def start_server(sink: ReportSink, host: str, port: int) -> web.AppRunner:
    """Start serving reports on ``host:port``; returns the runner (``await runner.cleanup()`` stops it)."""
    runner = web.AppRunner(build_app(sink), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    log.info("serving agent reports on %s:%d%s", host, port, wire.OPERATOR_REPORT_PATH)
    return runner
