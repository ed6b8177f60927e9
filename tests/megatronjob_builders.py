"""Builders of MegatronJob documents and specs for the tests: the examples, bad variants, resources in
the usual quantity forms, and the small spec that the operator, agent and worker harnesses start from."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import yaml

from megatron_contract.job import MegatronJobSpec

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "megatronjob.yaml"
LLAMA_EXAMPLE = EXAMPLE.with_name("megatronjob-llama.yaml")
MOE_EXAMPLE = EXAMPLE.with_name("megatronjob-moe.yaml")
PRODUCTION_EXAMPLE = EXAMPLE.with_name("megatronjob-production.yaml")


def example_job(name: str = "gpt-demo", path: Path = EXAMPLE) -> dict[str, Any]:
    """A committed example (the small GPT unless ``path`` names another), renamed."""
    job: dict[str, Any] = yaml.safe_load(path.read_text())
    job["metadata"] = {"name": name}
    return job


def small_spec(
    *,
    tp: int = 1,
    pp: int = 1,
    model: dict[str, Any] | None = None,
    training: dict[str, Any] | None = None,
    failure_detection: dict[str, Any] | None = None,
    **fields: Any,
) -> MegatronJobSpec:
    """A small valid spec, in snake_case field names: a tiny GPT (2 layers per pipeline stage, 4 heads
    or one per tensor-parallel rank, 8 wide each, 16 tokens, a vocabulary of 128) that trains in a
    fraction of a second per step on CPU, with a global batch of 8 in micro-batches of 1.

    ``model``, ``training`` and ``failure_detection`` add or replace fields of those sections (a model
    preset brings its own shape); ``fields`` sets any other spec field (replicas, spares, ...).
    """
    heads = math.lcm(4, tp)
    tiny = {
        "num_layers": 2 * pp,
        "hidden_size": 8 * heads,
        "num_attention_heads": heads,
        "seq_length": 16,
        "vocab_size": 128,
    }
    model = model or {}
    return MegatronJobSpec.model_validate(
        {
            "image": "trainer:test",
            "tp": tp,
            "pp": pp,
            "model": {**({} if model.get("preset") else tiny), **model},
            "training": {"global_batch_size": 8, "micro_batch_size": 1, **(training or {})},
            "failure_detection": failure_detection or {},
            **fields,
        }
    )


def with_spec(job: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """A copy of ``job`` with spec fields replaced; dotted keys (``model.numLayers``) reach nested
    ones, and the value ``DELETE`` removes the field."""
    job = copy.deepcopy(job)
    for dotted, value in changes.items():
        node = job["spec"]
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return job


DELETE = object()

#: Resources in the usual quantity forms, GPUs equal to the example's gpusPerPod (2) as a number and
#: as a string: what the models and the API server both accept.
GOOD_RESOURCES = {
    "requests": {"cpu": "500m", "memory": "16Gi", "ephemeral-storage": "1e3", "nvidia.com/gpu": 2},
    "limits": {"cpu": 4, "memory": "1.5e10", "nvidia.com/gpu": "2"},
}
#: The longest name a MegatronJob may have (63 characters: its pods' names and labels derive from it).
LONGEST_NAME = "n" * 62 + "0"
#: A valid mixture of experts for the example (tp 2: megatron-core needs sequence parallelism).
MOE_TP2: dict[str, Any] = {"model.numExperts": 8, "model.addBiasLinear": False, "model.sequenceParallel": True}

#: Spec changes the rules of spec.template accept (the example has gpusPerPod 2): the trainer's GPUs
#: equal to gpusPerPod as a number and as a string, an RDMA device, a port of its own, a sidecar with
#: its ports, a volume and its mount, a label and an annotation, a pod field the CRD does not type.
GOOD_TEMPLATE = {
    "resources": DELETE,
    "shmSize": "32Gi",
    "template": {
        "metadata": {"labels": {"team": "llm"}, "annotations": {"example.com/owner": "pretraining"}},
        "spec": {
            "priorityClassName": "training-high",
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
            "containers": [
                {"name": "proxy", "image": "envoy:1", "ports": [{"name": "http", "containerPort": 8080}]},
                {
                    "name": "trainer",
                    "image": "ghcr.io/megatron-operator/trainer:0.1.0",
                    "resources": {"limits": {"nvidia.com/gpu": "2", "rdma/ib": 1}, "requests": {"nvidia.com/gpu": 2}},
                    "ports": [{"name": "debug", "containerPort": 5678}],
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                },
            ],
        },
    },
}


@dataclasses.dataclass(frozen=True)
class BadJob:
    """A spec change (or a job name) the API server and the models must both refuse, and the text
    the refusal must contain (it names the field)."""

    name: str
    changes: dict[str, Any]
    expect: str
    job_name: str | None = None  # the job's metadata.name when not ``name``

    def job(self) -> dict[str, Any]:
        """The example job with this one's name and changes."""
        return with_spec(example_job(self.job_name or self.name), **self.changes)


