"""kopf handlers: thin. They keep the pod and node indexes, run one controller per job, and wake it.

Everything they decide is decided by pure modules (:mod:`.reconcile`, :mod:`.planner`,
:mod:`.status`); everything they change goes through :mod:`.kube`.

The index functions and event handlers are coroutines, though none of them waits on anything: kopf
runs a plain function in its thread pool, one hand-off per call, queued behind every other. A 4096-
pod job's first plan relabels every pod, and the pod events of those labels, two calls each, held
the next failure's event in that queue for seconds. On the event loop they also set a controller's
``asyncio.Event`` from the loop's own thread, the only thread where that is safe.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any, cast

import kopf

from megatron_contract import wire
from megatron_contract.agent import AgentReport
from megatron_operator import metrics, queueing
from megatron_operator.builders import JobRef
from megatron_operator.controller import JobController
from megatron_operator.failures import PodFacts, node_draining, node_ready_status
from megatron_operator.heartbeats import HeartbeatBook
from megatron_operator.push import PlanPusher
from megatron_operator.reports import start_server
from megatron_operator.settings import OperatorSettings

log = logging.getLogger(__name__)


def push_process_count(settings: OperatorSettings) -> int:
    """How many processes push large plans, as configured (0: none)."""
    if settings.push_processes is not None:
        return settings.push_processes
    return min(4, len(os.sched_getaffinity(0)) // 4)


class Registry:
    """The operator's in-memory state: controllers by job, heartbeats, the indexes, the pusher."""

    def __init__(self, settings: OperatorSettings, token_key: bytes | None = None) -> None:
        self.settings = settings
        self.token_key = token_key  # each job's token is derived from it (token.py)
        self.book = HeartbeatBook()
        self.pusher = PlanPusher(
            timeout=settings.push_timeout_seconds,
            processes=push_process_count(settings),
            process_min_members=settings.push_process_min_members,
        )
        self.by_uid: dict[str, JobController] = {}
        self.by_key: dict[tuple[str, str], JobController] = {}
        self.pods_index: Any = None
        self.nodes_index: Any = None
        self.node_labels_index: Any = None
        self.node_draining_index: Any = None
        self.workloads: dict[tuple[str, str], Mapping[str, Any]] = {}  # Kueue Workloads by job (watched)
        self.runner: Any = None
        self._pod_facts: dict[tuple[str, str], dict[str, PodFacts]] = {}  # by job, by pod UID: its last event's
        self._node_facts: dict[str, tuple[str, dict[str, str], bool]] = {}  # by node: ready, labels, draining

    # ReportSink
    def token_for(self, job_uid: str) -> str | None:
        ctl = self.by_uid.get(job_uid)
        return ctl.token if ctl is not None else None

    def accept_reports(self, job_uid: str, reports: list[AgentReport]) -> int:
        now = time.monotonic()
        for report in reports:
            self.book.record(report, now)
        return self.by_uid[job_uid].accept_reports(reports)

    def pods_of(self, namespace: str, name: str) -> list[PodFacts]:
        if self.pods_index is None:
            return []
        store = self.pods_index.get((namespace, name))
        return list(store) if store is not None else []

    def labels_of_node(self, name: str) -> Mapping[str, str]:
        store = self.node_labels_index.get(name) if self.node_labels_index is not None else None
        return next(iter(store), {}) if store is not None else {}

    def node_readiness(self) -> dict[str, str]:
        if self.nodes_index is None:
            return {}
        return {name: next(iter(store)) for name, store in self.nodes_index.items()}

    def draining_nodes(self) -> set[str]:
        if self.node_draining_index is None:
            return set()
        return {name for name, store in self.node_draining_index.items() if any(store)}

    def workload_of(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        return self.workloads.get((namespace, name))

    def pod_changed(self, type: str | None, job: tuple[str, str], body: Mapping[str, Any]) -> bool:
        """Whether a pod event may change a decision: the pod is new or gone, or the facts the
        operator keeps of it changed other than its role and replica labels (the operator sets
        those itself; a pass corrects them within its resync). A job's first plan relabels every
        pod: at 4096 pods each of those events woke a pass of hundreds of milliseconds."""
        facts = PodFacts.of(body)
        known = self._pod_facts.setdefault(job, {})
        if type == "DELETED":
            known.pop(facts.uid, None)
            return True
        old = known.get(facts.uid)
        known[facts.uid] = facts
        return old is None or dataclasses.replace(old, role=facts.role, replica=facts.replica) != facts

    def forget_pods(self, job: tuple[str, str]) -> None:
        """Drop what pod events said of a job's pods (the job is gone, or another replica leads)."""
        self._pod_facts.pop(job, None)

    def node_changed(self, type: str | None, name: str, body: Mapping[str, Any]) -> bool:
        """Whether a node event may change a decision: the node is new or gone, or its readiness,
        labels (failure domains) or draining state changed. Kubelets and kwok rewrite node status
        on their own schedule (thousands of nodes: events every second), each waking every job."""
        if type == "DELETED":
            self._node_facts.pop(name, None)
            return True
        facts = (node_ready_status(body), dict(body.get("metadata", {}).get("labels") or {}), node_draining(body))
        old = self._node_facts.get(name)
        self._node_facts[name] = facts
        return facts != old

    def wake(self, namespace: str, name: str, why: str) -> None:
        ctl = self.by_key.get((namespace, name))
        if ctl is not None:
            ctl.wake.set(why)

    def children_gone(self, namespace: str, name: str) -> None:
        """A child of the job was deleted: have its controller apply its children again now."""
        ctl = self.by_key.get((namespace, name))
        if ctl is not None:
            ctl.children.due = True
            ctl.wake.set("child deleted")

    def wake_all(self, why: str, delay: float = 0.0) -> None:
        for ctl in self.by_uid.values():
            if delay > 0:
                ctl.wake.set_soon(why, delay)
            else:
                ctl.wake.set(why)


REGISTRY = Registry(OperatorSettings())


def configure(settings: OperatorSettings, token_key: bytes | None = None) -> Registry:
    """Replace the registry's settings and token key (called by ``__main__`` before kopf starts)."""
    global REGISTRY
    REGISTRY = Registry(settings, token_key)
    return REGISTRY


class DiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base in annotations, without deep-copying the status first: kopf drops the
    status from the diff base anyway, and does so after copying the whole object on every event
    of the job; at thousands of pods the status (the plan) is hundreds of kB (~9 % of the
    operator's event loop during failures at 4096 pods)."""

    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        extra = list(extra_fields or ())
        if not extra and "status" in body:  # a handler on a status field would need it
            body = kopf.Body(cast(kopf.RawBody, {k: v for k, v in body.items() if k != "status"}))
        return super().build(body=body, extra_fields=extra)


#: Node events wake the jobs at most this often. No node change acts at once (a NotReady node fails
#: its pods only after the controller's grace of NODE_NOT_READY_GRACE_SECONDS; labels and draining
#: are not urgent), and the control plane rewrites nodes in bursts (kube-controller-manager marking
#: many at once): at 4096 pods each pass they woke held the event loop for 80-250 ms, and a pod
#: failure arriving meanwhile waited behind it.
NODE_WAKE_DELAY_SECONDS = 0.5

#: How long kopf's task for one object waits for its next event before it ends (kopf's default: 5 s).
OBJECT_WORKER_IDLE_SECONDS = 0.5


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    # kopf's bookkeeping lives in annotations under our group, so status holds only our schema.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=wire.GROUP)
    settings.persistence.diffbase_storage = DiffBaseStorage(prefix=wire.GROUP)
    settings.persistence.finalizer = f"{wire.GROUP}/kopf-finalizer"
    # Only warnings of kopf's own become events; ours are posted explicitly after status writes.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    # kopf keeps a task per object that had an event, holding its last event, until it idles this
    # long: after a burst (4096 pods start running, or are relabelled for a job's first plan) the
    # default 5 s held thousands of pod bodies at once, and the operator's memory kept that peak.
    settings.queueing.idle_timeout = OBJECT_WORKER_IDLE_SECONDS
    settings.networking.request_timeout = 30
    # Leader election (see leader.py) keeps a single acting replica; kopf's peering is not needed.
    settings.peering.standalone = True
    REGISTRY.runner = await start_server(REGISTRY, REGISTRY.settings.report_host, REGISTRY.settings.report_port)


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    if REGISTRY.runner is not None:
        await REGISTRY.runner.cleanup()
    await REGISTRY.pusher.close()


@kopf.index("pods", labels={wire.LABEL_JOB: kopf.PRESENT})
async def pods_by_job(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[tuple[str | None, str], PodFacts]:
    """The job's pods, keyed by (namespace, job name): the actual state every decision starts from."""
    return {(namespace, labels[wire.LABEL_JOB]): PodFacts.of(body)}


@kopf.index("nodes")
async def node_readiness(name: str, body: kopf.Body, **_: Any) -> dict[str, str]:
    """Ready status of every node."""
    return {name: node_ready_status(body)}


@kopf.index("nodes")
async def node_labels(name: str, labels: Mapping[str, str], **_: Any) -> dict[str, dict[str, str]]:
    """Labels of every node: a job's failure domains are the values of one of them."""
    return {name: dict(labels)}


@kopf.index("nodes")
async def node_draining_state(name: str, body: kopf.Body, **_: Any) -> dict[str, bool]:
    """Whether each node is cordoned or tainted for maintenance (failures.node_draining)."""
    return {name: node_draining(body)}


@kopf.on.event("pods", labels={wire.LABEL_JOB: kopf.PRESENT})
async def pod_event(
    type: str | None, namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **kwargs: Any
) -> None:
    REGISTRY.pods_index = kwargs["pods_by_job"]
    job = (namespace or "", labels[wire.LABEL_JOB])
    if REGISTRY.pod_changed(type, job, body):
        REGISTRY.wake(*job, "pod")


@kopf.on.event("services", labels={wire.LABEL_JOB: kopf.PRESENT})
async def service_event(type: str | None, namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    """A job's Service deleted (by hand, or by a cleanup script): recreate it now, not at the next check."""
    if type == "DELETED":
        REGISTRY.children_gone(namespace or "", labels[wire.LABEL_JOB])


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels={wire.LABEL_JOB: kopf.PRESENT})
async def disruption_budget_event(type: str | None, namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    """A job's PodDisruptionBudget deleted: apply it again now, or a drain could take a worker meanwhile."""
    if type == "DELETED":
        REGISTRY.children_gone(namespace or "", labels[wire.LABEL_JOB])


@kopf.on.event(queueing.GROUP, queueing.VERSION, queueing.WORKLOADS, labels={wire.LABEL_JOB: kopf.PRESENT})
async def workload_event(
    type: str | None, namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> None:
    """A queued job's Kueue Workload (admitted, evicted, ...): kept for its controller, which wakes.
    Not watched (and never needed) in a cluster without Kueue."""
    key = (namespace or "", labels[wire.LABEL_JOB])
    if type == "DELETED":
        REGISTRY.workloads.pop(key, None)
    else:
        REGISTRY.workloads[key] = copy.deepcopy(dict(body))
    REGISTRY.wake(*key, "workload")


@kopf.on.event("nodes")
async def node_event(type: str | None, name: str, body: kopf.Body, **kwargs: Any) -> None:
    REGISTRY.nodes_index = kwargs["node_readiness"]
    REGISTRY.node_labels_index = kwargs["node_labels"]
    REGISTRY.node_draining_index = kwargs["node_draining_state"]
    changed = REGISTRY.node_changed(type, name, body)
    if type is not None and changed:  # not the initial listing
        REGISTRY.wake_all("node", NODE_WAKE_DELAY_SECONDS)


@kopf.daemon(wire.GROUP, wire.VERSION, wire.PLURAL, cancellation_timeout=2.0)
async def job_daemon(body: kopf.Body, stopped: kopf.DaemonStopped, **kwargs: Any) -> None:
    """One controller per job, for as long as the job exists."""
    REGISTRY.pods_index = kwargs["pods_by_job"]
    REGISTRY.nodes_index = kwargs["node_readiness"]
    REGISTRY.node_labels_index = kwargs["node_labels"]
    REGISTRY.node_draining_index = kwargs["node_draining_state"]
    job = JobRef.of(body)
    key = (job.namespace, job.name)
    ctl = JobController(
        job,
        body,
        REGISTRY.settings,
        REGISTRY.book,
        REGISTRY.pusher,
        pods_of=lambda: REGISTRY.pods_of(*key),
        nodes=REGISTRY.node_readiness,
        token_key=REGISTRY.token_key,
        node_labels=REGISTRY.labels_of_node,
        draining=REGISTRY.draining_nodes,
        workload_of=lambda: REGISTRY.workload_of(*key),
    )
    REGISTRY.by_uid[job.uid] = ctl
    REGISTRY.by_key[key] = ctl
    metrics.start_job(*key)
    try:
        await ctl.run(stopped)
    finally:
        await ctl.children.close()
        REGISTRY.by_uid.pop(job.uid, None)
        if REGISTRY.by_key.get(key) is ctl:
            REGISTRY.by_key.pop(key, None)
            REGISTRY.forget_pods(key)
            metrics.forget_job(*key)
        REGISTRY.book.forget(job.uid)
