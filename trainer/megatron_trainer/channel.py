"""The agent <-> worker channel: one socketpair per worker, newline-delimited JSON messages.

Each worker has its own channel (a worker killed mid-write must not jam the others, as it
does a shared queue); EOF on the agent's end means the worker died. The agent passes the worker's end
with ``subprocess.Popen(pass_fds=...)`` and ``--channel-fd N``. torch-free: the agent imports it.
"""

from __future__ import annotations

import itertools
import json
import socket
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter, field_validator

from megatron_contract.base import WireModel
from megatron_contract.mesh import MeshPlan

# -- agent -> worker ---------------------------------------------------------------------------


class Assign(WireModel):
    """A new plan. The worker finds its rank as ``plan.member(pod).ranks[local_rank]``; a worker
    whose pod is not a member releases every process group and waits as a spare."""

    type: Literal["assign"] = "assign"
    plan: MeshPlan
    pod: str


class Shutdown(WireModel):
    """Finish cleanly (job done or pod deleted)."""

    type: Literal["shutdown"] = "shutdown"
    reason: str = ""


# -- worker -> agent ---------------------------------------------------------------------------


class Hello(WireModel):
    """Imports done, model built (and CUDA context created on GPU): ready to be assigned."""

    type: Literal["hello"] = "hello"
    local_rank: int
    pid: int


WireWorkerState = Literal["spare", "training", "reconfiguring", "succeeded", "failed"]


class WorkerStatus(WireModel):
    """Lifecycle change: spare, training, reconfiguring, succeeded, failed."""

    type: Literal["status"] = "status"
    state: WireWorkerState
    epoch: int = 0
    detail: str = ""


class Progress(WireModel):
    """Sent after every completed step; also the worker's liveness signal."""

    type: Literal["progress"] = "progress"
    epoch: int
    step: int  # steps completed so far
    consumed_samples: int
    loss: float
    step_time_seconds: float
    tokens_per_second: float


class CheckpointSaved(WireModel):
    """A distributed checkpoint of ``step`` is complete: every rank's files written, the manifest
    written and the directory renamed into place (sent by every rank once rank 0 has done so)."""

    type: Literal["checkpoint"] = "checkpoint"
    epoch: int
    step: int
    blocking_seconds: float | None = None  # training-thread time of the step that started the save
    total_seconds: float | None = None  # from the start of the save to complete
    start_phases: dict[str, float] | None = None  # the starting step's share: plan, host_copy (copy + fork)


class CheckpointProblem(WireModel):
    """A checkpoint that was not taken or not used: ``skipped`` (a save was due while the previous
    one was still being written), ``failed`` (a save that could not be completed) or ``rejected``
    (a checkpoint that failed verification on restore; the next older one is tried) or
    ``unusable`` (the restore gave up after two rejections: the worker fails next; restoring again
    would loop)."""

    type: Literal["checkpoint_problem"] = "checkpoint_problem"
    epoch: int
    step: int
    kind: Literal["skipped", "failed", "rejected", "unusable"]
    detail: str = ""


class ReplicaSteps(WireModel):
    """With buddy copies of the distributed optimizer's shards: the steps of which this worker holds
    complete host copies in ``epoch`` (its own snapshot and the one it keeps for its ward), newest
    first; sent whenever a refresh finishes or starts (a start may drop the oldest copy)."""

    type: Literal["replica_steps"] = "replica_steps"
    epoch: int = Field(ge=1)
    steps: list[Annotated[int, Field(ge=0)]] = Field(max_length=4)

    @field_validator("steps")
    @classmethod
    def _newest_first(cls, steps: list[int]) -> list[int]:
        if any(a <= b for a, b in itertools.pairwise(steps)):
            raise ValueError(f"steps must be distinct and newest first, got {steps}")
        return steps


class CopyInterval(WireModel):
    """With a cost budget for the buddy copies (``replicaCostPercent``): the refresh interval every
    rank of ``epoch`` agreed on, and what this worker measured calibrating it (worker/copy_schedule.py)."""

    type: Literal["copy_interval"] = "copy_interval"
    epoch: int = Field(ge=1)
    interval: int = Field(ge=1, description="Steps between refreshes, from step from_step on.")
    from_step: int = Field(ge=0)
    proposed: int = Field(ge=1, description="The interval this worker needed (all adopt the largest).")
    refresh_cost_seconds: float = Field(ge=0, description="What a refresh cost the steps beside it.")
    clear_step_seconds: float = Field(ge=0, description="The median step clear of any refresh.")

    @property
    def cost_ratio(self) -> float:
        """The share of step time the refreshes cost at the agreed interval, by these measurements."""
        step = self.interval * self.clear_step_seconds
        return self.refresh_cost_seconds / step if step > 0 else 0.0


class PhaseTimes(WireModel):
    """Durations of one reconfiguration, in seconds (detect, abort, rendezvous, restore, first_step)."""

    type: Literal["phases"] = "phases"
    epoch: int
    phases: dict[str, float]


class Alive(WireModel):
    """Sent by a training worker's watchdog thread several times a second: the process runs (a
    stopped one sends nothing), what its main thread is doing (None: between steps), and how long
    its step may stall before its own watchdog calls it a hang (None while the collective timeout
    applies, or while an aborted step unwinds)."""

    type: Literal["alive"] = "alive"
    epoch: int
    phase: Literal["step", "data", "checkpoint"] | None = None
    step_limit_seconds: float | None = None


class CollectiveFailed(WireModel):
    """A collective with a peer failed or hung; the agent forwards it to the operator."""

    type: Literal["collective_failed"] = "collective_failed"
    epoch: int
    peer_rank: int | None = None
    peer_pod: str | None = None  # when the suspect is a pod rather than a rank (the rendezvous store host)
    reason: str


ToWorker = Annotated[Assign | Shutdown, Field(discriminator="type")]
ToAgent = Annotated[
    Hello
    | WorkerStatus
    | Progress
    | CheckpointSaved
    | CheckpointProblem
    | PhaseTimes
    | CollectiveFailed
    | Alive
    | ReplicaSteps
    | CopyInterval,
    Field(discriminator="type"),
]
_TO_WORKER: TypeAdapter[ToWorker] = TypeAdapter(ToWorker)
_TO_AGENT: TypeAdapter[ToAgent] = TypeAdapter(ToAgent)


class Channel:
    """One end of a socketpair carrying JSON lines. Not thread-safe for concurrent senders."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._reader = sock.makefile("r", encoding="utf-8")

    @classmethod
    def from_fd(cls, fd: int) -> Channel:
        return cls(socket.socket(fileno=fd))

    def send(self, message: WireModel) -> None:
        self.sock.sendall((json.dumps(message.to_wire()) + "\n").encode())

    def _line(self) -> str | None:
        line = self._reader.readline()
        return line or None  # '' is EOF: the other end is gone

    def recv_to_worker(self) -> ToWorker | None:
        """Next message for a worker, or None at EOF (the agent died)."""
        line = self._line()
        return None if line is None else _TO_WORKER.validate_json(line)

    def recv_to_agent(self) -> ToAgent | None:
        """Next message from a worker, or None at EOF (the worker died)."""
        line = self._line()
        return None if line is None else _TO_AGENT.validate_json(line)

    def close(self) -> None:
        self._reader.close()
        self.sock.close()
