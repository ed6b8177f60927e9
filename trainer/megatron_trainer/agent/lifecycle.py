"""Worker phases with checked transitions, and the pod's state derived from them.

A worker's phase changes on what the agent sees (Hello, Assign sent, WorkerStatus, Progress,
CollectiveFailed, exit); the transitions allowed are listed in one table so an impossible one is
an error instead of a silent state corruption (the pattern of nvidia-resiliency-ext's
``rank_monitor_state_machine.py``). The pod's :class:`AgentState` is never stored: it is computed
from its workers' phases, so the two cannot disagree.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from megatron_contract.agent import AgentState


class WorkerPhase(enum.StrEnum):
    """Where one worker process stands, as the agent sees it."""

    STARTING = "starting"  # spawned, no Hello yet (imports, model build, CUDA context)
    SPARE = "spare"  # Hello received; holds no process group
    RECONFIGURING = "reconfiguring"  # assigned or aborted: rendezvous, restore, or waiting for a plan
    TRAINING = "training"  # making steps in the held epoch
    SUCCEEDED = "succeeded"  # finished trainIters
    FAILED = "failed"  # said it failed, or exited or was killed unexpectedly


class LifecycleError(RuntimeError):
    """A transition the table does not allow."""


_ALLOWED: dict[WorkerPhase, frozenset[WorkerPhase]] = {
    WorkerPhase.STARTING: frozenset({WorkerPhase.SPARE, WorkerPhase.FAILED}),
    WorkerPhase.SPARE: frozenset(
        {WorkerPhase.SPARE, WorkerPhase.RECONFIGURING, WorkerPhase.TRAINING, WorkerPhase.FAILED}
    ),
    WorkerPhase.RECONFIGURING: frozenset(
        {
            WorkerPhase.SPARE,
            WorkerPhase.RECONFIGURING,
            WorkerPhase.TRAINING,
            WorkerPhase.SUCCEEDED,
            WorkerPhase.FAILED,
        }
    ),
    WorkerPhase.TRAINING: frozenset(
        {
            WorkerPhase.SPARE,
            WorkerPhase.RECONFIGURING,
            WorkerPhase.TRAINING,
            WorkerPhase.SUCCEEDED,
            WorkerPhase.FAILED,
        }
    ),
    WorkerPhase.SUCCEEDED: frozenset({WorkerPhase.SUCCEEDED, WorkerPhase.FAILED}),
    WorkerPhase.FAILED: frozenset({WorkerPhase.FAILED}),
}


def check_transition(current: WorkerPhase, new: WorkerPhase) -> WorkerPhase:
    """Return ``new`` if a worker may go from ``current`` to it.

    Raises:
        LifecycleError: when the table forbids the transition.
    """
    if new not in _ALLOWED[current]:
        raise LifecycleError(f"worker cannot go from {current.value} to {new.value}")
    return new


def pod_state(phases: Iterable[WorkerPhase]) -> AgentState:
    """The pod's state from its workers' phases.

    Failure dominates (one lost GPU fails the pod); then a pod is only as far along as its
    slowest worker; a pod whose workers are partly training and partly not is reconfiguring.
    """
    seen = list(phases)
    if not seen:
        return AgentState.STARTING
    if WorkerPhase.FAILED in seen:
        return AgentState.FAILED
    if all(p is WorkerPhase.SUCCEEDED for p in seen):
        return AgentState.SUCCEEDED
    if WorkerPhase.STARTING in seen:
        return AgentState.STARTING
    if all(p is WorkerPhase.SPARE for p in seen):
        return AgentState.SPARE
    if all(p in (WorkerPhase.TRAINING, WorkerPhase.SUCCEEDED) for p in seen):
        return AgentState.TRAINING
    return AgentState.RECONFIGURING
