"""The control port: ``GET /healthz``, ``GET /metrics``, ``GET /v1/state``, ``POST /v1/plan``.

A refused plan changes nothing: every check runs before the agent's state is touched, and each
refusal is answered with a JSON ``{"error": ...}`` and counted by status code.
"""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from megatron_contract import wire
from megatron_contract.agent import AgentState
from megatron_trainer.agent.agent import Agent
from megatron_trainer.agent.plan_acceptance import PlanRejected, check_declared_size, check_token

log = logging.getLogger(__name__)

AGENT_KEY: web.AppKey[Agent] = web.AppKey("agent", Agent)


async def healthz(request: web.Request) -> web.Response:
    """200 while the pod can train; 503 once it has failed (a liveness probe restarts it)."""
    agent = request.app[AGENT_KEY]
    state = agent.state
    status = 503 if state is AgentState.FAILED else 200
    return web.json_response({"ok": status == 200, "state": state.value, "epoch": agent.epoch}, status=status)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition."""
    body = request.app[AGENT_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def state(request: web.Request) -> web.Response:
    """Epoch, step, state and workers as JSON."""
    return web.json_response(request.app[AGENT_KEY].state_document())


async def post_plan(request: web.Request) -> web.Response:
    """Accept a newer ``MeshPlan`` signed with the job's token; 4xx and no change otherwise."""
    agent = request.app[AGENT_KEY]
    try:
        check_token(request.headers, agent.settings.token)
        check_declared_size(request.content_length)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked or compressed body: its declared length is not its size
            raise PlanRejected(413, f"body exceeds {wire.MAX_BODY_BYTES} bytes") from None
        except web.RequestPayloadError as bad:  # not in its Content-Encoding (gzip: the operator's), or cut
            raise PlanRejected(400, f"body unreadable: {bad}") from None
        answer = agent.accept_plan(body)
    except PlanRejected as refused:
        agent.metrics.plans.labels(code=str(refused.status)).inc()
        log.warning("refused a plan from %s: %s", request.remote, refused)
        return web.json_response({"error": refused.reason, "epoch": agent.epoch}, status=refused.status)
    agent.metrics.plans.labels(code="200").inc()
    return web.json_response(answer)


def make_app(agent: Agent) -> web.Application:
    """The aiohttp application of one agent."""
    # aiohttp refuses bodies over client_max_size by itself; the plan handler turns that into our 413.
    app = web.Application(client_max_size=wire.MAX_BODY_BYTES)
    app[AGENT_KEY] = agent
    app.router.add_get(wire.AGENT_HEALTH_PATH, healthz)
    app.router.add_get(wire.AGENT_METRICS_PATH, metrics)
    app.router.add_get(wire.AGENT_STATE_PATH, state)
    app.router.add_post(wire.AGENT_PLAN_PATH, post_plan)
    return app


async def serve(agent: Agent) -> web.AppRunner:
    """Bind the control port on the pod address; the caller cleans the runner up."""
    runner = web.AppRunner(make_app(agent), access_log=None, keepalive_timeout=wire.AGENT_KEEPALIVE_SECONDS)
    await runner.setup()
    site = web.TCPSite(runner, agent.settings.pod_ip, agent.settings.agent_port, reuse_address=True)
    await site.start()
    log.info("control port listening on %s:%d", agent.settings.pod_ip, agent.settings.agent_port)
    return runner
