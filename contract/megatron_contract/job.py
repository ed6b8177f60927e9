"""The ``MegatronJob`` custom resource: spec and status.

Cross-field rules are written once, in :data:`SPEC_RULES`, as a CEL expression (enforced by the
API server through the generated CRD) and the same check in Python (enforced when the operator
parses a job, so a job that slipped past an old CRD still fails with the same message).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from megatron_contract.base import WireModel
from megatron_contract.mesh import MeshPlan


def _immutable(name: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": f"spec.{name} is immutable"}]}


class ModelSpec(WireModel):
    """The GPT model Megatron-Core builds. Small defaults so a CPU demo runs in seconds."""

    num_layers: int = Field(default=2, ge=1, le=1024, description="Transformer layers.")
    hidden_size: int = Field(default=64, ge=8, le=65536, description="Hidden size.")
    num_attention_heads: int = Field(default=4, ge=1, le=1024, description="Attention heads.")
    ffn_hidden_size: int | None = Field(default=None, ge=1, description="MLP size; 4*hiddenSize when unset.")
    seq_length: int = Field(default=64, ge=8, le=1048576, description="Tokens per sample.")
    vocab_size: int = Field(default=1024, ge=16, le=1048576, description="Vocabulary size.")


class Precision(enum.StrEnum):
    """Parameter and compute precision on GPU; CPU runs always use fp32."""

    FP32 = "fp32"
    BF16 = "bf16"


class TrainingSpec(WireModel):
    """Optimizer and data settings passed to Megatron."""

    global_batch_size: int = Field(default=16, ge=1, description="Samples per step; fixed across shrink and grow.")
    micro_batch_size: int = Field(default=1, ge=1, description="Samples per micro-batch.")
    train_iters: int = Field(default=100, ge=1, description="Steps to train; the job succeeds after the last.")
    lr: float = Field(default=1e-4, gt=0, le=10, description="Adam learning rate.")
    seed: int = Field(default=1234, ge=0, description="Seed of initialization and data order.")
    data_path: str | None = Field(
        default=None, description="Prefix of a Megatron indexed dataset; deterministic mock tokens when unset."
    )
    precision: Precision = Field(default=Precision.BF16, description="Precision on GPU (CPU always uses fp32).")


class CheckpointSpec(WireModel):
    """Periodic distributed checkpoints, the fallback when no peer holds a rank's state."""

    path: str = Field(min_length=1, description="Directory (a mounted PVC or bucket path) for checkpoints.")
    interval_steps: int = Field(default=100, ge=1, description="Save every this many steps.")
    volume_claim_name: str | None = Field(default=None, description="PVC mounted at path in every pod.")
    keep: int = Field(
        default=2,
        ge=1,
        description="Complete checkpoints kept; older ones are deleted once a newer one is complete.",
    )
    async_save: bool = Field(
        default=True,
        description="Write in the background after the device-to-host copy (false: the step waits for the write).",
    )


class FailureDetectionSpec(WireModel):
    """Deadlines of failure detection."""

    heartbeat_interval_seconds: float = Field(default=2.0, gt=0, le=300, description="Agent heartbeat period.")
    heartbeat_timeout_seconds: float = Field(
        default=10.0, gt=0, le=3600, description="A pod whose heartbeats stop this long is failed."
    )
    collective_timeout_seconds: float = Field(
        default=30.0, gt=0, le=3600, description="A worker aborts a collective stuck this long and reports its peer."
    )

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.heartbeatTimeoutSeconds > self.heartbeatIntervalSeconds",
                    "message": "spec.failureDetection.heartbeatTimeoutSeconds must exceed heartbeatIntervalSeconds",
                }
            ]
        }
    )

    @model_validator(mode="after")
    def _timeout_exceeds_interval(self) -> FailureDetectionSpec:
        if self.heartbeat_timeout_seconds <= self.heartbeat_interval_seconds:
            raise ValueError("spec.failureDetection.heartbeatTimeoutSeconds must exceed heartbeatIntervalSeconds")
        return self


