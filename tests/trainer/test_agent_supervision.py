"""Worker supervision by a real agent process (stand-in workers that speak the real protocol).

Scenarios:
- a worker that crashes while training is noticed at once: the next heartbeat says failed and
  unhealthy and names this pod and the worker's rank as a failed peer; with no restart left the
  agent shuts down and exits 1, leaving no worker behind;
- with a restart budget the crashed worker is replaced by a fresh one that waits as a spare (it
  does not rejoin the broken epoch) and trains again when a newer plan names the pod;
- a SIGSTOPped (hung) training worker is killed after the hang timeout (never before), the kill
  is reported and counted, and the slot gets a fresh worker;
- when every worker finishes trainIters the agent reports succeeded and exits 0;
- SIGTERM: the agent asks its workers to finish and exits 0;
- a worker whose restore found no usable checkpoint: the report says which checkpoint was
  rejected last and that the restore gave up, besides the failure.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from agent_harness import (
    AgentProcess,
    PodAddress,
    RecordingOperator,
    make_plan,
    make_spec,
    process_gone,
    running_agents,
    wait_for,
)

from megatron_contract.agent import AgentState

OTHER = PodAddress("pod-b", "127.0.0.9")
HANG_TIMEOUT = 1.5


def test_crashed_worker_is_reported_and_the_agent_exits(operator: RecordingOperator, tmp_path: Path) -> None:
    spec = make_spec()
    agent = AgentProcess("pod-a", spec, tmp_path, operator_url=operator.url, extra_env={"AGENT_FAKE_EXIT_AT_STEP": "4"})
    with running_agents([agent]):
        agent.wait_ready()
        pid = agent.worker_pid()
        assert agent.post_plan(make_plan(spec, [agent.pod, OTHER]))[0] == 200
        report = operator.wait_report("pod-a", lambda r: bool(r.failed_peers), 20, "the crash reported")
        assert (report.state, report.healthy) == (AgentState.FAILED, False)
        failure = report.failed_peers[0]
        assert (failure.epoch, failure.rank, failure.pod) == (1, 0, "pod-a")
        assert "exited with code 3" in failure.reason
        assert report.workers[0].alive is False
        wait_for(lambda: agent.process.poll() is not None, 30, "the agent to exit")
        assert agent.process.returncode == 1
        assert process_gone(pid)


def test_a_restore_that_gave_up_is_reported(operator: RecordingOperator, tmp_path: Path) -> None:
    spec = make_spec()
    agent = AgentProcess(
        "pod-a", spec, tmp_path, operator_url=operator.url, extra_env={"AGENT_FAKE_CHECKPOINT_UNUSABLE": "1"}
    )
    with running_agents([agent]):
        agent.wait_ready()
        assert agent.post_plan(make_plan(spec, [agent.pod, OTHER]))[0] == 200
        report = operator.wait_report("pod-a", lambda r: r.checkpoint_unusable is not None, 20, "the restore reported")
        assert report.checkpoint_unusable == "fake: no usable checkpoint at or before step 8"
        assert report.checkpoint_rejected == "step 6: fake: damaged"
        report = operator.wait_report("pod-a", lambda r: bool(r.failed_peers), 20, "the failure reported")
        assert report.state is AgentState.FAILED and report.checkpoint_unusable is not None


def test_crashed_worker_is_restarted_as_a_spare_and_trains_again(operator: RecordingOperator, tmp_path: Path) -> None:
    spec = make_spec()
    agent = AgentProcess(
        "pod-a",
        spec,
        tmp_path,
        operator_url=operator.url,
        extra_env={"AGENT_FAKE_EXIT_AT_STEP": "4", "MEGATRON_WORKER_MAX_RESTARTS": "1"},
    )
    with running_agents([agent]):
        agent.wait_ready()
        first_pid = agent.worker_pid()
        assert agent.post_plan(make_plan(spec, [agent.pod, OTHER]))[0] == 200
        operator.wait_report("pod-a", lambda r: not r.healthy and bool(r.failed_peers), 20, "the crash reported")
        state = agent.wait_state(
            lambda s: s["state"] == "spare" and s["workers"][0]["generation"] == 1, 30, "a fresh worker waiting"
        )
        assert state["epoch"] == 1 and state["workers"][0]["pid"] != first_pid
        metrics = agent.metrics()
        assert "megatron_agent_worker_restarts_total 1.0" in metrics
        assert 'megatron_agent_worker_exits_total{outcome="failed"} 1.0' in metrics
        # The old epoch stays broken for the new worker; a newer plan brings it back.
        assert agent.post_plan(make_plan(spec, [agent.pod, OTHER], epoch=2, resume_step=10))[0] == 200
        agent.wait_state(lambda s: s["state"] == "training" and s.get("step", 0) > 12, 20, "training in epoch 2")
        assert agent.process.poll() is None


def test_hung_worker_is_killed_after_the_timeout(operator: RecordingOperator, tmp_path: Path) -> None:
    spec = make_spec()
    agent = AgentProcess(
        "pod-a",
        spec,
        tmp_path,
        operator_url=operator.url,
        extra_env={"MEGATRON_WORKER_MAX_RESTARTS": "1", "MEGATRON_WORKER_HANG_TIMEOUT_SECONDS": str(HANG_TIMEOUT)},
    )
    with running_agents([agent]):
        agent.wait_ready()
        pid = agent.worker_pid()
        assert agent.post_plan(make_plan(spec, [agent.pod, OTHER]))[0] == 200
        agent.wait_state(lambda s: s.get("step", 0) >= 3, 20, "training")
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        report = operator.wait_report(
            "pod-a", lambda r: any("hung" in f.reason for f in r.failed_peers), 20, "the hang reported"
        )
        reported_after = time.monotonic() - stopped_at
        # The deadline runs from the worker's last message, up to one stand-in step (0.05 s) before the stop.
        assert reported_after >= HANG_TIMEOUT - 0.05, (
            f"killed {reported_after:.2f}s after the stop, limit {HANG_TIMEOUT}s"
        )
        assert (report.failed_peers[0].rank, report.failed_peers[0].pod) == (0, "pod-a")
        wait_for(lambda: process_gone(pid), 10, "the hung worker to be gone")
        state = agent.wait_state(lambda s: s["workers"][0]["generation"] == 1, 30, "a fresh worker")
        assert state["workers"][0]["pid"] != pid
        assert 'megatron_agent_worker_kills_total{reason="hung"} 1.0' in agent.metrics()


def test_finished_training_exits_zero(operator: RecordingOperator, tmp_path: Path) -> None:
    spec = make_spec(train_iters=5, gpus_per_pod=2, tp=2)
    agent = AgentProcess("pod-a", spec, tmp_path, operator_url=operator.url)
    with running_agents([agent]):
        agent.wait_ready()
        pids = [agent.worker_pid(0), agent.worker_pid(1)]
        assert agent.post_plan(make_plan(spec, [agent.pod, OTHER]))[0] == 200
        wait_for(lambda: agent.process.poll() is not None, 30, "the agent to exit")
        assert agent.process.returncode == 0
        last = operator.reports_from("pod-a")[-1]
        assert (last.state, last.step, last.healthy) == (AgentState.SUCCEEDED, 5, True)
        assert all(process_gone(pid) for pid in pids)


def test_sigterm_stops_workers_and_exits_zero(tmp_path: Path) -> None:
    agent = AgentProcess("pod-a", make_spec(), tmp_path)
    with running_agents([agent]):
        agent.wait_ready()
        pid = agent.worker_pid()
        assert agent.stop() == 0
        assert process_gone(pid)
        assert "exited with 0" in agent.log()
