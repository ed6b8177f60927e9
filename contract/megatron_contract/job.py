"""The ``MegatronJob`` custom resource: spec and status.

Cross-field rules are written once, in :data:`SPEC_RULES`, as a CEL expression (enforced by the
API server through the generated CRD) and the same check in Python (enforced when the operator
parses a job, so a job that slipped past an old CRD still fails with the same message).
"""

from __future__ import annotations

import enum
import re
from datetime import datetime
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel, to_snake

from megatron_contract.base import OpenWireModel, WireModel
from megatron_contract.mesh import MeshPlan
from megatron_contract.pod_template import GPU_RESOURCE, QUANTITY_PATTERN, TEMPLATE_RULES, PodTemplate, Quantity
from megatron_contract.presets import PRESETS, ModelPreset
from megatron_contract.rules import SpecRule


def _immutable(name: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": f"spec.{name} is immutable"}]}


class Activation(enum.StrEnum):
    """MLP activation: GeLU, or SwiGLU (SiLU with a gated linear unit, as Llama and Qwen)."""

    GELU = "gelu"
    SWIGLU = "swiglu"


class Normalization(enum.StrEnum):
    """Normalization layers, as Megatron-Core names them."""

    LAYER_NORM = "LayerNorm"
    RMS_NORM = "RMSNorm"


class MoeTokenDispatcher(enum.StrEnum):
    """How megatron-core's MoE layers move tokens to the expert-parallel ranks holding their experts."""

    ALLTOALL = "alltoall"
    ALLGATHER = "allgather"


class PositionEmbedding(enum.StrEnum):
    """Position embedding: learned absolute, or rotary (RoPE)."""

    LEARNED = "learned"
    ROPE = "rope"


_IMPORT_REFERENCE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


class ModelSpec(WireModel):
    """The decoder-only model Megatron-Core builds (names follow ``TransformerConfig``).

    ``preset`` names a known architecture (:mod:`megatron_contract.presets`); fields given next to
    it override it. ``modelProvider``/``forwardStep`` bring a model of one's own (any Megatron-Core
    module, in Megatron-LM's plug-in shape); the fields here still give its TransformerConfig.
    Without a preset, unset fields take small defaults so a CPU demo runs in seconds. The generated
    CRD carries no defaults for these fields (they would override the preset); its rules resolve
    preset and defaults themselves (:func:`model_field_cel`).
    """

    preset: ModelPreset | None = Field(default=None, description="A known architecture; given fields override it.")
    num_layers: int = Field(default=2, ge=1, le=1024, description="Transformer layers.")
    hidden_size: int = Field(default=64, ge=8, le=65536, description="Hidden size.")
    num_attention_heads: int = Field(default=4, ge=1, le=1024, description="Attention heads.")
    num_query_groups: int | None = Field(
        default=None, ge=1, le=1024, description="Key/value heads (GQA; 1 is MQA); numAttentionHeads when unset."
    )
    kv_channels: int | None = Field(
        default=None, ge=1, le=65536, description="Size of one attention head; hiddenSize/numAttentionHeads when unset."
    )
    ffn_hidden_size: int | None = Field(
        default=None, ge=1, le=1048576, description="MLP size; 4*hiddenSize when unset."
    )
    seq_length: int = Field(default=64, ge=8, le=1048576, description="Tokens per sample.")
    max_position_embeddings: int | None = Field(
        default=None, ge=8, le=4194304, description="Longest sequence the positions cover; seqLength when unset."
    )
    vocab_size: int = Field(default=1024, ge=16, le=1048576, description="Vocabulary size (already padded).")
    activation: Activation = Field(default=Activation.GELU, description="MLP activation: gelu or swiglu.")
    normalization: Normalization = Field(default=Normalization.LAYER_NORM, description="LayerNorm or RMSNorm.")
    layernorm_epsilon: float = Field(default=1e-5, gt=0, le=1, description="Epsilon of the normalization layers.")
    position_embedding: PositionEmbedding = Field(
        default=PositionEmbedding.LEARNED, description="learned (absolute) or rope."
    )
    rotary_base: int = Field(default=10000, ge=1, description="RoPE base (theta).")
    rotary_percent: float = Field(default=1.0, gt=0, le=1, description="Fraction of each head's dimensions rotated.")
    untie_embeddings_and_output_weights: bool = Field(
        default=False, description="Separate output layer instead of the input embedding's transpose."
    )
    add_bias_linear: bool = Field(default=True, description="Biases in the linear layers.")
    add_qkv_bias: bool = Field(default=False, description="Biases in the query/key/value projection only (Qwen).")
    qk_layernorm: bool = Field(default=False, description="Normalize queries and keys.")
    init_method_std: float = Field(default=0.02, gt=0, le=10, description="Std of the normal weight initialization.")
    hidden_dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout after attention and MLP.")
    attention_dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout of attention probabilities.")
    sequence_parallel: bool = Field(
        default=False, description="Megatron's sequence parallelism (splits norms and dropout over tp); needs tp > 1."
    )
    model_provider: str | None = Field(
        default=None,
        pattern=_IMPORT_REFERENCE,
        description="package.module:function in the trainer image, Megatron-LM's "
        "model_provider(pre_process, post_process, *, config, spec) returning a Megatron-Core module; "
        "the GPT of these fields when unset.",
    )
    forward_step: str | None = Field(
        default=None,
        pattern=_IMPORT_REFERENCE,
        description="package.module:function in the trainer image, Megatron-LM's forward_step(data_iterator, model) "
        "returning the output and a loss function; the GPT's when unset.",
    )
    num_experts: int | None = Field(
        default=None, ge=2, le=4096, description="Mixture of experts: experts per MoE layer; a dense MLP when unset."
    )
    moe_router_topk: int = Field(default=2, ge=1, le=64, description="Experts each token is routed to.")
    moe_ffn_hidden_size: int | None = Field(
        default=None, ge=1, le=1048576, description="Hidden size of one expert; ffnHiddenSize when unset."
    )
    moe_aux_loss_coeff: float = Field(
        default=0.0, ge=0, le=10, description="Weight of the router's load-balancing loss (0: none)."
    )
    moe_token_dispatcher_type: MoeTokenDispatcher = Field(
        default=MoeTokenDispatcher.ALLTOALL,
        description="How tokens reach the ranks of their experts: alltoall or allgather.",
    )

    model_config = ConfigDict(json_schema_extra=lambda schema: _drop_property_defaults(schema))

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("preset") is None:
            return data
        try:
            preset = ModelPreset(data["preset"])
        except ValueError:
            return data  # the field's own validation names the bad value
        given = {to_camel(k): v for k, v in data.items()}
        return {**PRESETS[preset], **given}

    @property
    def query_groups(self) -> int:
        """Key/value heads in effect."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """MLP hidden size in effect."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        """Positions in effect."""
        return self.max_position_embeddings or self.seq_length


def _drop_property_defaults(schema: dict[str, Any]) -> None:
    for prop in schema.get("properties", {}).values():
        prop.pop("default", None)


def model_field_cel(name: str) -> str:
    """CEL for the value of ``spec.model.<name>`` in effect: the field, else the preset's, else the default."""
    field = ModelSpec.model_fields[to_snake(name)]
    default: Any = field.default
    if name == "numQueryGroups":
        default = model_field_cel("numAttentionHeads")
    elif name == "ffnHiddenSize":
        default = f"4 * {model_field_cel('hiddenSize')}"
    elif name == "maxPositionEmbeddings":
        default = model_field_cel("seqLength")
    elif default is None:
        raise ValueError(f"spec.model.{name} has no default that CEL can express")
    default_cel = _cel_literal(default) if isinstance(default, bool) else str(default)
    table = ", ".join(f"'{p.value}': {_cel_literal(v[name])}" for p, v in PRESETS.items())
    return (
        f"(has(self.model.{name}) ? self.model.{name} : "
        f"(has(self.model.preset) ? {{{table}}}[self.model.preset] : {default_cel}))"
    )


def _cel_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if not isinstance(value, str) else f"'{value}'"


class Precision(enum.StrEnum):
    """Parameter and compute precision on GPU; CPU runs always use fp32. fp8 needs Transformer Engine."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP8 = "fp8"


class OptimizerSpec(WireModel):
    """Megatron's Adam (``OptimizerConfig``)."""

    adam_beta1: float = Field(default=0.9, ge=0, lt=1, description="Adam beta1.")
    adam_beta2: float = Field(default=0.999, ge=0, lt=1, description="Adam beta2.")
    adam_eps: float = Field(default=1e-8, gt=0, le=1, description="Adam epsilon.")
    weight_decay: float = Field(default=0.0, ge=0, le=10, description="Decoupled weight decay (AdamW).")
    clip_grad: float = Field(default=1.0, ge=0, description="Gradient clipping by global norm; 0 turns it off.")
    distributed: bool = Field(
        default=False,
        description="Megatron's distributed optimizer (ZeRO-1: optimizer state sharded over data-parallel ranks); "
        "a lost or moved shard is restored in memory from its buddy copy and the survivors (dense models without "
        "context parallelism), else from the distributed checkpoint, which it needs (spec.checkpoint). Its buddy "
        "copies take host memory (see replicaIntervalSteps).",
    )
    replica_interval_steps: int = Field(
        default=1,
        ge=1,
        le=1_000_000,
        description="With distributed: steps between refreshes of the host copy of each rank's optimizer shard, kept "
        "by a rank on another pod (its buddy). 1 loses no completed step when a pod is lost; N redoes up to N-1 steps "
        "for N times less copying. A refresh runs beside the next step (on GPU over NCCL) and slows it by a near-fixed "
        "time: 22-38 ms for a 1.1 B GPT at dp 2 on 2xH200 (6.6 GB shards), i.e. at 1 +9.57-10.73 % of a 0.36 s step, "
        "+2.17-2.67 % of a 1.2 s step, +0.84 % of a 2.5 s step, and a quarter of that at 4; a larger dp moves less. "
        "One that outlasts N steps holds the next refresh up. Kept for dense models without context parallelism on "
        "two pods or more (the "
        "others reload the checkpoint when a shard moves). Host memory per pod: gpusPerPod x 2 generations x (own + "
        "buddy's shard) x 12 bytes x parameters of a rank's model part / (dp*cp), plus padding (29.7 GB for llama3-1b "
        "at dp 2, one GPU a pod); the "
        "HostMemoryShort condition compares it with the trainer container's memory request.",
    )
    replica_cost_percent: float | None = Field(
        default=None,
        gt=0,
        le=100,
        description="With distributed: the most the buddy copies' refreshes may cost the training steps, in percent "
        "of the step time. At each epoch's start the workers measure what a refresh costs the steps beside it (four "
        "refreshes, four steps apart: about 18 steps, in which a failure redoes up to 3) and then refresh every N "
        "steps, N the fewest that keep within it, never fewer than replicaIntervalSteps (all ranks agree on the "
        "largest N any of them needs); a failure then redoes up to N-1 steps. They calibrate again every 1000 steps. "
        "Unset: every replicaIntervalSteps steps, whatever that costs.",
    )


class LrDecayStyle(enum.StrEnum):
    """Decay styles of Megatron's ``OptimizerParamScheduler``."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"
    WSD = "WSD"


class LrScheduleSpec(WireModel):
    """Learning-rate schedule, run by megatron-core's ``OptimizerParamScheduler`` once per step."""

    warmup_steps: int = Field(default=0, ge=0, description="Linear warmup from 0 to training.lr over these steps.")
    decay_style: LrDecayStyle = Field(default=LrDecayStyle.CONSTANT, description="constant, linear, cosine or WSD.")
    min_lr: float = Field(default=0.0, ge=0, description="Learning rate at the end of the decay.")
    decay_steps: int | None = Field(
        default=None, ge=1, description="Steps of warmup plus decay; trainIters when unset."
    )
    wsd_decay_steps: int | None = Field(
        default=None, ge=1, description="For WSD: the final steps of annealing (linear); required with WSD."
    )


class TrainingSpec(WireModel):
    """Optimizer and data settings passed to Megatron."""

    global_batch_size: int = Field(default=16, ge=1, description="Samples per step; fixed across shrink and grow.")
    micro_batch_size: int = Field(default=1, ge=1, description="Samples per micro-batch.")
    train_iters: int = Field(default=100, ge=1, description="Steps to train; the job succeeds after the last.")
    lr: float = Field(default=1e-4, gt=0, le=10, description="Peak Adam learning rate.")
    seed: int = Field(default=1234, ge=0, description="Seed of initialization, dropout and data order.")
    data_path: str | None = Field(
        default=None, description="Prefix of a Megatron indexed dataset; deterministic mock tokens when unset."
    )
    precision: Precision = Field(
        default=Precision.BF16, description="Precision on GPU (CPU always uses fp32); fp8 needs Transformer Engine."
    )
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description="Adam, weight decay, clipping.")
    lr_schedule: LrScheduleSpec = Field(default_factory=LrScheduleSpec, description="Warmup and decay.")

    @property
    def decay_steps(self) -> int:
        """Steps of warmup plus decay in effect."""
        return self.lr_schedule.decay_steps or self.train_iters