class EnvVar(WireModel):
    """An environment variable for the trainer container."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    value: str = ""


class Toleration(WireModel):
    """A toleration of trainer pods (GPU nodes are often tainted), as in core/v1."""

    key: str | None = Field(default=None, description="Taint key; empty with operator Exists matches all.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, description="Taint value, for operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; all when unset."
    )
    toleration_seconds: int | None = Field(default=None, ge=0, description="For NoExecute: how long to stay.")


#: A non-negative Kubernetes quantity ("500m", "16Gi", "1.5", "2e3"): the API server checks it
#: when the job is created, not when the operator's pod create is refused half an hour later.
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
Quantity = Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=QUANTITY_PATTERN)]
GPU_RESOURCE = "nvidia.com/gpu"


class Resources(WireModel):
    """Container resources per pod; ``nvidia.com/gpu`` is set from gpusPerPod (given here, it must match)."""

    requests: dict[str, Quantity] = Field(default_factory=dict, description="Resource requests (cpu, memory, ...).")
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Resource limits.")


@dataclasses.dataclass(frozen=True)
class SpecRule:
    """A cross-field rule of the spec, in CEL for the API server and in Python for the operator."""

    cel: str
    message: str
    check: Callable[[MegatronJobSpec], bool]


def _model_parallel(s: MegatronJobSpec) -> int:
    return s.tp * s.pp * s.cp


def _gpu_rule(field: Literal["requests", "limits"]) -> SpecRule:
    """GPUs in ``resources.<field>``, when given, must be gpusPerPod: the pods get exactly that many."""
    return SpecRule(
        f"!has(self.resources) || !has(self.resources.{field}) || !('{GPU_RESOURCE}' in self.resources.{field}) || "
        f"string(self.resources.{field}['{GPU_RESOURCE}']) == string(self.gpusPerPod)",
        f"spec.resources.{field}[{GPU_RESOURCE}] must equal spec.gpusPerPod (or be left out: it is set from it)",
        lambda s: str(getattr(s.resources, field).get(GPU_RESOURCE, s.gpus_per_pod)) == str(s.gpus_per_pod),
    )


SPEC_RULES: tuple[SpecRule, ...] = (
    SpecRule(
        "self.minReplicas <= self.replicas",
        "spec.minReplicas must not exceed spec.replicas",
        lambda s: s.min_replicas <= s.replicas,
    ),
    SpecRule(
        "self.gpusPerPod % self.tp == 0",
        "spec.gpusPerPod must be a multiple of spec.tp: a tensor-parallel group never spans pods",
        lambda s: s.gpus_per_pod % s.tp == 0,
    ),
    SpecRule(
        "(self.tp * self.pp * self.cp) % self.gpusPerPod == 0 || self.gpusPerPod % (self.tp * self.pp * self.cp) == 0",
        "spec.gpusPerPod must divide tp*pp*cp or be a multiple of it, "
        "so that pods hold whole replicas or whole slices of one",
        lambda s: _model_parallel(s) % s.gpus_per_pod == 0 or s.gpus_per_pod % _model_parallel(s) == 0,
    ),
    SpecRule(
        "self.gpusPerPod <= (self.tp * self.pp * self.cp) || ("
        "self.replicas % (self.gpusPerPod / (self.tp * self.pp * self.cp)) == 0 && "
        "self.minReplicas % (self.gpusPerPod / (self.tp * self.pp * self.cp)) == 0)",
        "spec.replicas and spec.minReplicas must be multiples of the replicas one pod holds (gpusPerPod / (tp*pp*cp))",
        lambda s: (
            s.gpus_per_pod <= _model_parallel(s)
            or (
                s.replicas % (s.gpus_per_pod // _model_parallel(s)) == 0
                and s.min_replicas % (s.gpus_per_pod // _model_parallel(s)) == 0
            )
        ),
    ),
    SpecRule(
        "self.model.numAttentionHeads % self.tp == 0",
        "spec.model.numAttentionHeads must be a multiple of spec.tp",
        lambda s: s.model.num_attention_heads % s.tp == 0,
    ),
    SpecRule(
        "self.model.hiddenSize % self.model.numAttentionHeads == 0",
        "spec.model.hiddenSize must be a multiple of spec.model.numAttentionHeads",
        lambda s: s.model.hidden_size % s.model.num_attention_heads == 0,
    ),
    SpecRule(
        "self.model.numLayers % self.pp == 0",
        "spec.model.numLayers must be a multiple of spec.pp",
        lambda s: s.model.num_layers % s.pp == 0,
    ),
    SpecRule(
        "self.training.globalBatchSize % self.training.microBatchSize == 0",
        "spec.training.globalBatchSize must be a multiple of spec.training.microBatchSize",
        lambda s: s.training.global_batch_size % s.training.micro_batch_size == 0,
    ),
    SpecRule(
        "self.training.globalBatchSize / self.training.microBatchSize >= self.replicas",
        "spec.training.globalBatchSize / microBatchSize must be at least spec.replicas (a micro-batch per replica)",
        lambda s: s.training.global_batch_size // s.training.micro_batch_size >= s.replicas,
    ),
    _gpu_rule("requests"),
    _gpu_rule("limits"),
)

#: The job's name labels every child (a label value: at most 63 characters) and names its headless
#: Service (a DNS-1035 label): a name that cannot do both is refused when the job is created.
NAME_MAX = 63
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_RULE = {
    "rule": f"self.metadata.name.size() <= {NAME_MAX} && self.metadata.name.matches('{NAME_PATTERN}')",
    "message": f"metadata.name must be a DNS-1035 label of at most {NAME_MAX} characters (lower-case letters, "
    "digits and '-', starting with a letter): it labels the job's pods and names its Service",
}


class MegatronJobSpec(WireModel):
    """What the user asks for: a Megatron-Core training job with an elastic data-parallel range."""

    image: str = Field(min_length=1, description="Trainer image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Image pull policy of trainer pods."
    )
    command: list[str] | None = Field(default=None, description="Container command; the image's entrypoint when unset.")
    args: list[str] = Field(default_factory=list, description="Extra arguments for the trainer.")
    env: list[EnvVar] = Field(default_factory=list, max_length=256, description="Extra environment variables.")
    model: ModelSpec = Field(default_factory=ModelSpec, description="The GPT model.")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="Optimizer, batch and data.")
    tp: int = Field(default=1, ge=1, le=64, description="Tensor-parallel size.", json_schema_extra=_immutable("tp"))
    pp: int = Field(default=1, ge=1, le=256, description="Pipeline-parallel size.", json_schema_extra=_immutable("pp"))
    cp: int = Field(default=1, ge=1, le=64, description="Context-parallel size.", json_schema_extra=_immutable("cp"))
    gpus_per_pod: int = Field(
        default=1, ge=1, le=16, description="GPUs (ranks) per pod.", json_schema_extra=_immutable("gpusPerPod")
    )
    replicas: int = Field(
        ge=1, le=65536, description="Desired data-parallel size; lowering it on a running job resizes the mesh."
    )
    min_replicas: int = Field(
        default=1, ge=1, le=65536, description="Smallest data-parallel size the job may shrink to."
    )
    spares: int = Field(default=0, ge=0, le=4096, description="Hot-spare pods kept warm to replace failed ones.")
    resources: Resources = Field(default_factory=Resources, description="Per-pod resources besides GPUs.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node selector of trainer pods.")
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=64, description="Tolerations of trainer pods."
    )
    checkpoint: CheckpointSpec | None = Field(default=None, description="Distributed checkpoints.")
    max_recoveries: int = Field(
        default=100, ge=0, le=100000, description="Recoveries after which the job fails instead of recovering again."
    )
    failure_detection: FailureDetectionSpec = Field(
        default_factory=FailureDetectionSpec, description="Failure-detection deadlines."
    )

    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": [{"rule": r.cel, "message": r.message} for r in SPEC_RULES]}
    )

    @model_validator(mode="after")
    def _cross_field_rules(self) -> MegatronJobSpec:
        broken = [r.message for r in SPEC_RULES if not r.check(self)]
        if broken:
            raise ValueError("; ".join(broken))
        return self

    @property
    def model_parallel(self) -> int:
        """Ranks per data-parallel replica: tp*pp*cp."""
        return self.tp * self.pp * self.cp

    @property
    def pods_per_replica(self) -> int:
        """Pods one replica spans (1 when a pod holds one or more whole replicas)."""
        return max(1, self.model_parallel // self.gpus_per_pod)

    @property
    def replicas_per_pod(self) -> int:
        """Replicas one pod holds (1 when a replica spans one or more pods)."""
        return max(1, self.gpus_per_pod // self.model_parallel)

    @property
    def worker_pods(self) -> int:
        """Worker pods at full size (``replicas`` data-parallel replicas)."""
        return self.replicas * self.model_parallel // self.gpus_per_pod


class JobPhase(enum.StrEnum):
    """Coarse state of a job, for ``kubectl get``."""

    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    RECOVERING = "Recovering"
    DEGRADED = "Degraded"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ConditionType(enum.StrEnum):
    """Condition types of a job's status."""

    READY = "Ready"
    RECOVERING = "Recovering"
    DEGRADED = "Degraded"
    SPARES_EXHAUSTED = "SparesExhausted"
    FAILED = "Failed"
    SUCCEEDED = "Succeeded"
    #: True while a child (pod, Service, token Secret) cannot be created, or the pods created keep
    #: failing at start; its reason and message say which and why.
    CREATE_FAILED = "CreateFailed"


