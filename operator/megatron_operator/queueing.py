"""Gang admission through Kueue: the job's Workload and what its state means for the job's pods.

A job labelled ``kueue.x-k8s.io/queue-name`` is a Kueue *external framework*: the operator creates
and owns one ``Workload`` (kueue.x-k8s.io/v1beta2) whose pod sets are the job's workers and spares,
each with the pod the operator would create, and creates no pod until Kueue admits it (quota
reserved and ``Admitted``), then creates them with the node labels of the flavors Kueue assigned
merged into their node selector. Not admitted, the job is suspended (suspend.py): before its first
admission it simply has no pods; when Kueue evicts it (preemption, deactivation) its members write a
checkpoint and its pods are deleted, or, if that checkpoint cannot be written within
``checkpoint.suspendTimeoutSeconds``, the pods are deleted without it. Once none is left the
operator gives the quota back (Kueue's job framework does this for the kinds it knows: an external
controller must) and the Workload queues again; admitted again, the job resumes from its checkpoint.

Everything here is pure but :class:`QueueGate`, which reads and writes through :mod:`.kube`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from megatron_contract import wire
from megatron_contract.job import MegatronJobSpec
from megatron_operator import builders, kube
from megatron_operator.builders import JobRef
from megatron_operator.status import Reason
from megatron_operator.suspend import Stage, SuspendRequest, Suspension

log = logging.getLogger(__name__)

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
WORKLOADS = "workloads"
RESOURCE_FLAVORS = "resourceflavors"
WORKER_POD_SET = "workers"
SPARE_POD_SET = "spares"
#: How long a cluster without Kueue's CRDs is taken as such before the operator asks again.
ABSENT_RECHECK_SECONDS = 60.0
_ROLE_POD_SET = {wire.ROLE_WORKER: WORKER_POD_SET, wire.ROLE_SPARE: SPARE_POD_SET}
#: How long a Workload this process created may take to show in the watch before it is created again
#: (it was deleted meanwhile: by hand, or for a new size).
WATCH_GRACE_SECONDS = 10.0
#: Eviction reasons after which the Workload queues again (Kueue's job framework marks it Requeued).
_REQUEUED_REASONS = ("Preempted", "NodeFailures")


class Verdict(enum.StrEnum):
    PENDING = "Pending"  # not admitted yet: no pod
    ADMITTED = "Admitted"  # pods may run
    EVICTED = "Evicted"  # admitted, then evicted: pods go, then the quota is given back


@dataclasses.dataclass(frozen=True)
class Gate:
    """What the Workload allows: its verdict, why, and per role the node selector of its flavors."""

    verdict: Verdict
    message: str
    node_selectors: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    since: datetime | None = None  # when Kueue evicted the Workload (EVICTED)

    def node_selector(self, role: str) -> Mapping[str, str]:
        return self.node_selectors.get(role, {})


def queue_name(body: Any) -> str | None:
    """The LocalQueue a job asks for (its label), or None."""
    labels = (body.get("metadata") or {}).get("labels") or {}
    return labels.get(QUEUE_LABEL) or None


def workload_name(job: JobRef) -> str:
    return f"megatronjob-{job.name}"


def _pod_set(job: JobRef, spec: MegatronJobSpec, role: str, count: int) -> dict[str, Any]:
    """A pod set: ``count`` pods like the operator's own (their requests are what Kueue counts)."""
    pod = builders.build_pod(job, spec, serial=0, role=role, operator_url="")
    pod_spec = pod["spec"]
    for key in ("hostname", "subdomain"):  # per pod, not per set
        pod_spec.pop(key, None)
    return {
        "name": _ROLE_POD_SET[role],
        "count": count,
        "template": {"metadata": {"labels": {k: v for k, v in pod["metadata"]["labels"].items()}}, "spec": pod_spec},
    }


def pod_set_counts(spec: MegatronJobSpec) -> dict[str, int]:
    """The pods of each pod set the job's Workload asks for."""
    counts = {WORKER_POD_SET: spec.worker_pods}
    if spec.spares:
        counts[SPARE_POD_SET] = spec.spares
    return counts


def counts_of(workload: Mapping[str, Any]) -> dict[str, int]:
    return {p.get("name"): p.get("count") for p in (workload.get("spec") or {}).get("podSets") or []}


def build_workload(job: JobRef, spec: MegatronJobSpec, queue: str) -> dict[str, Any]:
    """The job's Workload: workers (every pod of the full mesh) and spares, admitted as one gang.

    Complete as written: no admission webhook of Kueue's has to default anything.
    """
    role_of = {WORKER_POD_SET: wire.ROLE_WORKER, SPARE_POD_SET: wire.ROLE_SPARE}
    pod_sets = [_pod_set(job, spec, role_of[name], count) for name, count in pod_set_counts(spec).items()]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Workload",
        "metadata": {
            "name": workload_name(job),
            "namespace": job.namespace,
            "labels": {**builders.child_labels(job), QUEUE_LABEL: queue},
            "ownerReferences": [builders.owner_reference(job)],
        },
        "spec": {"queueName": queue, "podSets": pod_sets, "active": True},
    }


