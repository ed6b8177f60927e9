"""The MegatronJob operator: a kopf controller that keeps elastic Megatron-Core jobs training.

Pure modules (no API calls): :mod:`.planner`, :mod:`.builders`, :mod:`.failures`,
:mod:`.heartbeats`, :mod:`.status`, :mod:`.reconcile`. :mod:`.kube` is the one module that talks
to the API server; :mod:`.push` and :mod:`.reports` talk to the trainer agents;
:mod:`.handlers` wires them into kopf.
"""
