"""MegatronJobs for the local cluster's process nodes: the tiny GPT that the chaos run, the demo's
checks and the end-to-end tests train with the real trainer agent, on CPU/gloo."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from localcluster.nodeagent import LOCAL_NODE_TOLERATION, NODE_POOL_LABEL
from megatron_trainer.worker.settings import ENV_SAMPLE_LOG

#: Samples per step of :func:`tiny_job` unless its ``training`` is replaced.
GLOBAL_BATCH = 4


def tiny_job(
    name: str,
    *,
    pool: str,
    replicas: int = 2,
    spares: int = 1,
    train_iters: int = 40,
    samples: Path | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A tiny GPT job whose pods run the real trainer agent on the process nodes of ``pool``.

    Args:
        name: the job's name.
        pool: the node pool (``NodeAgent.pool``) whose nodes alone may run its pods.
        replicas, spares, train_iters: the usual spec fields.
        samples: a folder where every worker logs each committed step's samples and loss.
        spec: other spec fields (wire names), each replacing the default one whole.
    """
    body: dict[str, Any] = {
        "image": "megatron-trainer:local",
        "command": ["python", "-m", "megatron_trainer.agent"],
        "tp": 1,
        "pp": 1,
        "gpusPerPod": 1,
        "replicas": replicas,
        "minReplicas": 1,
        "spares": spares,
        "nodeSelector": {NODE_POOL_LABEL: pool},
        "tolerations": [LOCAL_NODE_TOLERATION],
        "model": {"numLayers": 2, "hiddenSize": 32, "numAttentionHeads": 2, "seqLength": 16, "vocabSize": 128},
        "training": {
            "globalBatchSize": GLOBAL_BATCH,
            "microBatchSize": 1,
            "trainIters": train_iters,
            "lr": 0.001,
            "seed": 7,
        },
        "failureDetection": {
            "heartbeatIntervalSeconds": 1,
            "heartbeatTimeoutSeconds": 20,
            "collectiveTimeoutSeconds": 15,
            # CPU steps of processes sharing two cores stall for seconds: a hang is a stall past 5 s.
            "hangDetectionFloorSeconds": 5,
        },
        "maxRecoveries": 5,
    }
    body.update(spec)
    job = {"apiVersion": "megatron.dev/v1alpha1", "kind": "MegatronJob", "metadata": {"name": name}, "spec": body}
    return with_sample_log(job, samples) if samples is not None else job


def with_sample_log(job: dict[str, Any], directory: Path) -> dict[str, Any]:
    """``job`` (changed in place) whose workers append each committed step's samples and loss to
    files in ``directory`` (one rank per replica logs)."""
    spec = job["spec"]
    spec["env"] = [*spec.get("env", []), {"name": ENV_SAMPLE_LOG, "value": str(directory)}]
    return job