def _condition(workload: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    conditions = (workload.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == type_), None)


def _is_true(workload: Mapping[str, Any], type_: str) -> bool:
    c = _condition(workload, type_)
    return c is not None and c.get("status") == "True"


def flavors_of(workload: Mapping[str, Any]) -> set[str]:
    """The ResourceFlavors an admission assigned."""
    admission = (workload.get("status") or {}).get("admission") or {}
    return {f for a in admission.get("podSetAssignments") or [] for f in (a.get("flavors") or {}).values()}


def read_gate(workload: Mapping[str, Any], flavor_labels: Mapping[str, Mapping[str, str]]) -> Gate:
    """The verdict of the Workload as stored; ``flavor_labels``: nodeLabels of each assigned flavor."""
    status = workload.get("status") or {}
    evicted = _condition(workload, "Evicted")
    if evicted is not None and evicted.get("status") == "True" and status.get("admission") is not None:
        return Gate(Verdict.EVICTED, f"{evicted.get('reason')}: {evicted.get('message', '')}", since=_time(evicted))
    if status.get("admission") is None or not _is_true(workload, "Admitted"):
        reserved = _condition(workload, "QuotaReserved")
        why = reserved.get("message") if reserved is not None else ""
        if not (workload.get("spec") or {}).get("active", True):
            why = "the Workload is deactivated (spec.active: false)"
        return Gate(Verdict.PENDING, why or "waiting for Kueue to admit the Workload")
    selectors: dict[str, dict[str, str]] = {}
    updates = {u.get("name"): u for c in status.get("admissionChecks") or [] for u in c.get("podSetUpdates") or []}
    for assignment in status["admission"].get("podSetAssignments") or []:
        selector: dict[str, str] = {}
        for flavor in sorted(set((assignment.get("flavors") or {}).values())):
            selector.update(flavor_labels.get(flavor, {}))
        selector.update((updates.get(assignment.get("name")) or {}).get("nodeSelector") or {})
        for role, pod_set in _ROLE_POD_SET.items():
            if assignment.get("name") == pod_set:
                selectors[role] = selector
    queue = status["admission"].get("clusterQueue", "")
    return Gate(Verdict.ADMITTED, f"admitted by ClusterQueue {queue}", selectors)


def _time(cond: Mapping[str, Any]) -> datetime | None:
    stamp = cond.get("lastTransitionTime")
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")) if stamp else None
    except ValueError:
        return None


def admitted_condition(gate: Gate) -> tuple[bool, str]:
    """The job's ``QueueAdmitted`` condition (status, reason) for a verdict."""
    if gate.verdict is Verdict.ADMITTED:
        return True, Reason.QUEUE_ADMITTED
    if gate.verdict is Verdict.EVICTED:
        return False, Reason.QUEUE_EVICTED
    return False, Reason.WAITING_FOR_QUEUE_ADMISSION


def suspend_request(gate: Gate | None) -> SuspendRequest | None:
    """Not admitted (yet, or any more), a queued job is suspended: its pods stop with its work kept."""
    if gate is None or gate.verdict is Verdict.ADMITTED:
        return None
    reason = Reason.QUEUE_EVICTED if gate.verdict is Verdict.EVICTED else Reason.WAITING_FOR_QUEUE_ADMISSION
    return SuspendRequest(reason, f"Kueue has not admitted the job's Workload ({gate.message[:1000]})")


def forced_stop(
    gate: Gate, suspension: Suspension | None, limit: float, now: datetime, checkpoint_step: int | None
) -> Suspension | None:
    """An evicted job whose checkpoint cannot be had in time stops without it: Kueue wants the quota
    back. That is when its suspension's checkpoint failed or timed out, or the eviction is older
    than ``limit`` (``checkpoint.suspendTimeoutSeconds``; 0 for a job without checkpoints) and the
    pods are still there. None: the suspension goes its own way."""
    if suspension is None or suspension.stage in (Stage.STOP, Stage.STOPPED, Stage.RESUME):
        return None
    waited = (now - gate.since).total_seconds() if gate.since is not None else 0.0
    if suspension.stage not in (Stage.FAILED, Stage.TIMED_OUT) and waited < limit:
        return None
    resumes = f"the checkpoint of step {checkpoint_step}" if checkpoint_step is not None else "the start"
    message = (
        f"Kueue evicted the job's Workload ({gate.message[:1000]}) and no checkpoint of its last steps "
        f"could be written within {limit:g} s: every pod deleted without one; resumes from {resumes}"
    )
    return Suspension(Stage.STOP, (True, Reason.QUEUE_EVICTED, message), checkpoint_step)


def with_node_selector(pod: dict[str, Any], selector: Mapping[str, str]) -> dict[str, Any]:
    """The pod with the admission's node selector merged into its own (the admission's wins)."""
    if selector:
        pod["spec"]["nodeSelector"] = {**(pod["spec"].get("nodeSelector") or {}), **selector}
    return pod