class CheckpointSpec(WireModel):
    """Periodic distributed checkpoints, the fallback when no peer holds a rank's state."""

    path: str = Field(
        min_length=1, max_length=4096, description="Directory (a mounted PVC or bucket path) for checkpoints."
    )
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
    suspend_timeout_seconds: float = Field(
        default=1800.0,
        gt=0,
        le=86400,
        description="How long a suspension waits for its checkpoint to be complete and verified; past it the "
        "Suspended condition says SuspendCheckpointTimedOut and the pods stay (nothing trained is dropped).",
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
    hang_detection_step_multiple: float = Field(
        default=3.0,
        ge=0,
        le=1000,
        description=(
            "A training step (its data read excluded) that runs longer than this many times the median of the"
            " epoch's recent steps is a hang: the worker aborts the epoch and reports it, without waiting for"
            " collectiveTimeoutSeconds. The first step of an epoch, the step after a checkpoint save, checkpoint"
            " saves and data reads are allowed collectiveTimeoutSeconds. 0 turns progress-based detection off."
        ),
    )
    hang_detection_floor_seconds: float = Field(
        default=1.0,
        gt=0,
        le=3600,
        description=(
            "The shortest step limit progress-based hang detection uses, however fast the steps are"
            " (at least 5 s on CPU/gloo, whose steps jitter by seconds on shared cores)."
        ),
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


#: A node label key (an optional DNS prefix and a name), as Kubernetes validates label keys.
LABEL_KEY_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


class FailureDomainSpec(WireModel):
    """Failure domains: what one failure may take down at once. Pods are spread over them, and a
    failed pod is replaced by a spare from another one when a spare there is ready.

    A node (``kubernetes.io/hostname``) is always a failure domain; ``topologyKey`` names a larger
    one (a rack, a switch, a zone) by the node label that tells them apart.
    """

    topology_key: str | None = Field(
        default=None,
        max_length=317,
        pattern=LABEL_KEY_PATTERN,
        description="Node label of a failure domain larger than a node (topology.kubernetes.io/zone, a rack "
        "label); pods spread over its values as over nodes. Only nodes when unset.",
    )
    when_unsatisfiable: Literal["ScheduleAnyway", "DoNotSchedule"] = Field(
        default="ScheduleAnyway",
        description="When pods cannot be spread evenly (maxSkew 1): ScheduleAnyway (spreading is a preference) "
        "or DoNotSchedule (a pod waits Pending rather than share a domain unevenly).",
    )


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


class Resources(WireModel):
    """Container resources per pod; ``nvidia.com/gpu`` is set from gpusPerPod (given here, it must match)."""

    requests: dict[str, Quantity] = Field(default_factory=dict, description="Resource requests (cpu, memory, ...).")
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Resource limits.")


_m = model_field_cel


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
        f"{_m('numAttentionHeads')} % self.tp == 0",
        "spec.model.numAttentionHeads must be a multiple of spec.tp",
        lambda s: s.model.num_attention_heads % s.tp == 0,
    ),
    SpecRule(
        f"has(self.model.kvChannels) || {_m('hiddenSize')} % {_m('numAttentionHeads')} == 0",
        "spec.model.hiddenSize must be a multiple of spec.model.numAttentionHeads (or spec.model.kvChannels given)",
        lambda s: s.model.kv_channels is not None or s.model.hidden_size % s.model.num_attention_heads == 0,
    ),
    SpecRule(
        f"{_m('numAttentionHeads')} % {_m('numQueryGroups')} == 0",
        "spec.model.numAttentionHeads must be a multiple of spec.model.numQueryGroups",
        lambda s: s.model.num_attention_heads % s.model.query_groups == 0,
    ),
    SpecRule(
        f"{_m('numQueryGroups')} % self.tp == 0",
        "spec.model.numQueryGroups must be a multiple of spec.tp (each tensor-parallel rank holds whole groups)",
        lambda s: s.model.query_groups % s.tp == 0,
    ),
    SpecRule(
        f"{_m('ffnHiddenSize')} % self.tp == 0",
        "spec.model.ffnHiddenSize must be a multiple of spec.tp",
        lambda s: s.model.ffn_size % s.tp == 0,
    ),
    SpecRule(
        f"{_m('vocabSize')} % self.tp == 0",
        "spec.model.vocabSize must be a multiple of spec.tp (pad it, as Megatron-LM does)",
        lambda s: s.model.vocab_size % s.tp == 0,
    ),
    SpecRule(
        f"{_m('numLayers')} % self.pp == 0",
        "spec.model.numLayers must be a multiple of spec.pp",
        lambda s: s.model.num_layers % s.pp == 0,
    ),
    SpecRule(
        f"{_m('maxPositionEmbeddings')} >= {_m('seqLength')}",
        "spec.model.maxPositionEmbeddings must be at least spec.model.seqLength",
        lambda s: s.model.max_positions >= s.model.seq_length,
    ),
    SpecRule(
        "!has(self.model.numExperts) || "
        f"((has(self.model.moeRouterTopk) ? self.model.moeRouterTopk : 2) <= self.model.numExperts && "
        f"!{_m('addBiasLinear')})",
        "spec.model.numExperts needs moeRouterTopk <= numExperts and addBiasLinear false "
        "(megatron-core's local experts fail on biases without Transformer Engine)",
        lambda s: (
            s.model.num_experts is None
            or (s.model.moe_router_topk <= s.model.num_experts and not s.model.add_bias_linear)
        ),
    ),
    SpecRule(
        "self.ep == 1 || (has(self.model.numExperts) && self.model.numExperts % self.ep == 0)",
        "spec.ep must divide spec.model.numExperts (each expert-parallel rank holds numExperts/ep experts)",
        lambda s: s.ep == 1 or (s.model.num_experts is not None and s.model.num_experts % s.ep == 0),
    ),
    SpecRule(
        "self.replicas % self.ep == 0 && self.minReplicas % self.ep == 0",
        "spec.replicas and spec.minReplicas must be multiples of spec.ep "
        "(expert-parallel groups are made of data-parallel replicas)",
        lambda s: s.replicas % s.ep == 0 and s.min_replicas % s.ep == 0,
    ),
    SpecRule(
        "!has(self.model.moeFfnHiddenSize) || self.model.moeFfnHiddenSize % self.tp == 0",
        "spec.model.moeFfnHiddenSize must be a multiple of spec.tp (experts are split over tp like the MLP)",
        lambda s: s.model.moe_ffn_hidden_size is None or s.model.moe_ffn_hidden_size % s.tp == 0,
    ),
    SpecRule(
        "!has(self.model.numExperts) || self.tp == 1 || "
        "(has(self.model.sequenceParallel) && self.model.sequenceParallel)",
        "spec.model.numExperts with spec.tp > 1 needs spec.model.sequenceParallel (megatron-core's rule for MoE)",
        lambda s: s.model.num_experts is None or s.tp == 1 or s.model.sequence_parallel,
    ),
    SpecRule(
        "!has(self.model.sequenceParallel) || !self.model.sequenceParallel || self.tp > 1",
        "spec.model.sequenceParallel needs spec.tp > 1",
        lambda s: not s.model.sequence_parallel or s.tp > 1,
    ),
    SpecRule(
        "!has(self.training.lrSchedule.warmupSteps) || self.training.lrSchedule.warmupSteps < "
        "(has(self.training.lrSchedule.decaySteps) ? self.training.lrSchedule.decaySteps : self.training.trainIters)",
        "spec.training.lrSchedule.warmupSteps must be less than decaySteps (trainIters when unset)",
        lambda s: s.training.lr_schedule.warmup_steps < s.training.decay_steps,
    ),
    SpecRule(
        "self.training.lrSchedule.decayStyle != 'WSD' || (has(self.training.lrSchedule.wsdDecaySteps) && "
        "self.training.lrSchedule.wsdDecaySteps <= (has(self.training.lrSchedule.decaySteps) ? "
        "self.training.lrSchedule.decaySteps : self.training.trainIters))",
        "spec.training.lrSchedule.wsdDecaySteps is required with decayStyle WSD and must not exceed decaySteps",
        lambda s: (
            s.training.lr_schedule.decay_style is not LrDecayStyle.WSD
            or (
                s.training.lr_schedule.wsd_decay_steps is not None
                and s.training.lr_schedule.wsd_decay_steps <= s.training.decay_steps
            )
        ),
    ),
    SpecRule(
        "!has(self.training.lrSchedule.minLr) || self.training.lrSchedule.minLr <= self.training.lr",
        "spec.training.lrSchedule.minLr must not exceed spec.training.lr",
        lambda s: s.training.lr_schedule.min_lr <= s.training.lr,
    ),
    SpecRule(
        "!has(self.training.optimizer.distributed) || !self.training.optimizer.distributed || has(self.checkpoint)",
        "spec.training.optimizer.distributed needs spec.checkpoint: sharded optimizer state recovers "
        "from the distributed checkpoint",
        lambda s: not s.training.optimizer.distributed or s.checkpoint is not None,
    ),
    SpecRule(
        "!has(self.training.optimizer.replicaCostPercent) || "
        "(has(self.training.optimizer.distributed) && self.training.optimizer.distributed)",
        "spec.training.optimizer.replicaCostPercent needs spec.training.optimizer.distributed: only the distributed "
        "optimizer keeps buddy copies",
        lambda s: s.training.optimizer.replica_cost_percent is None or s.training.optimizer.distributed,
    ),
    SpecRule(
        "!has(self.suspend) || !self.suspend || has(self.checkpoint)",
        "spec.suspend needs spec.checkpoint: a suspended job's pods are deleted, and it resumes from the "
        "checkpoint they write when it stops",
        lambda s: not s.suspend or s.checkpoint is not None,
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
    *TEMPLATE_RULES,
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
        default=None,
        description="Image pull policy of the trainer container (shorthand for the template's trainer container).",
    )
    command: list[str] | None = Field(default=None, description="Container command; the image's entrypoint when unset.")
    args: list[str] = Field(default_factory=list, description="Extra arguments for the trainer.")
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=256,
        description="Extra environment variables of the trainer container (shorthand for the template's).",
    )
    model: ModelSpec = Field(
        default_factory=ModelSpec,
        description="The model: a preset and/or TransformerConfig settings.",
        json_schema_extra={"default": {}},  # unset fields are resolved from the preset, not defaulted
    )
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="Optimizer, batch and data.")
    tp: int = Field(default=1, ge=1, le=64, description="Tensor-parallel size.", json_schema_extra=_immutable("tp"))
    pp: int = Field(default=1, ge=1, le=256, description="Pipeline-parallel size.", json_schema_extra=_immutable("pp"))
    cp: int = Field(default=1, ge=1, le=64, description="Context-parallel size.", json_schema_extra=_immutable("cp"))
    ep: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="Expert-parallel size (mixture of experts): each expert layer's experts are split over ep "
        "data-parallel replicas; replicas and minReplicas are multiples of it.",
        json_schema_extra=_immutable("ep"),
    )
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
    resources: Resources = Field(
        default_factory=Resources,
        description="Resources of the trainer container besides GPUs (shorthand for the template's).",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node selector of trainer pods (shorthand for the template's)."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=64, description="Tolerations of trainer pods (shorthand for the template's)."
    )
    checkpoint: CheckpointSpec | None = Field(default=None, description="Distributed checkpoints.")
    template: PodTemplate | None = Field(
        default=None,
        description="A PodTemplateSpec for the job's pods (volumes, env, RDMA resources, sidecars, affinity, "
        "priorityClassName, schedulerName, securityContext, labels, annotations, ...), merged with what the "
        "operator owns; a container named trainer is merged into the trainer container.",
    )
    shm_size: str | None = Field(
        default=None,
        pattern=QUANTITY_PATTERN,
        description="Size limit of the memory-backed /dev/shm of trainer pods (NCCL and data loaders use it; "
        "it counts against the pod's memory); unset, only the pod's memory limit bounds it.",
    )
    failure_domain: FailureDomainSpec = Field(
        default_factory=FailureDomainSpec, description="Failure domains pods are spread over."
    )
    suspend: bool = Field(
        default=False,
        description="True stops the job without losing a step: its workers write a distributed checkpoint of the "
        "step they reached (complete and verified), then every pod is deleted and the Suspended condition is True. "
        "False again resumes it from that checkpoint with new pods and the spec's mesh. Needs spec.checkpoint.",
    )
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
    SUSPENDING = "Suspending"  # spec.suspend: the workers write the checkpoint the job will resume from
    SUSPENDED = "Suspended"  # no pods; resumes from its checkpoint when spec.suspend is false again
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
    #: True while the operator keeps its hands off the job because it cannot trust its status: the
    #: status cannot be read by this version, or the agents hold a newer epoch than it records.
    RECONCILE_PAUSED = "ReconcilePaused"
    #: Only on a job queued through Kueue (labelled ``kueue.x-k8s.io/queue-name``): True once Kueue
    #: admitted its Workload; False while it waits for admission or after an eviction.
    QUEUE_ADMITTED = "QueueAdmitted"
    #: True while the job is suspended (its pods stopped after its checkpoint was written); False while
    #: it is being suspended or resumed, or when a suspension could not write its checkpoint (the reason
    #: says which). Absent until the job is first suspended.
    SUSPENDED = "Suspended"
    #: Only with the distributed optimizer's buddy copies: True while the trainer container's memory
    #: request is below the host memory they need per pod (a warning: the job runs).
    HOST_MEMORY_SHORT = "HostMemoryShort"