class Condition(WireModel):
    """A condition in the shape of metav1.Condition."""

    type: str = Field(min_length=1, max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = Field(default="", max_length=32768)
    last_transition_time: datetime
    observed_generation: int | None = Field(default=None, ge=0)


class FailureRecord(WireModel):
    """The most recent failure the operator acted on."""

    pod: str
    reason: str
    message: str = ""
    time: datetime


class MegatronJobStatus(WireModel):
    """What the operator observed and decided; written whole, once per change."""

    phase: JobPhase = Field(default=JobPhase.PENDING, description="Coarse state of the job.")
    conditions: list[Condition] = Field(default_factory=list, description="Ready, Recovering, Degraded, ...")
    observed_generation: int | None = Field(default=None, ge=0)
    mesh: str | None = Field(default=None, description="Current mesh as dp x tp x pp (x cp).")
    epoch: int = Field(default=0, ge=0, description="Epoch of the current plan.")
    plan: MeshPlan | None = Field(default=None, description="The current mesh plan.")
    desired_workers: int = Field(default=0, ge=0, description="Worker pods in the current plan.")
    ready_workers: int = Field(default=0, ge=0, description="Worker pods running and reporting.")
    ready: str | None = Field(default=None, description="readyWorkers/desiredWorkers, for kubectl get.")
    spares_ready: int = Field(default=0, ge=0, description="Hot spares running and warm.")
    recoveries: int = Field(
        default=0,
        ge=0,
        description=(
            "Recoveries started because pods were lost (replace or shrink), counted once per incident: further"
            " plans made before the first one's training resumed belong to the same recovery. Growing and"
            " resizing are not recoveries."
        ),
    )
    committed_epoch: int = Field(
        default=0,
        ge=0,
        description=(
            "Newest epoch in which every member committed a training step. Until it equals epoch, the plan in"
            " force is not training yet (the job is Starting or Recovering, not Ready)."
        ),
    )
    last_recovery_duration_seconds: float | None = Field(
        default=None,
        ge=0,
        description="Failure detected to the first training step committed by every member, for the last recovery.",
    )
    last_failure: FailureRecord | None = None
    step: int | None = Field(default=None, ge=0, description="Steps completed, as reported by the trainers.")
    checkpoint_step: int | None = Field(
        default=None,
        ge=0,
        description="Newest complete distributed checkpoint: the fallback when no peer holds a shard.",
    )
    start_time: datetime | None = None
    completion_time: datetime | None = None


class MegatronJob(WireModel):
    """A whole MegatronJob object as read from the API server."""

    api_version: Literal["megatron.dev/v1alpha1"] = "megatron.dev/v1alpha1"
    kind: Literal["MegatronJob"] = "MegatronJob"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: MegatronJobSpec
    status: MegatronJobStatus | None = None

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="after")
    def _name_rule(self) -> MegatronJob:
        name = self.metadata.get("name")
        if name is not None and not (len(name) <= NAME_MAX and re.fullmatch(NAME_PATTERN, name)):
            raise ValueError(NAME_RULE["message"])
        return self
