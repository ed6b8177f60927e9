"""The worker's lifecycle as an enum with checked transitions (a bad transition is a bug)."""

from __future__ import annotations

import enum


class WorkerState(enum.StrEnum):
    """States of a worker process. The values match ``channel.WorkerStatus.state`` where shared."""

    STARTING = "starting"  # importing, building the warm model
    SPARE = "spare"  # warm, holds no communicator, waits for a plan that names its pod
    RECONFIGURING = "reconfiguring"  # aborting, rendezvous, restore, verify
    TRAINING = "training"
    WAITING = "waiting"  # a collective failed; groups aborted; waits for the next plan
    SUCCEEDED = "succeeded"
    FAILED = "failed"


_ALLOWED: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.STARTING: frozenset({WorkerState.SPARE, WorkerState.FAILED}),
    WorkerState.SPARE: frozenset({WorkerState.RECONFIGURING, WorkerState.SPARE, WorkerState.FAILED}),
    # RECONFIGURING -> RECONFIGURING: a newer plan overtook a join in progress.
    WorkerState.RECONFIGURING: frozenset(
        {
            WorkerState.RECONFIGURING,
            WorkerState.TRAINING,
            WorkerState.SPARE,
            WorkerState.WAITING,
            WorkerState.SUCCEEDED,
            WorkerState.FAILED,
        }
    ),
    WorkerState.TRAINING: frozenset(
        {WorkerState.RECONFIGURING, WorkerState.WAITING, WorkerState.SUCCEEDED, WorkerState.FAILED}
    ),
    WorkerState.WAITING: frozenset({WorkerState.RECONFIGURING, WorkerState.SPARE, WorkerState.FAILED}),
    WorkerState.SUCCEEDED: frozenset({WorkerState.RECONFIGURING, WorkerState.SUCCEEDED}),
    WorkerState.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A transition the lifecycle does not allow."""


def check_transition(current: WorkerState, target: WorkerState) -> WorkerState:
    """Return ``target`` when ``current -> target`` is allowed, else raise :class:`IllegalTransition`."""
    if target not in _ALLOWED[current]:
        raise IllegalTransition(f"worker cannot go from {current.value} to {target.value}")
    return target
