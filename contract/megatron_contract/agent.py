"""What a trainer pod's agent tells the operator: heartbeats and failed peers."""

from __future__ import annotations

import enum
from datetime import datetime

from pydantic import Field

from megatron_contract.base import OpenWireModel


class AgentState(enum.StrEnum):
    """Lifecycle of a pod's agent as seen from outside."""

    STARTING = "starting"  # importing, building the model
    SPARE = "spare"  # warm and waiting for a plan that names it
    TRAINING = "training"
    RECONFIGURING = "reconfiguring"  # between plans: abort, rendezvous, restore
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class WorkerState(OpenWireModel):
    """One worker process (one GPU) of a pod."""

    local_rank: int = Field(ge=0)
    pid: int | None = None
    rank: int | None = Field(default=None, ge=0, description="Global rank in the current epoch.")
    alive: bool = True
    step: int | None = Field(default=None, ge=0)


class PeerFailure(OpenWireModel):
    """A survivor's word that a collective with a peer failed or hung."""

    epoch: int = Field(ge=0)
    rank: int | None = Field(default=None, ge=0, description="The peer's global rank, when known.")
    pod: str | None = Field(default=None, description="The peer's pod, when known.")
    reason: str = Field(max_length=1024)
    detected_at: datetime | None = None


class AgentReport(OpenWireModel):
    """A heartbeat: the agent's epoch, step and health, plus any failed peers it saw."""

    job_uid: str = Field(min_length=1)
    pod: str = Field(min_length=1)
    epoch: int = Field(ge=0, description="Epoch of the plan the agent holds (0: none yet).")
    state: AgentState
    healthy: bool = True
    step: int | None = Field(
        default=None, ge=0, description="Steps completed so far, i.e. the index of the next step to run."
    )
    consumed_samples: int | None = Field(default=None, ge=0)
    loss: float | None = None
    step_time_seconds: float | None = Field(default=None, ge=0)
    tokens_per_second: float | None = Field(default=None, ge=0)
    workers: list[WorkerState] = Field(default_factory=list, max_length=64)
    failed_peers: list[PeerFailure] = Field(default_factory=list, max_length=64)
    checkpoint_step: int | None = Field(
        default=None, ge=0, description="Step of the newest complete distributed checkpoint this pod's workers saved."
    )
    checkpoint_blocking_seconds: float | None = Field(
        default=None,
        ge=0,
        description="Total time this pod's training was blocked starting checkpoint saves (the slowest local worker"
        " per save), since the agent started.",
    )
    checkpoint_rejected: str | None = Field(
        default=None,
        max_length=1024,
        description="Why a worker's last restore rejected a checkpoint (failed verification); the worker then tried the"
        " next older one, and stopped after two.",
    )
    checkpoint_unusable: str | None = Field(
        default=None,
        max_length=1024,
        description="Set when a worker's restore gave up: two checkpoints failed verification. Restoring again would"
        " loop; the job needs a person (or an older checkpoint).",
    )
    suspend_step: int | None = Field(
        default=None,
        ge=0,
        description="The held plan is a suspend plan and the checkpoint it asked for is complete and verified: its"
        " step.",
    )
    suspend_error: str | None = Field(
        default=None,
        max_length=1024,
        description="The held plan is a suspend plan and its checkpoint could not be written: why.",
    )
    sent_at: datetime | None = None
