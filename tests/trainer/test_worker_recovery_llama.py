"""A Llama-style model (GQA, SwiGLU, RMSNorm, RoPE, untied embeddings, no biases, with dropout)
under warmup + cosine decay, weight decay and gradient clipping, recovering in real worker
processes on CPU/gloo. Scenarios:

- SIGKILL of one worker with a spare (DP=2, TP=2, Megatron's plain optimizer): the spare receives
  weights, Adam state, the step and the learning-rate scheduler's state from its DP peer; dropout
  masks are redrawn from the data position; every step's loss equals the failure-free run bit for bit;
- the distributed optimizer (ZeRO-1 over DP=2, TP=1): SIGKILL of one worker with a spare, and every
  rank (survivor and spare) restores model, sharded optimizer state and scheduler from the newest
  distributed checkpoint; every loss equals the failure-free run with the distributed optimizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from worker_harness import MakeCluster, WorkerCluster, failure_free_losses, fault_env, make_spec

from megatron_contract.job import CheckpointSpec, MegatronJobSpec
from megatron_contract.mesh import PlanReason, StateSource, StateSourceKind
from megatron_trainer.faults import Fault, FaultPlan
from megatron_trainer.worker.checkpoint import newest_complete

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TRAIN_ITERS = 8
FAULT_STEP = 5  # steps 0..4 are complete when the fault fires

LLAMA_STYLE: dict[str, Any] = {
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "activation": "swiglu",
    "normalization": "RMSNorm",
    "position_embedding": "rope",
    "rotary_base": 500000,
    "untie_embeddings_and_output_weights": True,
    "add_bias_linear": False,
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
}
SCHEDULE: dict[str, Any] = {
    "optimizer": {"weightDecay": 0.1, "clipGrad": 0.5, "adamBeta2": 0.95},
    "lr_schedule": {"warmupSteps": 2, "decayStyle": "cosine", "minLr": 1e-4},
}


def llama_spec(tp: int, checkpoint: Path | None = None) -> MegatronJobSpec:
    """The job; with a checkpoint directory it uses the distributed optimizer (which needs one)."""
    spec = make_spec(spares=1, tp=tp, gpus_per_pod=tp, train_iters=TRAIN_ITERS, training=SCHEDULE, **LLAMA_STYLE)
    if checkpoint is None:
        return spec
    wire = spec.to_wire()
    wire["training"]["optimizer"]["distributed"] = True
    wire["checkpoint"] = CheckpointSpec(path=str(checkpoint), interval_steps=2).to_wire()
    return MegatronJobSpec.model_validate(wire)


def faulty_cluster(spec: MegatronJobSpec, workdir: Path, rank: int, make_cluster: MakeCluster) -> WorkerCluster:
    """Pods a and b train, s waits as a spare; ``rank`` (in pod a) is SIGKILLed mid-step FAULT_STEP."""
    faults = FaultPlan().fail_at(rank=rank, step=FAULT_STEP, fault=Fault.SIGKILL)
    cluster = make_cluster(spec, workdir, fault_env(workdir, faults))
    cluster.boot(["a", "b", "s"])
    cluster.assign(cluster.plan(["a", "b"]))
    cluster.fail_pod_on_injected_kill("a", rank, 300, survivors=["b"])
    return cluster


def test_llama_style_replace_from_peer_is_bitwise(tmp_path: Path, make_cluster: MakeCluster) -> None:
    spec = llama_spec(tp=2)
    expected = failure_free_losses(spec, tmp_path / "reference")
    cluster = faulty_cluster(spec, tmp_path / "faulty", rank=1, make_cluster=make_cluster)
    assert cluster.replace_with_spare("s", survivor="b") == FAULT_STEP
    cluster.wait_succeeded(["s", "b"])
    assert cluster.losses(["a", "b", "s"]) == expected


def test_llama_style_distributed_optimizer_restores_from_checkpoint_bitwise(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    ckpt = tmp_path / "ckpt"
    spec = llama_spec(tp=1, checkpoint=ckpt)
    expected = failure_free_losses(llama_spec(tp=1, checkpoint=tmp_path / "reference-ckpt"), tmp_path / "reference")
    cluster = faulty_cluster(spec, tmp_path / "faulty", rank=0, make_cluster=make_cluster)
    newest = newest_complete(ckpt)
    # Saves are asynchronous: the one of step 4 may still be written when step 5's fault lands, and
    # then the one of step 2 is the newest (steps 3-5 are redone).
    assert newest in (2, 4), f"checkpoints: {sorted(p.name for p in ckpt.iterdir())}"
    # Sharded optimizer state lives only in the checkpoint: every rank loads it.
    sources = {r: StateSource(rank=r, kind=StateSourceKind.CHECKPOINT, checkpoint_step=newest) for r in range(2)}
    plan = cluster.plan(["s", "b"], resume_step=newest, reason=PlanReason.REPLACE, sources=sources)
    cluster.assign(plan, ["s", "b"])
    cluster.wait_succeeded(["s", "b"])
    # Step 5 was computed by a/b before the fault and again after the restore: losses() requires they agree.
    assert cluster.losses(["a", "b", "s"]) == expected
