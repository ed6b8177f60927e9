"""Buddy copies of the distributed optimizer's shards kept by the training loop of real worker
processes on CPU/gloo (worker/training_loop.py, worker/buddy_copies.py).

Scenario: three pods of one worker each (DP 3, ZeRO-1 over the three ranks, TP 1), so the buddies
form a ring (rank r's buddy is r+1, its ward r-1) and a copy sent the wrong way round would land
on the wrong rank. With ``replicaIntervalSteps`` 1, every step's refresh is logged by every rank
(``MEGATRON_WORKER_COPY_LOG``): its optimizer shards read anew at the step, and, once the refresh
finished, its own snapshot and its ward's copy. Each ward copy equals, element for element, the
shards its ward had after that step; every loss equals a run of the same job without copies, bit
for bit; each worker tells its agent the complete copies it holds after every refresh, two
generations at most, newest first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from worker_harness import MakeCluster, WorkerCluster, make_spec

from megatron_contract.job import CheckpointSpec, MegatronJobSpec
from megatron_trainer.channel import ReplicaSteps
from megatron_trainer.worker.settings import ENV_COPY_LOG

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PODS = ["a", "b", "c"]
TRAIN_ITERS = 4


def buddy_spec(checkpoint: Path, interval: int = 1, train_iters: int = TRAIN_ITERS) -> MegatronJobSpec:
    """Three replicas of one GPU each, the distributed optimizer (it needs a checkpoint path; saves
    are rarer than the job is long)."""
    wire = make_spec(replicas=3, tp=1, gpus_per_pod=1, train_iters=train_iters, global_batch_size=6).to_wire()
    wire["training"]["optimizer"].update({"distributed": True, "replicaIntervalSteps": interval})
    wire["checkpoint"] = CheckpointSpec(path=str(checkpoint), interval_steps=1000).to_wire()
    return MegatronJobSpec.model_validate(wire)


def train(cluster: WorkerCluster, buddies: bool) -> dict[int, float]:
    cluster.boot(PODS)
    plan = cluster.plan(PODS, buddies=buddies)
    assert (plan.optimizer_state is not None) == buddies
    cluster.assign(plan)
    cluster.wait_succeeded(PODS)
    return cluster.losses(PODS)


def load(path: Path) -> dict[str, object]:
    assert path.exists(), f"{path.name} was not logged"
    return torch.load(path)


def same(a: object, b: object) -> bool:
    assert isinstance(a, list) and isinstance(b, list) and len(a) == len(b) > 0
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_every_step_each_ward_copy_is_its_wards_shard_and_losses_are_unchanged(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    logs = tmp_path / "copies"
    logs.mkdir()
    with_copies = make_cluster(buddy_spec(tmp_path / "ckpt"), tmp_path / "buddies", {ENV_COPY_LOG: str(logs)})
    losses = train(with_copies, buddies=True)
    without = make_cluster(buddy_spec(tmp_path / "ref-ckpt"), tmp_path / "reference")
    reference = train(without, buddies=False)
    assert sorted(losses) == list(range(1, TRAIN_ITERS + 1))
    assert losses == reference, "the copies changed training"

    world = len(PODS)
    for rank in range(world):
        ward = (rank - 1) % world
        for step in range(1, TRAIN_ITERS + 1):
            copies = load(logs / f"copies-{rank}-{step}.pt")
            assert copies["ward_rank"] == ward
            assert same(copies["own"], load(logs / f"state-{rank}-{step}.pt")["shards"]), (rank, step)
            assert same(copies["ward"], load(logs / f"state-{ward}-{step}.pt")["shards"]), (rank, step)
        # The shards change every step: the comparisons above could not pass with a stale copy.
        assert not same(load(logs / f"state-{rank}-1.pt")["shards"], load(logs / f"state-{rank}-2.pt")["shards"])

    for worker in with_copies.workers():
        held = [(m.epoch, m.steps) for m in worker.of_type(ReplicaSteps)]
        # Started after step 1 (nothing complete yet), each finished after the next step (the
        # start then drops the older of two generations), the last one once training ended.
        assert held == [(1, []), (1, [1]), (1, [2]), (1, [3]), (1, [4, 3])], worker.name
    assert not any(w.of_type(ReplicaSteps) for w in without.workers()), "no copies when the plan asks for none"
