"""Heartbeats from a real agent process to a recording endpoint that plays the operator.

Scenarios:
- before any plan the agent reports epoch 0, state spare, healthy, with the job's bearer token
  (the endpoint refuses anything else and counts it);
- after a plan: epoch, state training, rising step and consumed samples, the worker's global rank;
- a worker's CollectiveFailed reaches the operator at once as a failed peer naming the peer's
  rank and pod (resolved from the plan), and stops being sent once acknowledged;
- the epoch in the operator's answer is recorded (an agent that missed a push shows it);
- the next plan resumes training from its resume step;
- a worker's completed checkpoint is reported (the operator's fallback when no peer holds a shard);
- the buddy copies held: the steps every local worker holds (local rank 1 never holds a multiple
  of 5, local rank 0 does), of the held epoch only (after a plan that resumes at step 100, only
  steps after it), none before the first plan.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from agent_harness import (
    JOB_UID,
    AgentProcess,
    PodAddress,
    RecordingOperator,
    make_plan,
    make_spec,
    running_agents,
    wait_for,
)

from megatron_contract.agent import AgentState
from megatron_contract.mesh import PlanReason

SPEC = make_spec(replicas=2, heartbeat_interval=0.2)
OTHER = PodAddress("pod-b", "127.0.0.9")
FAIL_AT_STEP = 20


def test_heartbeats_carry_epoch_step_and_failed_peers(operator: RecordingOperator, tmp_path: Path) -> None:
    agent = AgentProcess(
        "pod-a",
        SPEC,
        tmp_path,
        operator_url=operator.url,
        extra_env={"AGENT_FAKE_COLLECTIVE_FAIL_AT_STEP": str(FAIL_AT_STEP), "AGENT_FAKE_PEER_RANK": "1"},
    )
    with running_agents([agent]):
        first = operator.wait_report("pod-a", lambda r: r.state is AgentState.SPARE, 30, "state spare")
        assert (first.epoch, first.healthy, first.step, first.job_uid) == (0, True, None, JOB_UID)
        assert first.workers[0].local_rank == 0 and first.workers[0].rank is None

        status, _ = agent.post_plan(make_plan(SPEC, [agent.pod, OTHER], epoch=1))
        assert status == 200
        training = operator.wait_report(
            "pod-a", lambda r: r.state is AgentState.TRAINING and (r.step or 0) >= 3, 30, "training steps"
        )
        assert training.epoch == 1 and training.workers[0].rank == 0
        assert training.consumed_samples == training.step * SPEC.training.global_batch_size  # type: ignore[operator]
        assert training.loss is not None and training.tokens_per_second and training.step_time_seconds

        failed = operator.wait_report("pod-a", lambda r: bool(r.failed_peers), 30, "a failed peer")
        peer = failed.failed_peers[0]
        assert (peer.epoch, peer.rank, peer.pod) == (1, 1, "pod-b")
        assert "peer reset" in peer.reason and peer.detected_at is not None
        assert failed.state is AgentState.RECONFIGURING and failed.healthy

        # Cleared once acknowledged: the reports that follow stop carrying it. (A report whose answer
        # came too late for the agent is sent again, so "exactly once" would be a race on a busy host.)
        def quiet_after_failure() -> bool:
            reports = operator.reports_from("pod-a")
            last_with = max(i for i, r in enumerate(reports) if r.failed_peers)
            return len(reports) - last_with > 3

        wait_for(quiet_after_failure, 30, "three reports without the failed peer after the last one with it")
        with_failure = [r for r in operator.reports_from("pod-a") if r.failed_peers]
        assert all(r.failed_peers == [peer] for r in with_failure)  # the same entry, never a duplicate

        operator.epoch = 2  # the operator has moved on: the agent shows it missed a push
        agent.wait_state(lambda s: s["operatorEpoch"] == 2, 10, "the operator's epoch recorded")

        plan = make_plan(SPEC, [agent.pod, OTHER], epoch=2, reason=PlanReason.REPLACE, resume_step=FAIL_AT_STEP)
        assert agent.post_plan(plan)[0] == 200
        resumed = operator.wait_report(
            "pod-a", lambda r: r.epoch == 2 and (r.step or 0) > FAIL_AT_STEP, 30, "steps in epoch 2"
        )
        assert resumed.state is AgentState.TRAINING
        assert min(r.step or 0 for r in operator.reports_from("pod-a") if r.epoch == 2 and r.step) > FAIL_AT_STEP
        assert operator.refused == 0
        # The replace plan's reconfiguration counts as a recovery; the initial one does not.
        assert "megatron_agent_recoveries_total 1.0" in agent.metrics()


def test_heartbeats_carry_the_newest_complete_checkpoint(operator: RecordingOperator, tmp_path: Path) -> None:
    spec = make_spec(replicas=2, heartbeat_interval=0.2, checkpoint={"path": str(tmp_path / "ck"), "intervalSteps": 5})
    agent = AgentProcess("pod-a", spec, tmp_path, operator_url=operator.url)
    with running_agents([agent]):
        operator.wait_report("pod-a", lambda r: r.state is AgentState.SPARE, 30, "state spare")
        assert agent.post_plan(make_plan(spec, [agent.pod, OTHER], epoch=1))[0] == 200
        report = operator.wait_report("pod-a", lambda r: (r.checkpoint_step or 0) >= 25, 30, "checkpoint of step 25")
        assert report.checkpoint_step is not None and report.checkpoint_step % 5 == 0
        # Reports before the first save (the spare's, at least: we waited for one) name no checkpoint.
        early = [r for r in operator.reports_from("pod-a") if r.step is None or r.step < 5]
        assert early, "no report from before the first save was recorded"
        assert all(r.checkpoint_step is None and r.checkpoint_blocking_seconds is None for r in early)
        # Each save blocked the slowest local worker (local rank L: 0.25 + L/100 s), counted once per save.
        slowest = 0.25 + (spec.gpus_per_pod - 1) / 100
        saves = report.checkpoint_step // 5
        assert report.checkpoint_blocking_seconds == pytest.approx(saves * slowest)


def test_heartbeats_carry_the_copies_every_local_worker_holds(operator: RecordingOperator, tmp_path: Path) -> None:
    spec = make_spec(replicas=4, gpus_per_pod=2, tp=2, heartbeat_interval=0.2)
    agent = AgentProcess(
        "pod-a", spec, tmp_path, operator_url=operator.url, extra_env={"AGENT_FAKE_REPLICA_STEPS": "1"}
    )
    with running_agents([agent]):
        operator.wait_report("pod-a", lambda r: r.state is AgentState.SPARE, 30, "state spare")
        assert agent.post_plan(make_plan(spec, [agent.pod, OTHER], epoch=1))[0] == 200
        # After step s each holds s and s-1, rank 1 none of a multiple of 5 (the fake workers' steps
        # drift apart: which steps both hold at a report varies).
        operator.wait_report("pod-a", lambda r: bool(r.replica_steps), 30, "copies held by both workers")
        operator.wait_report("pod-a", lambda r: (r.step or 0) >= 60, 30, "step 60, past twelve multiples of 5")
        resume = 100
        plan = make_plan(spec, [agent.pod, OTHER], epoch=2, reason=PlanReason.REPLACE, resume_step=resume)
        assert agent.post_plan(plan)[0] == 200
        operator.wait_report("pod-a", lambda r: r.epoch == 2 and bool(r.replica_steps), 30, "copies in epoch 2")
    reports = operator.reports_from("pod-a")
    assert all(r.replica_steps == [] for r in reports if r.epoch == 0)
    assert all(s % 5 for r in reports for s in r.replica_steps), "a step that local rank 1 does not hold"
    assert all(s > resume for r in reports if r.epoch == 2 for s in r.replica_steps), "a copy of epoch 1 in epoch 2"
