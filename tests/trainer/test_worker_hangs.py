"""Hang detection by progress, with real worker processes (torch.distributed on gloo, Megatron-Core
GPT, TP=2, DP=2; the test plays agent and operator through ``worker_harness``).

Scenarios, all with ``collectiveTimeoutSeconds`` = 30 s and the default detection settings (a step
stalled past max(floor, 3 x the epoch's median step) is a hang; the floor is 1 s, at least 5 s on
gloo, whose CPU steps jitter by seconds on shared cores):

- a SIGSTOPped rank mid-step: every survivor reports the hang within a few seconds, not at the
  collective timeout; the harness kills the stopped pod, the spare takes its ranks, and training
  finishes with every step committed once. The same scenario with progress detection turned off
  (``hangDetectionStepMultiple: 0``) waits out the collective timeout: the comparison is printed;
- a slow first step of the epoch (one rank sleeps 8 s mid-step in step 0): no report, no re-mesh;
- a slow data read (one rank's samples take 8 s to read, at step 4): no report, no re-mesh;
- a slow checkpoint save (a synchronous save, one rank 8 s slower than the others after the save's
  collectives, so they wait for it in the next step): no report.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from worker_harness import MakeCluster, fault_env, fired, make_spec, wait_for

from megatron_contract.job import CheckpointSpec
from megatron_trainer.channel import CollectiveFailed, Progress
from megatron_trainer.faults import Fault, FaultPlan, InjectionPoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

COLLECTIVE_TIMEOUT = 30.0
TRAIN_ITERS = 8
HANG_STEP = 5  # steps 1-4 set the limit (step 0 is the epoch's warm-up)
HANG_RANK = 1  # tp rank 1 of replica 0, in pod "a"
SLOW_SECONDS = 8.0  # past the step limit (the 5 s gloo floor: CPU steps of the tiny model take ~0.2-0.9 s)


def hang_to_next_step(tmp_path: Path, make_cluster: MakeCluster, detection: dict[str, float]) -> tuple[float, float]:
    """SIGSTOP one rank with a spare present; returns (fault -> last survivor's report, fault ->
    first committed step of the next epoch), in seconds."""
    spec = make_spec(spares=1, train_iters=TRAIN_ITERS, collective_timeout=COLLECTIVE_TIMEOUT, detection=detection)
    faults = FaultPlan().fail_at(rank=HANG_RANK, step=HANG_STEP, fault=Fault.SIGSTOP)
    cluster = make_cluster(spec, tmp_path, fault_env(tmp_path, faults))
    cluster.boot(["a", "b", "s"])
    cluster.assign(cluster.plan(["a", "b"]))
    stopped_at = wait_for(lambda: fired(tmp_path), 120, "the SIGSTOP")[0]["time"]
    survivors = [*cluster.pods["b"], cluster.pods["a"][0]]
    for w in survivors:
        wait_for(lambda w=w: w.of_type(CollectiveFailed), 2 * COLLECTIVE_TIMEOUT, f"{w.name} to report")
    reported = time.time() - stopped_at  # polled every 20 ms: late by at most that
    reasons = [m.reason for w in survivors for m in w.of_type(CollectiveFailed)]
    cluster.kill_pod("a")  # the supervisor kills the stopped worker
    resume = cluster.replace_with_spare("s", survivor="b")
    assert resume == HANG_STEP, "the survivors hold exactly the steps completed before the hang"
    wait_for(
        lambda: all(any(p.epoch == 2 for p in w.of_type(Progress)) for w in cluster.workers(["s", "b"])),
        120,
        "the first step of epoch 2",
    )
    committed = time.time() - stopped_at
    cluster.wait_succeeded(["s", "b"])
    assert sorted(cluster.losses(["a", "b", "s"])) == list(range(1, TRAIN_ITERS + 1))
    print(f"detection {detection or 'default'}: reasons {reasons[:2]}")
    return reported, committed


def test_sigstop_is_detected_by_progress_not_by_the_collective_timeout(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    reported, committed = hang_to_next_step(tmp_path / "progress", make_cluster, {})
    print(f"progress detection: SIGSTOP -> survivors reported {reported:.2f}s, -> next step {committed:.2f}s")
    # max(1 s, 3 x step) plus scheduling slack on two shared CPU cores; far from the 30 s timeout.
    assert reported < 10, f"hang reported {reported:.1f}s after the SIGSTOP (collective timeout 30 s)"


def test_sigstop_without_progress_detection_waits_for_the_collective_timeout(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    reported, committed = hang_to_next_step(tmp_path / "timeout", make_cluster, {"hang_detection_step_multiple": 0})
    print(f"collective timeout: SIGSTOP -> survivors reported {reported:.2f}s, -> next step {committed:.2f}s")
    assert reported >= COLLECTIVE_TIMEOUT


SLOW_PHASES = {
    "first-step": (0, InjectionPoint.MID_STEP, HANG_RANK),
    "data-read": (4, InjectionPoint.DATA_READ, 2),
    "checkpoint-save": (4, InjectionPoint.CHECKPOINT, 3),
}


@pytest.mark.parametrize("case", list(SLOW_PHASES))
def test_slow_phase_is_not_a_hang(tmp_path: Path, make_cluster: MakeCluster, case: str) -> None:
    step, point, rank = SLOW_PHASES[case]
    spec = make_spec(train_iters=TRAIN_ITERS, collective_timeout=COLLECTIVE_TIMEOUT)
    if point is InjectionPoint.CHECKPOINT:
        # Synchronous: the save itself takes seconds on CPU, and one rank is slower still.
        checkpoints = CheckpointSpec(path=str(tmp_path / "ckpt"), interval_steps=step, keep=1, async_save=False)
        spec = spec.model_copy(update={"checkpoint": checkpoints})
    faults = FaultPlan().fail_at(rank=rank, step=step, fault=Fault.DELAY, seconds=SLOW_SECONDS, point=point)
    cluster = make_cluster(spec, tmp_path, fault_env(tmp_path, faults))
    cluster.boot(["a", "b"])
    cluster.assign(cluster.plan(["a", "b"]))
    cluster.wait_succeeded(["a", "b"])
    assert [f["point"] for f in fired(tmp_path)] == [point.value], "the delay fired once"
    reports = [m.reason for w in cluster.workers() for m in w.of_type(CollectiveFailed)]
    assert not reports, f"{case}: false hang reports {reports}"
    assert all(w.states().count("reconfiguring") == 1 for w in cluster.workers()), "no re-mesh after the start"
    assert sorted(cluster.losses(["a", "b"])) == list(range(1, TRAIN_ITERS + 1))
    steps = [p.step_time_seconds for w in cluster.workers() for p in w.of_type(Progress)]
    slowest = max(steps)
    print(f"{case}: slowest step {slowest:.2f}s, median {sorted(steps)[len(steps) // 2]:.3f}s")