NAME_RULE = "metadata.name must be a DNS-1035 label of at most 63 characters"


BAD_JOBS: tuple[BadJob, ...] = (
    BadJob("negative-replicas", {"replicas": -1}, "spec.replicas"),
    BadJob("zero-tp", {"tp": 0}, "spec.tp"),
    BadJob("negative-spares", {"spares": -2}, "spec.spares"),
    BadJob("tp-not-dividing-gpus-per-pod", {"gpusPerPod": 3}, "spec.gpusPerPod must be a multiple of spec.tp"),
    BadJob("min-above-replicas", {"minReplicas": 5}, "spec.minReplicas must not exceed spec.replicas"),
    BadJob("unknown-field", {"sparez": 1}, "sparez"),
    BadJob("unknown-nested-field", {"model.numLayer": 4}, "numLayer"),
    BadJob("missing-image", {"image": DELETE}, "spec.image"),
    BadJob(
        "heads-not-divisible-by-tp",
        {"model.numAttentionHeads": 3, "model.hiddenSize": 129},
        "spec.model.numAttentionHeads must be a multiple of spec.tp",
    ),
    BadJob(
        "layers-not-divisible-by-pp",
        {"pp": 2, "gpusPerPod": 2, "model.numLayers": 3},
        "spec.model.numLayers must be a multiple of spec.pp",
    ),
    BadJob(
        "global-batch-smaller-than-replicas",
        {"training.globalBatchSize": 2},
        "spec.training.globalBatchSize / microBatchSize must be at least spec.replicas",
    ),
    BadJob(
        "global-batch-not-multiple-of-micro",
        {"training.globalBatchSize": 15, "training.microBatchSize": 2},
        "spec.training.globalBatchSize must be a multiple of spec.training.microBatchSize",
    ),
    BadJob("zero-learning-rate", {"training.lr": 0}, "spec.training.lr"),
    BadJob(
        "zero-copy-cost-budget",
        {"training.optimizer.distributed": True, "training.optimizer.replicaCostPercent": 0},
        "spec.training.optimizer.replicaCostPercent",
    ),
    BadJob(
        "copy-cost-budget-over-100",
        {"training.optimizer.distributed": True, "training.optimizer.replicaCostPercent": 150},
        "spec.training.optimizer.replicaCostPercent",
    ),
    BadJob(
        "copy-cost-budget-without-the-distributed-optimizer",
        {"training.optimizer.replicaCostPercent": 2},
        "spec.training.optimizer.replicaCostPercent needs spec.training.optimizer.distributed",
    ),
    BadJob(
        "heartbeat-timeout-below-interval",
        {"failureDetection.heartbeatTimeoutSeconds": 1},
        "spec.failureDetection.heartbeatTimeoutSeconds must exceed heartbeatIntervalSeconds",
    ),
    BadJob("bad-pull-policy", {"imagePullPolicy": "Sometimes"}, "spec.imagePullPolicy"),
    BadJob("replicas-not-a-number", {"replicas": "four"}, "spec.replicas"),
    BadJob("name-of-64-characters", {}, NAME_RULE, job_name="n" * 64),
    BadJob("name-of-253-characters", {}, NAME_RULE, job_name="n" * 253),
    BadJob("name-with-a-dot", {}, NAME_RULE, job_name="gpt.demo"),
    BadJob("cpu-lots", {"resources.requests.cpu": "lots"}, "spec.resources.requests.cpu"),
    BadJob("negative-memory-limit", {"resources.limits.memory": "-1Gi"}, "spec.resources.limits.memory"),
    BadJob("negative-integer-cpu", {"resources.requests.cpu": -2}, "spec.resources.requests.cpu"),
    BadJob(
        "gpu-request-contradicts-gpus-per-pod",
        {"resources": {"requests": {"cpu": "8", "nvidia.com/gpu": 4}}},
        "spec.resources.requests[nvidia.com/gpu] must equal spec.gpusPerPod",
    ),
    BadJob(
        "gpu-limit-contradicts-gpus-per-pod",
        {"resources": {"limits": {"nvidia.com/gpu": "1"}}},
        "spec.resources.limits[nvidia.com/gpu] must equal spec.gpusPerPod",
    ),
    BadJob("unknown-preset", {"model.preset": "gpt-5"}, "spec.model.preset"),
    BadJob("unknown-activation", {"model.activation": "relu"}, "spec.model.activation"),
    BadJob("unknown-normalization", {"model.normalization": "BatchNorm"}, "spec.model.normalization"),
    BadJob("zero-rotary-percent", {"model.rotaryPercent": 0}, "spec.model.rotaryPercent"),
    BadJob("dropout-of-one", {"model.hiddenDropout": 1.0}, "spec.model.hiddenDropout"),
    BadJob(
        "heads-not-divisible-by-query-groups",
        {"model.numQueryGroups": 3},
        "spec.model.numAttentionHeads must be a multiple of spec.model.numQueryGroups",
    ),
    BadJob(
        "query-groups-not-divisible-by-tp",
        {"model.numQueryGroups": 1},
        "spec.model.numQueryGroups must be a multiple of spec.tp",
    ),
    BadJob(
        "preset-query-groups-do-not-divide-given-heads",  # the rule reads qwen2.5-7b's 4 groups from the preset
        {"model.preset": "qwen2.5-7b", "model.numAttentionHeads": 6, "model.hiddenSize": 132},
        "spec.model.numAttentionHeads must be a multiple of spec.model.numQueryGroups",
    ),
    BadJob(
        "preset-heads-not-divisible-by-tp",  # qwen2.5-7b's 28 heads over tp 8
        {"model": {"preset": "qwen2.5-7b"}, "tp": 8, "gpusPerPod": 8, "replicas": 1, "minReplicas": 1},
        "spec.model.numAttentionHeads must be a multiple of spec.tp",
    ),
    BadJob("ffn-not-divisible-by-tp", {"model.ffnHiddenSize": 513}, "spec.model.ffnHiddenSize must be a multiple"),
    BadJob("vocab-not-divisible-by-tp", {"model.vocabSize": 1025}, "spec.model.vocabSize must be a multiple"),
    BadJob(
        "positions-shorter-than-sequence",
        {"model.maxPositionEmbeddings": 64},
        "spec.model.maxPositionEmbeddings must be at least spec.model.seqLength",
    ),
    BadJob(
        "sequence-parallel-without-tp",
        {"tp": 1, "model.sequenceParallel": True},
        "spec.model.sequenceParallel needs spec.tp > 1",
    ),
    BadJob(
        "more-routed-experts-than-experts",
        {"model.numExperts": 2, "model.moeRouterTopk": 4, "model.addBiasLinear": False},
        "spec.model.numExperts needs moeRouterTopk <= numExperts",
    ),
    BadJob(
        "experts-with-biases",  # the example's model keeps the default addBiasLinear: true
        {"model.numExperts": 4},
        "spec.model.numExperts needs moeRouterTopk <= numExperts and addBiasLinear false",
    ),
    BadJob(
        "expert-parallel-without-experts",
        {"ep": 2},
        "spec.ep must divide spec.model.numExperts",
    ),
    BadJob(
        "expert-parallel-not-dividing-experts",
        {"ep": 4, "minReplicas": 4, **MOE_TP2, "model.numExperts": 6},
        "spec.ep must divide spec.model.numExperts",
    ),
    BadJob(
        "min-replicas-not-a-multiple-of-ep",  # the example's minReplicas is 2
        {"ep": 4, **MOE_TP2},
        "spec.replicas and spec.minReplicas must be multiples of spec.ep",
    ),
    BadJob(
        "expert-size-not-divisible-by-tp",
        {**MOE_TP2, "model.moeFfnHiddenSize": 1023},
        "spec.model.moeFfnHiddenSize must be a multiple of spec.tp",
    ),
    BadJob(
        "experts-with-tp-without-sequence-parallel",  # the example has tp 2
        {**MOE_TP2, "model.sequenceParallel": DELETE},
        "spec.model.numExperts with spec.tp > 1 needs spec.model.sequenceParallel",
    ),
    BadJob(
        "unknown-token-dispatcher",
        {**MOE_TP2, "model.moeTokenDispatcherType": "flex"},
        "spec.model.moeTokenDispatcherType",
    ),
    BadJob("negative-aux-loss-coeff", {**MOE_TP2, "model.moeAuxLossCoeff": -0.01}, "spec.model.moeAuxLossCoeff"),
    BadJob("provider-not-an-import-reference", {"model.modelProvider": "my model"}, "spec.model.modelProvider"),
    BadJob("adam-beta-of-one", {"training.optimizer.adamBeta2": 1.0}, "spec.training.optimizer.adamBeta2"),
    BadJob("negative-weight-decay", {"training.optimizer.weightDecay": -0.1}, "spec.training.optimizer.weightDecay"),
    BadJob(
        "distributed-optimizer-without-checkpoint",
        {"training.optimizer.distributed": True, "checkpoint": DELETE},
        "spec.training.optimizer.distributed needs spec.checkpoint",
    ),
    BadJob("suspend-without-checkpoint", {"suspend": True, "checkpoint": DELETE}, "spec.suspend needs spec.checkpoint"),
    BadJob("zero-suspend-timeout", {"checkpoint.suspendTimeoutSeconds": 0}, "spec.checkpoint.suspendTimeoutSeconds"),
    BadJob(
        "warmup-as-long-as-training",
        {"training.lrSchedule.warmupSteps": 200},
        "spec.training.lrSchedule.warmupSteps must be less than decaySteps",
    ),
    BadJob(
        "unknown-decay-style",
        {"training.lrSchedule.decayStyle": "exponential"},
        "spec.training.lrSchedule.decayStyle",
    ),
    BadJob(
        "wsd-without-anneal-steps",
        {"training.lrSchedule.decayStyle": "WSD"},
        "spec.training.lrSchedule.wsdDecaySteps is required with decayStyle WSD",
    ),
    BadJob("min-lr-above-lr", {"training.lrSchedule.minLr": 0.01}, "spec.training.lrSchedule.minLr must not exceed"),
    # spec.template and the fields it shares with the shorthands (pod_template.TEMPLATE_RULES).
    BadJob(
        "template-restart-policy",
        {"template": {"spec": {"restartPolicy": "OnFailure"}}},
        "spec.template.spec.restartPolicy must be Never",
    ),
    BadJob(
        "template-token-automount",
        {"template": {"spec": {"automountServiceAccountToken": True}}},
        "spec.template.spec.automountServiceAccountToken must be false",
    ),
    BadJob("template-hostname", {"template": {"spec": {"hostname": "h"}}}, "spec.template.spec.hostname"),
    BadJob(
        "template-sidecar-on-the-agent-port",
        {
            "template": {
                "spec": {"containers": [{"name": "proxy", "image": "envoy", "ports": [{"containerPort": 29400}]}]}
            }
        },
        "spec.template.spec.containers[].ports must not use 29400 or 29401",
    ),
    BadJob(
        "template-init-container-on-the-rendezvous-port",
        {"template": {"spec": {"initContainers": [{"name": "i", "image": "b", "ports": [{"containerPort": 29401}]}]}}},
        "spec.template.spec.containers[].ports must not use 29400 or 29401",
    ),
    BadJob(
        "template-trainer-port-named-agent",
        {
            "template": {
                "spec": {"containers": [{"name": "trainer", "ports": [{"name": "agent", "containerPort": 80}]}]}
            }
        },
        "spec.template.spec.containers[].ports must not use 29400 or 29401",
    ),
    BadJob(
        "template-trainer-image",
        {"template": {"spec": {"containers": [{"name": "trainer", "image": "other:1"}]}}},
        "spec.template.spec.containers[trainer].image must equal spec.image",
    ),
    BadJob(
        "template-trainer-command",
        {"template": {"spec": {"containers": [{"name": "trainer", "command": ["sh"]}]}}},
        "spec.template.spec.containers[trainer].command must equal spec.command",
    ),
    BadJob(
        "template-trainer-args",
        {"template": {"spec": {"containers": [{"name": "trainer", "args": ["--x"]}]}}},
        "spec.template.spec.containers[trainer].args must equal spec.args",
    ),
    BadJob(
        "template-gpus-contradict-gpus-per-pod",
        {
            "resources": DELETE,
            "template": {"spec": {"containers": [{"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": 8}}}]}},
        },
        "spec.template.spec.containers[trainer].resources[nvidia.com/gpu] must equal spec.gpusPerPod",
    ),
    BadJob(
        "template-sidecar-with-gpus",
        {
            "template": {
                "spec": {"containers": [{"name": "s", "image": "s", "resources": {"requests": {"nvidia.com/gpu": 1}}}]}
            }
        },
        "only the trainer container gets nvidia.com/gpu",
    ),
    BadJob(
        "template-operator-variable",
        {
            "env": DELETE,
            "template": {
                "spec": {"containers": [{"name": "trainer", "env": [{"name": "MEGATRON_JOB_TOKEN", "value": "x"}]}]}
            },
        },
        "spec.template.spec.containers[trainer].env must not set the operator's variables",
    ),
    BadJob(
        "env-operator-variable",
        {"env": [{"name": "MEGATRON_POD_IP", "value": "1.2.3.4"}]},
        "spec.env must not set the operator's variables",
    ),
    BadJob(
        "template-operator-label",
        {"template": {"metadata": {"labels": {"megatron.dev/role": "worker"}}}},
        "spec.template.metadata.labels must not use the megatron.dev/ prefix",
    ),
    BadJob("template-metadata-name", {"template": {"metadata": {"name": "pod"}}}, "spec.template.metadata.name"),
    BadJob(
        "template-operator-volume",
        {"template": {"spec": {"volumes": [{"name": "megatron-shm", "emptyDir": {}}]}}},
        "spec.template.spec.volumes[].name must not start with megatron-",
    ),
    BadJob(
        "shm-size-and-own-shm",
        {
            "shmSize": "8Gi",
            "template": {
                "spec": {
                    "containers": [{"name": "trainer", "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}]
                }
            },
        },
        "spec.shmSize sizes the operator's /dev/shm",
    ),
    BadJob("shm-size-lots", {"shmSize": "lots"}, "spec.shmSize"),
    BadJob(
        "template-mount-on-the-checkpoint-path",
        {
            "checkpoint.volumeClaimName": "ckpt",
            "template": {
                "spec": {
                    "containers": [
                        {"name": "trainer", "volumeMounts": [{"name": "other", "mountPath": "/checkpoints/gpt-demo"}]}
                    ]
                }
            },
        },
        "spec.template.spec.containers[trainer].volumeMounts mounts spec.checkpoint.path",
    ),
    BadJob(
        "resources-twice",  # the example sets spec.resources
        {"template": {"spec": {"containers": [{"name": "trainer", "resources": {"limits": {"rdma/ib": 1}}}]}}},
        "spec.resources and spec.template.spec.containers[trainer].resources are both set",
    ),
    BadJob(
        "env-twice",
        {
            "env": [{"name": "A", "value": "1"}],
            "template": {"spec": {"containers": [{"name": "trainer", "env": [{"name": "B", "value": "2"}]}]}},
        },
        "spec.env and spec.template.spec.containers[trainer].env are both set",
    ),
    BadJob(
        "pull-policy-twice",
        {
            "imagePullPolicy": "Always",
            "template": {"spec": {"containers": [{"name": "trainer", "imagePullPolicy": "Always"}]}},
        },
        "spec.imagePullPolicy and spec.template.spec.containers[trainer].imagePullPolicy are both set",
    ),
    BadJob(
        "node-selector-twice",
        {"nodeSelector": {"a": "b"}, "template": {"spec": {"nodeSelector": {"a": "b"}}}},
        "spec.nodeSelector and spec.template.spec.nodeSelector are both set",
    ),
    BadJob(
        "tolerations-twice",
        {"tolerations": [{"operator": "Exists"}], "template": {"spec": {"tolerations": [{"operator": "Exists"}]}}},
        "spec.tolerations and spec.template.spec.tolerations are both set",
    ),
    BadJob("failure-domain-not-a-label", {"failureDomain.topologyKey": "a rack"}, "spec.failureDomain.topologyKey"),
    BadJob(
        "failure-domain-unknown-policy",
        {"failureDomain.whenUnsatisfiable": "Sometimes"},
        "spec.failureDomain.whenUnsatisfiable",
    ),
    BadJob(
        "pod-splits-replicas-unevenly",
        {"gpusPerPod": 8, "replicas": 6, "minReplicas": 2},
        "spec.replicas and spec.minReplicas must be multiples of the replicas one pod holds",
    ),
)
