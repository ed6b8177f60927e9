"""Real worker processes (torch.distributed on gloo, Megatron-Core GPT, TP=2) recovering in place.

The test process plays agent and operator (see ``worker_harness``). Scenarios:

- a failure-free run of 2 pods x 2 workers (DP=2, TP=2) gives the reference loss of every step;
- SIGKILL of one worker mid-step with a spare pod present: the survivors' collectives fail, they
  report it, the spare takes the failed pod's ranks and receives state from its DP peers, and the
  loss of every step equals the failure-free run bit for bit;
- SIGSTOP of one worker (a hang) with a spare: the survivors detect it by their stalled step
  (progress watchdog, long before the collective timeout) and report it, the harness (as
  supervisor) kills the stopped pod, recovery as above, same loss (``test_worker_hangs`` covers
  the detection itself);
- SIGKILL with no spare: the data-parallel degree shrinks to 1 with the global batch unchanged,
  then a returning pod grows it back to 2; every sample of every step is consumed exactly once;
- SIGKILL of the only replica (no DP peer holds its state): the spare loads the newest complete
  distributed checkpoint, redoes the steps after it, and every loss equals the failure-free run;
- one rank stalls after a step's collectives, before its optimizer update (DELAY at
  ``beforeUpdate``): the watchdog aborts its step while its TP partner and DP peer commit it, so the
  survivors of one DP group hold different steps. A plan keeping all four survivors recovers in
  place: the rank behind receives its DP peer's state, every rank resumes at the newer step with
  bit-identical state, no committed step is redone, and every loss equals the failure-free run.
  Stalled on a rank that logs its replica's samples (TP rank 0), that step's share is logged once
  it is known committed: every step's samples exactly once.

Each worker is a full process that is never restarted: survivors reconfigure in place.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from worker_harness import (
    MakeCluster,
    WorkerCluster,
    failure_free_losses,
    fault_env,
    make_spec,
    peer_sources,
    wait_for,
)

from localcluster.chaos import check_history, read_samples
from megatron_contract.job import CheckpointSpec
from megatron_contract.mesh import PlanReason, StateSource, StateSourceKind
from megatron_trainer.channel import CollectiveFailed, PhaseTimes, Progress, WorkerStatus
from megatron_trainer.faults import Fault, FaultPlan, InjectionPoint
from megatron_trainer.worker.checkpoint import newest_complete

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TRAIN_ITERS = 8
FAULT_STEP = 3  # the step in progress when the fault fires (steps 0..2 are complete)
FAULT_RANK = 1  # tp rank 1 of replica 0, in pod "a"


def fault_mid_step(tmp_path: Path, fault: Fault) -> dict[str, str]:
    """``fault`` for worker FAULT_RANK in step FAULT_STEP."""
    return fault_env(tmp_path, FaultPlan().fail_at(rank=FAULT_RANK, step=FAULT_STEP, fault=fault))


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Loss of every step of a failure-free run with the same seed and mesh."""
    return failure_free_losses(make_spec(train_iters=TRAIN_ITERS), tmp_path_factory.mktemp("reference"))


def start_with_spare(cluster: WorkerCluster) -> None:
    cluster.boot(["a", "b", "s"])
    cluster.assign(cluster.plan(["a", "b"]))  # "s" is not a member: it stays a warm spare


def test_sigkill_with_spare_recovers_with_identical_loss(
    tmp_path: Path, make_cluster: MakeCluster, reference_losses: dict[int, float]
) -> None:
    cluster = make_cluster(
        make_spec(spares=1, train_iters=TRAIN_ITERS), tmp_path, fault_mid_step(tmp_path, Fault.SIGKILL)
    )
    start_with_spare(cluster)
    cluster.fail_pod_on_injected_kill("a", FAULT_RANK, 120, survivors=["b"])
    resume = cluster.replace_with_spare("s", survivor="b")
    assert resume == FAULT_STEP, "survivors must hold exactly the steps completed before the fault"
    cluster.wait_succeeded(["s", "b"])

    losses = cluster.losses(["a", "b", "s"])
    assert losses == reference_losses  # bit-identical, every step including the redone one
    spare = cluster.pods["s"][0]
    # Warm and idle through epoch 1, promoted in epoch 2 without a restart.
    assert spare.states() == ["spare", "spare", "reconfiguring", "training", "succeeded"]
    assert [m.epoch for m in spare.of_type(WorkerStatus)][1:] == [1, 2, 2, 2]
    phases = [p for p in cluster.phase_times() if p.epoch == 2]
    assert len(phases) == 4
    for p in phases:
        assert {"rendezvous", "rebuild", "restore", "verify", "first_step"} <= set(p.phases)
    survivor_phases = [m for w in cluster.pods["b"] for m in w.of_type(PhaseTimes) if m.epoch == 2]
    assert all("abort" in p.phases and "detected_at_unix" in p.phases for p in survivor_phases)


