"""Bring your own model: a Megatron-Core model the tests define (``custom_model.py``, no GPT),
named by ``spec.model.modelProvider`` and ``spec.model.forwardStep`` and imported by real worker
processes on CPU/gloo, trains and recovers like the built-in GPT. Scenario: DP=2 x TP=2 with a
spare; SIGKILL of one worker mid-step; the spare takes its ranks with state from its DP peer; every
step's loss equals the failure-free run bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from worker_harness import REPO, MakeCluster, failure_free_losses, fault_env, make_spec

from megatron_contract.job import MegatronJobSpec
from megatron_trainer.faults import Fault, FaultPlan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TRAIN_ITERS = 6
FAULT_STEP = 3


def custom_spec() -> MegatronJobSpec:
    return make_spec(
        spares=1,
        train_iters=TRAIN_ITERS,
        ffn_hidden_size=64,
        model_provider="custom_model:model_provider",
        forward_step="custom_model:forward_step",
    )


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Workers import the test's model from tests/trainer, as a trainer image would from its own packages."""
    path = os.pathsep.join(str(REPO / p) for p in ("contract", "trainer", "tests/trainer"))
    return {"PYTHONPATH": path, **(extra or {})}


def test_custom_model_replace_from_peer_is_bitwise(tmp_path: Path, make_cluster: MakeCluster) -> None:
    spec = custom_spec()
    expected = failure_free_losses(spec, tmp_path / "reference", env())

    faults = FaultPlan().fail_at(rank=1, step=FAULT_STEP, fault=Fault.SIGKILL)
    cluster = make_cluster(spec, tmp_path / "faulty", env(fault_env(tmp_path, faults)))
    cluster.boot(["a", "b", "s"])
    cluster.assign(cluster.plan(["a", "b"]))
    cluster.fail_pod_on_injected_kill("a", 1, 180, survivors=["b"])
    assert cluster.replace_with_spare("s", survivor="b") == FAULT_STEP
    cluster.wait_succeeded(["s", "b"])
    assert cluster.losses(["a", "b", "s"]) == expected
    for w in cluster.workers():  # built by the job's provider, not the built-in GPT
        assert "custom_model: built MlpLanguageModel" in w.log_path.read_text(errors="replace"), w.log_tail()
