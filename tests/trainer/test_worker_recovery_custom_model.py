"""Bring your own model: a Megatron-Core model the tests define (``custom_model.py``, no GPT),
named by ``spec.model.modelProvider`` and ``spec.model.forwardStep`` and imported by real worker
processes on CPU/gloo, trains and recovers like the built-in GPT. Scenario: DP=2 x TP=2 with a
spare; SIGKILL of one worker mid-step; the spare takes its ranks with state from its DP peer; every
step's loss equals the failure-free run bit for bit.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from worker_harness import REPO, WorkerCluster, make_spec, peer_sources

from megatron_contract.job import MegatronJobSpec
from megatron_contract.mesh import PlanReason
from megatron_trainer.faults import ENV_FAULT_LOG, ENV_FAULTS, Fault, FaultPlan

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


@pytest.fixture
def make_cluster() -> Iterator[list[WorkerCluster]]:
    made: list[WorkerCluster] = []
    yield made
    for cluster in made:
        print(cluster.logs())
        cluster.close()


def test_custom_model_replace_from_peer_is_bitwise(tmp_path: Path, make_cluster: list[WorkerCluster]) -> None:
    spec = custom_spec()
    reference = WorkerCluster(spec, tmp_path / "reference", env())
    make_cluster.append(reference)
    for pod in ("a", "b"):
        reference.start_pod(pod)
    reference.wait_ready(["a", "b"])
    reference.assign(reference.plan(["a", "b"]))
    reference.wait_succeeded(["a", "b"])
    expected = reference.losses(["a", "b"])
    assert sorted(expected) == list(range(1, TRAIN_ITERS + 1))
    for w in reference.workers():  # built by the job's provider, not the built-in GPT
        assert "custom_model: built MlpLanguageModel" in w.log_path.read_text(errors="replace"), w.log_tail()

    faults = {
        ENV_FAULTS: FaultPlan().fail_at(rank=1, step=FAULT_STEP, fault=Fault.SIGKILL).to_env(),
        ENV_FAULT_LOG: str(tmp_path / "faults.jsonl"),
    }
    cluster = WorkerCluster(spec, tmp_path / "faulty", env(faults))
    make_cluster.append(cluster)
    for pod in ("a", "b", "s"):
        cluster.start_pod(pod)
    cluster.wait_ready(["a", "b", "s"])
    cluster.assign(cluster.plan(["a", "b"]))
    victim = cluster.pods["a"][1]
    assert victim.eof.wait(180), "the injected SIGKILL did not happen"
    assert victim.process.wait(10) == -signal.SIGKILL
    cluster.kill_pod("a")
    cluster.wait_failed_reports(["b"], epoch=1)
    resume = max(w.last_step() for w in cluster.workers(["b"]))
    assert resume == FAULT_STEP
    plan = cluster.plan(
        ["s", "b"], resume_step=resume, reason=PlanReason.REPLACE, sources=peer_sources(spec, [0, 1], [2, 3])
    )
    cluster.assign(plan, ["s", "b"])
    cluster.wait_succeeded(["s", "b"])
    assert cluster.losses(["a", "b", "s"]) == expected