def test_sigstop_with_spare_detected_by_progress(
    tmp_path: Path, make_cluster: MakeCluster, reference_losses: dict[int, float]
) -> None:
    spec = make_spec(spares=1, train_iters=TRAIN_ITERS, collective_timeout=8.0)
    cluster = make_cluster(spec, tmp_path, fault_mid_step(tmp_path, Fault.SIGSTOP))
    start_with_spare(cluster)
    hung = cluster.pods["a"][FAULT_RANK]
    # Everyone else notices on their own (a stalled step, then the cascade of closed connections).
    cluster.wait_failed_reports(["b"], epoch=1)
    partner = cluster.pods["a"][0]
    wait_for(lambda: partner.of_type(CollectiveFailed), 60, "the hung worker's TP partner to report")
    assert not hung.eof.is_set() and hung.process.poll() is None, "a stopped worker is alive but silent"
    assert not hung.of_type(CollectiveFailed)
    cluster.kill_pod("a")  # the supervisor kills the hung worker (SIGKILL ends a stopped process)
    assert hung.process.returncode == -signal.SIGKILL
    resume = cluster.replace_with_spare("s", survivor="b")
    assert resume == FAULT_STEP
    cluster.wait_succeeded(["s", "b"])
    assert cluster.losses(["a", "b", "s"]) == reference_losses
    reasons = [m.reason for w in cluster.pods["b"] for m in w.of_type(CollectiveFailed)]
    assert reasons and all(r for r in reasons)


