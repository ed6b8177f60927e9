"""``python -m megatron_operator``: serve liveness, elect a leader, then run the kopf operator.

Configuration comes from the environment (:mod:`.settings`); ``KUBECONFIG`` or the in-cluster
service account gives the credentials.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
import sys

import kopf

from megatron_operator import handlers, kube
from megatron_operator.agent_connections import raise_open_file_limit
from megatron_operator.allocator import tune_allocator
from megatron_operator.gc_pauses import log_long_collections
from megatron_operator.health import start_health_server
from megatron_operator.leader import LeaderElector
from megatron_operator.settings import ENV_TOKEN_KEY_FILE, GC_THRESHOLDS, OperatorSettings
from megatron_operator.token import TokenKeyError, read_key


def main(argv: list[str] | None = None) -> int:
    """Run the operator until it is told to stop."""
    gc.set_threshold(*GC_THRESHOLDS)
    allocator = tune_allocator()  # before any thread starts: each would take an arena of its own
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if allocator:
        logging.info("malloc: %s", ", ".join(f"{k}={v}" for k, v in allocator.items()))
    # kopf logs every handler run at INFO; with thousands of pods that drowns what matters.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    settings = OperatorSettings()
    if settings.token_key_file is None:
        logging.error("%s is not set: the operator needs a key to derive each job's token from", ENV_TOKEN_KEY_FILE)
        return 2
    try:
        token_key = read_key(settings.token_key_file)
    except TokenKeyError as exc:
        logging.error("%s", exc)
        return 2
    logging.info("open-file limit %d (a connection is kept open to every agent)", raise_open_file_limit())
    kube.configure(os.environ.get("KUBECONFIG"))
    handlers.configure(settings, token_key)
    if settings.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port)
    elector = None
    if settings.leader_election:
        identity = settings.identity or f"{socket.gethostname()}-{os.getpid()}"
        elector = LeaderElector(settings.lease_namespace, settings.lease_name, identity, settings.lease_seconds)
    log_long_collections()
    try:
        asyncio.run(_run(settings, elector))
    finally:
        if elector is not None:
            elector.release()
    return 0


async def _run(settings: OperatorSettings, elector: LeaderElector | None) -> None:
    """Serve liveness, wait for the Lease, then run kopf, all on one event loop."""
    health = None
    if settings.health_port is not None:
        health = await start_health_server(settings.report_host, settings.health_port)
    try:
        if elector is not None:
            await elector.acquire()  # a standby waits here, its loop free to answer liveness
        namespaces = settings.namespace_list
        logging.info("starting the operator (%s)", ", ".join(namespaces) if namespaces else "all namespaces")
        await kopf.operator(clusterwide=not namespaces, namespaces=namespaces, standalone=True)
    finally:
        if health is not None:
            await health.cleanup()


if __name__ == "__main__":
    sys.exit(main())