class Condition(OpenWireModel):
    """A condition in the shape of metav1.Condition."""

    type: str = Field(min_length=1, max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = Field(default="", max_length=32768)
    last_transition_time: datetime
    observed_generation: int | None = Field(default=None, ge=0)


class FailureRecord(OpenWireModel):
    """The most recent failure the operator acted on."""

    pod: str
    reason: str
    message: str = ""
    time: datetime


class LostTime(OpenWireModel):
    """Seconds of a job's wall time lost, by cause (see Goodput)."""

    detection: float = Field(
        default=0.0, ge=0, description="Last step committed before a failure to the failure declared."
    )
    reconfiguration: float = Field(
        default=0.0,
        ge=0,
        description="Failure declared to every member of the new plan training (its first step excluded).",
    )
    redone_steps: float = Field(
        default=0.0, ge=0, description="Steps trained, then discarded because training resumed from an older step."
    )
    waiting_for_capacity: float = Field(
        default=0.0,
        ge=0,
        description="No plan training and no recovery open: pods being scheduled and started, too few pods.",
    )
    checkpoint_stalls: float = Field(default=0.0, ge=0, description="Training blocked starting checkpoint saves.")
    other: float = Field(
        default=0.0,
        ge=0,
        description="Training time outside steps (data loading, reporting lag) and time no operator observed.",
    )


class Goodput(OpenWireModel):
    """Where the job's wall time went: the steps kept, and the rest by cause."""

    ratio: float = Field(
        ge=0, le=1, description="Productive seconds over wall seconds (effective training time ratio)."
    )
    wall_seconds: float = Field(ge=0, description="Since the job was created.")
    productive_seconds: float = Field(ge=0, description="Durations of the training steps kept.")
    lost_seconds: LostTime = Field(default_factory=LostTime)


class MegatronJobStatus(OpenWireModel):
    """What the operator observed and decided; written whole, once per change. Fields another
    version of the operator wrote are kept."""

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
    recovery_epoch: int = Field(
        default=0,
        ge=0,
        description=(
            "Epoch of the plan that started the last recovery. The recovery is under way while committedEpoch is"
            " below it; plans made meanwhile (for pods lost while the survivors joined, a join every member"
            " abandoned) belong to it."
        ),
    )
    last_recovery_duration_seconds: float | None = Field(
        default=None,
        ge=0,
        description="Failure detected to the first training step committed by every member, for the last recovery.",
    )
    last_failure: FailureRecord | None = None
    step: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Steps completed, as reported by the trainers (written with every other change; on its own no more"
            " often than keeps the job's status writes under 64 KiB/s: every few seconds at thousands of pods)."
        ),
    )
    checkpoint_step: int | None = Field(
        default=None,
        ge=0,
        description="Newest complete distributed checkpoint: the fallback when no peer holds a shard.",
    )
    buddy_copy_step: int | None = Field(
        default=None,
        ge=0,
        description=(
            "With buddy copies of the distributed optimizer's shards: every member pod holds complete copies at"
            " least this new (the oldest of the newest its agents reported this epoch), so losing any one pod now"
            " goes back no further than this step; unset until the epoch's first refresh is complete on every pod."
        ),
    )
    start_time: datetime | None = None
    completion_time: datetime | None = None
    goodput: Goodput | None = Field(
        default=None, description="Where the wall time went (refreshed with other changes, at least every 30 s)."
    )


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
