"""The pod's entrypoint: one agent per trainer pod.

The agent starts one worker process per local GPU (or per configured slot on CPU), supervises
them over per-worker socketpair channels (:mod:`megatron_trainer.channel`), hosts the pod's
rendezvous TCPStore, serves the control port (health, metrics, state, plans) and sends heartbeats
to the operator. It imports no torch itself except for the store server, so it outlives any
worker crash. Modules, one concern each:

- :mod:`.settings`: configuration, read from the environment in one place.
- :mod:`.lifecycle`: worker phases with checked transitions and the pod state derived from them.
- :mod:`.plan_acceptance`: the checks a pushed ``MeshPlan`` must pass (token, size, shape, epoch).
- :mod:`.supervisor`: worker processes, their channels, exit and hang detection.
- :mod:`.heartbeat`: ``AgentReport`` heartbeats and failed-peer reports to the operator.
- :mod:`.rendezvous_host`: the TCPStore server bound to the pod address.
- :mod:`.worker_events`: what the workers tell the agent (progress, checkpoints, phase times,
  failed collectives) and its answer to their hangs, exits and restarts.
- :mod:`.checkpoints`: the pod's view of saves and restores, for its report.
- :mod:`.reports`: the heartbeat's ``AgentReport``, the state document, pending failures, gauges.
- :mod:`.metrics`: Prometheus metrics.
- :mod:`.server`: the control HTTP endpoint (aiohttp).
- :mod:`.agent`: the :class:`~.agent.Agent` that holds the plan and ties them together.
"""
