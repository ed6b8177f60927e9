"""A suspend plan in real worker processes (gloo, Megatron-Core GPT, TP=2); the test process plays
agent and operator (see ``worker_harness``), a writer gate (``MEGATRON_CHECKPOINT_WRITER_GATE``)
plays the storage.

Scenario: the workers train; a ``suspend`` plan names a step boundary ahead; they stop there, enter
the epoch with their state and write its checkpoint, which the storage fails: the failure is
reported (``failed``, never saved), no step is trained further and the workers wait holding their
state. A second suspend plan (the operator's retry) writes it: it is reported saved once complete,
and the files match their manifest. A plan that keeps every rank's state (the suspension withdrawn)
then trains on from that step to the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from worker_harness import MakeCluster, make_spec, wait_for

from megatron_contract.job import CheckpointSpec
from megatron_contract.mesh import PlanReason
from megatron_trainer.channel import CheckpointProblem, CheckpointSaved, Progress, WorkerStatus
from megatron_trainer.worker.checkpoint import ENV_WRITER_GATE
from megatron_trainer.worker.checkpoint_files import MANIFEST, checkpoint_dir, complete_steps, verify_files

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ITERS = 24


def test_a_suspend_plan_saves_the_step_reached_reports_a_failure_and_trains_on_after_it(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    root, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    spec = make_spec(spares=0, replicas=1, min_replicas=1, train_iters=ITERS)
    spec = spec.model_copy(update={"checkpoint": CheckpointSpec(path=str(root), interval_steps=1000)})
    cluster = make_cluster(spec, tmp_path / "run", {ENV_WRITER_GATE: str(gate)})
    cluster.boot(["a"])
    cluster.assign(cluster.plan(["a"]))
    cluster.wait_steps(["a"], 2)
    boundary = max(w.last_step() for w in cluster.workers(["a"])) + 6
    (gate / str(boundary)).write_text("fail")  # the storage fails the first attempt
    cluster.assign(cluster.plan(["a"], boundary, reason=PlanReason.SUSPEND))

    for w in cluster.workers(["a"]):
        wait_for(lambda w=w: w.of_type(CheckpointProblem), 120, f"{w.name} to report the failed save")
        problem = w.of_type(CheckpointProblem)[0]
        assert (problem.kind, problem.step, problem.epoch) == ("failed", boundary, 2), problem
        wait_for(
            lambda w=w: any(m.detail.startswith("suspended") for m in w.of_type(WorkerStatus)),
            60,
            f"{w.name} to wait after the save",
        )
        assert w.of_type(CheckpointSaved) == [] and w.last_step() == boundary
    assert complete_steps(root) == []

    (gate / str(boundary)).write_text("")  # the storage works again: the operator's retry
    cluster.assign(cluster.plan(["a"], boundary, reason=PlanReason.SUSPEND))
    for w in cluster.workers(["a"]):
        wait_for(lambda w=w: w.of_type(CheckpointSaved), 120, f"{w.name} to report the checkpoint")
        saved = w.of_type(CheckpointSaved)[0]
        assert (saved.step, saved.epoch) == (boundary, 3), saved
        assert w.last_step() == boundary
        assert [s.state for s in w.of_type(WorkerStatus)][-1] == "reconfiguring"  # waiting, holding its state
    assert complete_steps(root) == [boundary]
    manifest = json.loads((checkpoint_dir(root, boundary) / MANIFEST).read_text())
    assert manifest["step"] == boundary and manifest["epoch"] == 3
    verify_files(checkpoint_dir(root, boundary), manifest, manifest["files"])

    cluster.assign(cluster.plan(["a"], boundary, reason=PlanReason.RESUME))  # the suspension withdrawn
    cluster.wait_succeeded(["a"])
    losses = cluster.losses(["a"])
    assert sorted(losses) == list(range(1, ITERS + 1))
    trained_after = {p.step for w in cluster.workers(["a"]) for p in w.of_type(Progress) if p.epoch == 4}
    assert min(trained_after) == boundary + 1, sorted(trained_after)