def release_status(workload: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """The status patch that gives an evicted Workload's quota back once its pods are gone, as Kueue's
    job framework does for the kinds it manages: admission cleared, ``QuotaReserved`` and ``Admitted``
    False, ``Requeued`` True after a preemption (the Workload queues again), False otherwise."""
    evicted = _condition(workload, "Evicted") or {}
    reason, message = evicted.get("reason", "Evicted"), evicted.get("message", "")
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    generation = (workload.get("metadata") or {}).get("generation")
    conditions = {c["type"]: dict(c) for c in (workload.get("status") or {}).get("conditions") or []}

    def put(type_: str, status: str, why: str, text: str) -> None:
        old = conditions.get(type_) or {}
        since = old.get("lastTransitionTime", stamp) if old.get("status") == status else stamp
        conditions[type_] = {
            "type": type_,
            "status": status,
            "reason": why,
            "message": text[:32768],
            "lastTransitionTime": since,
            **({"observedGeneration": generation} if generation is not None else {}),
        }

    put("Requeued", "True" if reason in _REQUEUED_REASONS else "False", reason, message)
    put("QuotaReserved", "False", "Pending", message)
    put("Admitted", "False", "NoReservation", "The workload has no reservation")
    return {
        "metadata": {"resourceVersion": workload["metadata"]["resourceVersion"]},
        "status": {"admission": None, "conditions": list(conditions.values())},
    }


class QueueGate:
    """One job's side of Kueue: creates its Workload, reads the Workload the watch saw, gives the
    quota back after an eviction. ``workload_of`` returns the Workload as last watched (or None)."""

    def __init__(self, job: JobRef, workload_of: Callable[[], Mapping[str, Any] | None]) -> None:
        self.job = job
        self.workload_of = workload_of
        self.absent_until = 0.0  # monotonic time until which Kueue is taken as not installed
        self.created_at = -float("inf")  # when this process last created the Workload (the watch lags)
        self.flavor_labels: dict[str, dict[str, str]] = {}
        self.released_version: str | None = None  # the Workload version already released

    async def gate(self, body: Any, spec: MegatronJobSpec) -> Gate | None:
        """The Workload's verdict for the job's pods; None when the job is not queued (no label, or
        no Kueue in the cluster: the job then runs as any other, as Kueue's own integrations do).

        A Workload whose pod sets no longer match the spec (``replicas`` or ``spares`` edited) is
        deleted and made again: the job queues again at its new size (suspended meanwhile), as
        Kueue does when a job it manages changes shape."""
        queue = queue_name(body)
        if queue is None or time.monotonic() < self.absent_until:
            return None
        workload = self.workload_of()
        name = workload_name(self.job)
        if workload is None:
            if time.monotonic() - self.created_at < WATCH_GRACE_SECONDS:
                return Gate(Verdict.PENDING, f"Workload {name} created in queue {queue}")
            try:
                await kube.create_custom(GROUP, VERSION, WORKLOADS, build_workload(self.job, spec, queue))
            except kube.NotServed:
                self.absent_until = time.monotonic() + ABSENT_RECHECK_SECONDS
                log.warning(
                    "%s/%s: labelled for Kueue queue %r, but the cluster serves no Kueue Workloads: "
                    "the job runs without queueing",
                    self.job.namespace,
                    self.job.name,
                    queue,
                )
                return None
            self.created_at = time.monotonic()
            return Gate(Verdict.PENDING, f"Workload {name} created in queue {queue}")
        meta = workload.get("metadata") or {}
        owners = {o.get("uid") for o in meta.get("ownerReferences") or []}
        if meta.get("deletionTimestamp") or self.job.uid not in owners:
            return Gate(Verdict.PENDING, f"Workload {name} is being deleted (another job's, or of another size)")
        wanted, held = pod_set_counts(spec), counts_of(workload)
        if held != wanted:
            log.info(
                "%s/%s: pod sets %s, the Workload has %s: made again", self.job.namespace, self.job.name, wanted, held
            )
            await kube.delete_custom(GROUP, VERSION, WORKLOADS, self.job.namespace, name)
            return Gate(
                Verdict.PENDING, f"the job's pod sets changed ({held} -> {wanted}): Workload {name} is made again"
            )
        for flavor in flavors_of(workload) - set(self.flavor_labels):
            found = await kube.get_cluster_custom(GROUP, VERSION, RESOURCE_FLAVORS, flavor)
            self.flavor_labels[flavor] = dict(((found or {}).get("spec") or {}).get("nodeLabels") or {})
        return read_gate(workload, self.flavor_labels)

    async def release(self) -> bool:
        """Give an evicted Workload's quota back (the pods are gone); True when this call did (once per
        version of the Workload: the watch may still show the version released)."""
        workload = self.workload_of()
        if workload is None:
            return False
        version = workload["metadata"]["resourceVersion"]
        if version == self.released_version:
            return False
        patch = release_status(workload, datetime.now(UTC))
        name = workload_name(self.job)
        if not await kube.patch_custom_status(GROUP, VERSION, WORKLOADS, self.job.namespace, name, patch):
            return False  # changed meanwhile: the watch brings the new version, the next pass tries again
        self.released_version = version
        return True
