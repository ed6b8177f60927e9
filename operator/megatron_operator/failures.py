"""Failure classification: from a pod's facts (and its node's, and its agent's) to a failure or none.

Every failure source (docs/architecture.md) is here: pod deleted or evicted, container terminated or
restarted, phase Failed, node NotReady/Unknown, heartbeats missing past the job's deadline, and a
survivor's report that a collective with the pod failed. The fastest one wins: whichever the
operator sees first marks the pod failed, and a failed pod never comes back into a plan.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from megatron_contract import wire


class FailureReason(enum.StrEnum):
    """Why a pod was declared failed (also the reason of its Kubernetes event)."""

    POD_DELETED = "PodDeleted"
    POD_EVICTED = "PodEvicted"
    POD_FAILED = "PodFailed"
    CONTAINER_TERMINATED = "ContainerTerminated"
    CONTAINER_RESTARTED = "ContainerRestarted"
    NODE_NOT_READY = "NodeNotReady"
    HEARTBEAT_MISSING = "HeartbeatMissing"
    PEER_REPORTED = "PeerReportedFailure"
    AGENT_REPORTED = "AgentReportedFailure"


class PodHealth(enum.StrEnum):
    """Where a pod stands, as far as the mesh is concerned."""

    PENDING = "pending"  # not running yet (or no address): cannot be placed
    READY = "ready"  # running with an address: can train or wait as a spare
    SUCCEEDED = "succeeded"  # its trainer finished the job
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class PodFacts:
    """What the operator keeps of a pod (the value of its in-memory index)."""

    name: str
    uid: str
    role: str
    serial: int
    phase: str
    ip: str | None
    node: str | None
    deleting: bool
    status_reason: str | None
    terminated: tuple[int, str] | None  # (exit code, reason) of the trainer container
    restarts: int
    replica: str | None = None
    waiting: str | None = None  # reason the trainer container waits to start (CreateContainerConfigError, ...)

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> PodFacts:
        """Extract the facts from a pod body."""
        meta = body.get("metadata", {})
        status = body.get("status") or {}
        labels = meta.get("labels") or {}
        terminated: tuple[int, str] | None = None
        waiting: str | None = None
        restarts = 0
        for cs in status.get("containerStatuses") or []:
            if cs.get("name", wire.TRAINER_CONTAINER) != wire.TRAINER_CONTAINER:
                continue  # a sidecar of the template: its exit or restart is not the trainer's
            restarts += int(cs.get("restartCount") or 0)
            term = (cs.get("state") or {}).get("terminated")
            if term is not None:
                terminated = (int(term.get("exitCode", -1)), str(term.get("reason") or ""))
            waiting = ((cs.get("state") or {}).get("waiting") or {}).get("reason") or waiting
        try:
            serial = int(labels.get(wire.LABEL_POD_INDEX, "-1"))
        except ValueError:
            serial = -1
        return cls(
            name=meta.get("name", ""),
            uid=meta.get("uid", ""),
            role=labels.get(wire.LABEL_ROLE, ""),
            serial=serial,
            phase=status.get("phase") or "Pending",
            ip=status.get("podIP") or None,
            node=(body.get("spec") or {}).get("nodeName"),
            deleting=meta.get("deletionTimestamp") is not None,
            status_reason=status.get("reason"),
            terminated=terminated,
            restarts=restarts,
            replica=labels.get(wire.LABEL_REPLICA),
            waiting=waiting,
        )


@dataclasses.dataclass(frozen=True)
class Failure:
    """A pod declared failed, why, and in words."""

    pod: str
    reason: FailureReason
    message: str


def classify_pod(pod: PodFacts, node_ready: Mapping[str, str]) -> tuple[PodHealth, Failure | None]:
    """Health of a pod from its own facts and its node's Ready condition.

    Args:
        pod: the pod's facts.
        node_ready: Ready condition status ("True", "False", "Unknown") by node name; a node not
            in the map is assumed Ready (the operator may not be allowed to read nodes).
    """
    if pod.deleting:
        return PodHealth.FAILED, Failure(pod.name, FailureReason.POD_DELETED, f"pod {pod.name} is being deleted")
    if pod.phase == "Succeeded":
        return PodHealth.SUCCEEDED, None
    if pod.phase == "Failed":
        if pod.status_reason == "Evicted":
            return PodHealth.FAILED, Failure(pod.name, FailureReason.POD_EVICTED, f"pod {pod.name} was evicted")
        return PodHealth.FAILED, Failure(
            pod.name, FailureReason.POD_FAILED, f"pod {pod.name} failed ({pod.status_reason or 'phase Failed'})"
        )
    if pod.terminated is not None:
        code, why = pod.terminated
        if code == 0:
            return PodHealth.SUCCEEDED, None
        return PodHealth.FAILED, Failure(
            pod.name, FailureReason.CONTAINER_TERMINATED, f"trainer of {pod.name} exited with {code} {why}".strip()
        )
    if pod.restarts > 0:
        return PodHealth.FAILED, Failure(
            pod.name, FailureReason.CONTAINER_RESTARTED, f"trainer of {pod.name} restarted {pod.restarts} times"
        )
    if pod.node is not None and node_ready.get(pod.node, "True") != "True":
        return PodHealth.FAILED, Failure(
            pod.name,
            FailureReason.NODE_NOT_READY,
            f"node {pod.node} of pod {pod.name} is Ready={node_ready.get(pod.node)}",
        )
    if pod.phase == "Running" and pod.ip:
        return PodHealth.READY, None
    return PodHealth.PENDING, None


def node_ready_status(body: Mapping[str, Any]) -> str:
    """The status of a node's Ready condition ("Unknown" when it has none)."""
    for cond in (body.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return str(cond.get("status", "Unknown"))
    return "Unknown"


# Taints the node lifecycle controller sets on NotReady nodes: those are failures (node_ready_status),
# not maintenance.
_NODE_HEALTH_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def node_draining(body: Mapping[str, Any]) -> bool:
    """Whether a node is being taken out of service: cordoned (``kubectl cordon``, the first thing
    ``kubectl drain`` does) or tainted NoExecute for maintenance. Its pods are moved off it at a
    step boundary instead of being lost to the eviction."""
    spec = body.get("spec") or {}
    if spec.get("unschedulable"):
        return True
    return any(
        t.get("effect") == "NoExecute" and t.get("key") not in _NODE_HEALTH_TAINTS for t in spec.get("taints") or []
    )
