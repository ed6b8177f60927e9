"""``python -m megatron_trainer.agent``: the trainer pod's entrypoint.

Exit codes: 0 when every local worker finished training (or on SIGTERM), 1 when a worker failed
and no restart was left, 2 on bad configuration or when a port cannot be bound.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from megatron_trainer.agent.agent import Agent
from megatron_trainer.agent.server import serve
from megatron_trainer.agent.settings import AgentSettings, SettingsError

log = logging.getLogger("megatron_trainer.agent")


async def run(settings: AgentSettings) -> int:
    """Run one agent until it is done; its exit code."""
    agent = Agent(settings)
    try:
        runner = await serve(agent)
    except OSError as err:
        log.error("cannot bind the control port %s:%d: %s", settings.pod_ip, settings.agent_port, err)
        return 2
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.request_stop, f"signal {signal.Signals(sig).name}")
    try:
        try:
            await agent.start()
        except OSError as err:
            log.error("cannot host the rendezvous store on %s:%d: %s", settings.pod_ip, settings.rendezvous_port, err)
            agent.request_stop("rendezvous store failed", code=2)
        code = await agent.wait()
    finally:
        await agent.stop()
        await runner.cleanup()
    log.info("agent exits with %d", code)
    return code


def main() -> int:
    """Parse the environment, run the agent, return the exit code."""
    logging.basicConfig(
        level=os.environ.get("MEGATRON_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s agent %(name)s: %(message)s",
    )
    try:
        settings = AgentSettings.from_env(os.environ)
    except SettingsError as err:
        log.error("%s", err)
        return 2
    if sys.argv[1:]:
        # spec.args reach the container's command line; workers get their settings from the spec.
        log.warning("ignoring command-line arguments %s: the agent is configured by environment", sys.argv[1:])
    log.info(
        "agent for pod %s of job %s (%s): %d worker(s), control %s:%d, store port %d",
        settings.pod_name,
        settings.job_name or settings.job_uid,
        settings.pod_role,
        settings.gpus_per_pod,
        settings.pod_ip,
        settings.agent_port,
        settings.rendezvous_port,
    )
    return asyncio.run(run(settings))


if __name__ == "__main__":
    sys.exit(main())