def test_shrink_without_spare_then_grow_counts_every_sample_once(tmp_path: Path, make_cluster: MakeCluster) -> None:
    iters = 12
    spec = make_spec(spares=0, replicas=2, min_replicas=1, train_iters=iters)
    cluster = make_cluster(spec, tmp_path, fault_mid_step(tmp_path, Fault.SIGKILL))
    # Pod "c" is the capacity that returns later. It boots now only because a CPU worker warms up
    # in ~20 s, longer than this whole tiny job; no plan names it until the growth below.
    cluster.boot(["a", "b", "c"])
    cluster.assign(cluster.plan(["a", "b"]), ["a", "b"])
    cluster.fail_pod_on_injected_kill("a", FAULT_RANK, 120, survivors=["b"])

    # Shrink: replica 1 (pod b) carries on alone with the whole global batch.
    resume = max(w.last_step() for w in cluster.workers(["b"]))
    assert resume == FAULT_STEP
    shrink = cluster.plan(["b"], resume_step=resume, reason=PlanReason.SHRINK)
    assert shrink.sizes.dp == 1 and shrink.batch.micro_batches_per_replica == [8]
    cluster.assign(shrink, ["b"])
    cluster.wait_steps(["b"], FAULT_STEP + 2)

    # Grow: the returned pod joins at a step boundary b has not reached yet.
    boundary = max(w.last_step() for w in cluster.workers(["b"])) + 2
    assert boundary < iters
    grow = cluster.plan(
        ["b", "c"], resume_step=boundary, reason=PlanReason.GROW, sources=peer_sources(spec, [2, 3], [0, 1])
    )
    cluster.assign(grow, ["b", "c"])
    cluster.wait_succeeded(["b", "c"])

    records = cluster.sample_records()
    by_step: dict[int, list[int]] = {}
    epochs_of_step: dict[int, set[int]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).extend(r["samples"])
        epochs_of_step.setdefault(r["step"], set()).add(r["epoch"])
    assert sorted(by_step) == list(range(iters)), "every step committed exactly once"
    G = spec.training.global_batch_size
    for step, samples in by_step.items():
        assert sorted(samples) == list(range(step * G, (step + 1) * G)), f"step {step} consumed {sorted(samples)}"
    all_samples = [i for s in by_step.values() for i in s]
    assert len(all_samples) == len(set(all_samples)) == iters * G
    assert all(len(e) == 1 for e in epochs_of_step.values()), "no step is committed in two epochs"
    assert epochs_of_step[FAULT_STEP] == {2} and epochs_of_step[boundary - 1] == {2}
    assert epochs_of_step[boundary] == {3}
    # The shrunk replica took all 8 micro-batches per step; after growth each takes 4.
    assert {len(r["samples"]) for r in records if r["epoch"] == 2} == {G}
    assert {len(r["samples"]) for r in records if r["epoch"] == 3} == {G // 2}
    losses = cluster.losses(["b", "c"])
    assert sorted(losses) == list(range(1, iters + 1))


def test_lost_only_replica_restores_from_the_checkpoint_with_identical_loss(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    iters, fault_step, interval = 8, 5, 2  # checkpoints after steps 2 and 4; the fault hits step 5
    spec = make_spec(spares=1, replicas=1, min_replicas=1, train_iters=iters)
    # Synchronous saves: both checkpoints exist before the fault (an asynchronous save of step 2
    # still being written at step 4 would skip that one; test_worker_checkpoints covers those).
    checkpoints = CheckpointSpec(path=str(tmp_path / "ckpt"), interval_steps=interval, keep=2, async_save=False)
    spec = spec.model_copy(update={"checkpoint": checkpoints})

    reference = make_cluster(spec.model_copy(update={"checkpoint": None}), tmp_path / "reference")
    reference.boot(["r"])
    reference.assign(reference.plan(["r"]))
    reference.wait_succeeded(["r"])
    expected = reference.losses(["r"])

    env = fault_env(tmp_path, FaultPlan().fail_at(rank=FAULT_RANK, step=fault_step, fault=Fault.SIGKILL))
    cluster = make_cluster(spec, tmp_path / "faulty", env)
    cluster.boot(["a", "s"])
    cluster.assign(cluster.plan(["a"]), ["a"])
    cluster.fail_pod_on_injected_kill("a", FAULT_RANK, 180)
    assert max(w.last_step() for w in cluster.workers(["a"])) == fault_step
    newest = newest_complete(tmp_path / "ckpt")
    assert newest == 4, f"checkpoints: {sorted(p.name for p in (tmp_path / 'ckpt').iterdir())}"

    # The operator's fallback: nobody holds the state, so every rank loads the newest checkpoint.
    sources = {
        r: StateSource(rank=r, kind=StateSourceKind.CHECKPOINT, checkpoint_step=newest)
        for r in range(spec.gpus_per_pod)
    }
    plan = cluster.plan(["s"], resume_step=newest, reason=PlanReason.REPLACE, sources=sources)
    cluster.assign(plan, ["s"])
    cluster.wait_succeeded(["s"])
    # Steps after the checkpoint were done twice (by a, then by s): losses() requires both agree.
    assert cluster.losses(["a", "s"]) == expected
    redone = {p.step for w in cluster.workers(["s"]) for p in w.of_type(Progress)}
    assert min(redone) == newest + 1 and max(redone) == iters


# Rank 1 is TP rank 1 of replica 0, rank 0 TP rank 0 (which logs the replica's samples); the DP peer
# of either is the same TP rank of replica 1 (rank + 2).
@pytest.mark.parametrize("stalled", [FAULT_RANK, 0])
def test_survivor_a_step_behind_its_dp_peer_catches_up_in_place(
    tmp_path: Path, make_cluster: MakeCluster, reference_losses: dict[int, float], stalled: int
) -> None:
    # Past the step limit however slow the loaded CPU (max(1 s, 3 x the epoch's median step), capped
    # at the collective timeout): the watchdog calls it a hang and aborts the step.
    timeout = 8.0
    peer = stalled + 2
    stall = FaultPlan().fail_at(
        rank=stalled, step=FAULT_STEP, fault=Fault.DELAY, seconds=timeout + 4, point=InjectionPoint.BEFORE_UPDATE
    )
    cluster = make_cluster(
        make_spec(train_iters=TRAIN_ITERS, collective_timeout=timeout), tmp_path, fault_env(tmp_path, stall)
    )
    cluster.boot(["a", "b"])
    cluster.assign(cluster.plan(["a", "b"]))
    cluster.wait_failed_reports(["a", "b"], epoch=1)
    behind = cluster.pods["a"][stalled]
    ahead = [w for w in cluster.workers() if w is not behind]
    assert behind.last_step() == FAULT_STEP, "the stalled rank's step was aborted before its optimizer update"
    assert [w.last_step() for w in ahead] == [FAULT_STEP + 1] * 3, "its peers committed that step"

    # The operator re-plans the same survivors, each keeping its state; its resumeStep lags.
    cluster.assign(cluster.plan(["a", "b"], resume_step=FAULT_STEP, reason=PlanReason.REPLACE))
    cluster.wait_succeeded(["a", "b"])

    assert cluster.losses(["a", "b"]) == reference_losses
    for w in cluster.workers():
        redone = [p.step for p in w.of_type(Progress) if p.epoch == 2]
        assert redone == list(range(FAULT_STEP + 2, TRAIN_ITERS + 1)), f"{w.name} redid or skipped a step"
        assert "failed" not in w.states()
    entered = {}
    for w in cluster.workers():
        found = re.search(
            r"epoch 2 rank (\d+) .*: state from self \((\d+) bytes moved\), step (\d+), checksum ([0-9a-f]+)",
            w.log_path.read_text(),
        )
        assert found, f"{w.name} logged no restored state:\n{w.log_tail()}"
        rank, moved, step, checksum = found.groups()
        entered[int(rank)] = (int(moved) > 0, int(step), checksum)
    assert {r: e[1] for r, e in entered.items()} == dict.fromkeys(range(4), FAULT_STEP + 1)
    # Only the stalled rank's DP group moved state (the peer sent to it); its members hold the same bits.
    assert {r: e[0] for r, e in entered.items()} == {r: r in (stalled, peer) for r in range(4)}
    assert entered[stalled][2] == entered[peer][2]
    held = f"rank {stalled} holds step {FAULT_STEP}, its DP peer {peer} holds step {FAULT_STEP + 1}"
    assert held in behind.log_path.read_text()
    problems, history, redone = check_history(
        read_samples(cluster.sample_dir), TRAIN_ITERS, cluster.spec.training.global_batch_size, victims=set()
    )
    assert problems == [] and redone == [], (problems, redone)
    assert all(epoch == (1 if step <= FAULT_STEP else 2) for step, epoch in history.items()), history
