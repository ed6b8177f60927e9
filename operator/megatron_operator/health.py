"""The operator's liveness endpoint: ``GET /healthz``, answered by the operator's event loop itself.

The handler runs on the loop that runs kopf, the controllers and the report endpoint, so the answer
is the proof: a loop that is blocked (a synchronous call that hangs, a busy handler) cannot answer,
and the kubelet's probe times out and restarts the container. A check served from another thread,
or a bare TCP accept (which the kernel completes while the loop is stuck), would say alive while
nothing moves. The server starts before leader election, so a standby that waits for the Lease
answers too; the report endpoint (the readiness probe) opens only on the leader.
"""

from __future__ import annotations

import logging

from aiohttp import web

log = logging.getLogger(__name__)

HEALTH_PATH = "/healthz"


async def healthz(_: web.Request) -> web.Response:
    """200 ``ok``: reaching this line means the event loop runs."""
    return web.Response(text="ok")


async def start_health_server(host: str, port: int) -> web.AppRunner:
    """Serve ``GET /healthz`` on ``host:port`` from the running loop; ``await runner.cleanup()`` stops it."""
    app = web.Application()
    app.router.add_get(HEALTH_PATH, healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    log.info("serving liveness on %s:%d%s", host, port, HEALTH_PATH)
    return runner
