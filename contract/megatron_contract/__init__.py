"""The contract between operator and trainer: pydantic models only, no torch, no Kubernetes client.

- :mod:`.job`: the ``MegatronJob`` custom resource (spec and status).
- :mod:`.mesh`: ``MeshPlan``, the versioned document that says who trains as what.
- :mod:`.agent`: what a trainer pod's agent reports to the operator.
- :mod:`.wire`: names both sides must agree on (API group, ports, paths, env variables).
- :mod:`.crd`: the CRD generated from :mod:`.job`.
"""

from megatron_contract.agent import AgentReport, AgentState, PeerFailure, WorkerState
from megatron_contract.job import (
    CheckpointSpec,
    Condition,
    ConditionType,
    FailureDetectionSpec,
    JobPhase,
    MegatronJob,
    MegatronJobSpec,
    MegatronJobStatus,
    ModelSpec,
    TrainingSpec,
)
from megatron_contract.mesh import (
    BatchGeometry,
    MeshCoords,
    MeshError,
    MeshPlan,
    MeshSizes,
    PlanMember,
    PlanReason,
    Rendezvous,
    StateSource,
    StateSourceKind,
)

__all__ = [
    "AgentReport",
    "AgentState",
    "BatchGeometry",
    "CheckpointSpec",
    "Condition",
    "ConditionType",
    "FailureDetectionSpec",
    "JobPhase",
    "MegatronJob",
    "MegatronJobSpec",
    "MegatronJobStatus",
    "MeshCoords",
    "MeshError",
    "MeshPlan",
    "MeshSizes",
    "ModelSpec",
    "PeerFailure",
    "PlanMember",
    "PlanReason",
    "Rendezvous",
    "StateSource",
    "StateSourceKind",
    "TrainingSpec",
    "WorkerState",
]
