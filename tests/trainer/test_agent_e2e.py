"""End to end: three agents on loopback addresses running the real Megatron-Core workers
(tiny GPT, CPU, gloo), the test process playing the operator.

Scenario (marked slow; about a minute on 2 CPU cores):
- pods A and B train as two data-parallel replicas (plan epoch 1, store on A); pod C is a hot
  spare whose worker is up (Hello) but holds no process group;
- /v1/state and the heartbeats show epoch 1 and rising steps on A and B;
- B's worker is SIGKILLed mid-training: B's agent reports its own failure and exits; A's worker
  sees the collective fail and A reports the failed collective (naming B when the worker can tell);
- the operator (the test) pushes epoch 2, which promotes C into B's ranks with its state from A
  (a DP peer) and resumes at A's last completed step; A and C train again in epoch 2, and the
  heartbeats and /v1/state show it, with A's reconfiguration phases recorded in its metrics.
"""

from __future__ import annotations

import importlib.util
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_harness import AgentProcess, RecordingOperator, make_plan, make_spec, running_agents, wait_for

from megatron_contract.agent import AgentState
from megatron_contract.mesh import PlanReason, StateSource, StateSourceKind

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron_trainer.worker.__main__") is None,
        reason="the real worker (megatron_trainer.worker) is not in this checkout yet",
    ),
]

# Small enough for 2 shared CPU cores; steps slow enough that a kill lands mid-training.
SPEC = make_spec(
    replicas=2,
    spares=1,
    global_batch=4,
    train_iters=10_000,
    collective_timeout=20.0,
    heartbeat_interval=0.5,
)
READY_TIMEOUT = 240.0  # three workers import torch and megatron-core on 2 shared cores


@pytest.fixture
def operator() -> Iterator[RecordingOperator]:
    recorder = RecordingOperator()
    yield recorder
    recorder.close()


def test_spare_replaces_a_killed_worker(operator: RecordingOperator, tmp_path: Path) -> None:
    env = {"OMP_NUM_THREADS": "1"}  # three processes share two cores
    a, b, c = (
        AgentProcess(name, SPEC, tmp_path, operator_url=operator.url, worker_command=None, extra_env=env)
        for name in ("pod-a", "pod-b", "pod-c")
    )
    with running_agents([a, b, c]):
        for agent in (a, b, c):
            agent.wait_ready(READY_TIMEOUT)

        # -- epoch 1: A and B train, C waits ------------------------------------------------------
        plan1 = make_plan(SPEC, [a.pod, b.pod], epoch=1, store=a.pod)
        for agent in (a, b):
            assert agent.post_plan(plan1)[0] == 200
        for agent in (a, b):
            agent.wait_state(lambda s: s["state"] == "training" and s.get("step", 0) >= 3, 180, "epoch-1 steps")
        operator.wait_report("pod-a", lambda r: r.epoch == 1 and (r.step or 0) >= 3, 10, "epoch-1 steps")
        assert c.state()["state"] == "spare"

        # -- B's worker dies mid-training ---------------------------------------------------------
        victim = b.worker_pid()
        os.kill(victim, signal.SIGKILL)
        own = operator.wait_report("pod-b", lambda r: bool(r.failed_peers), 30, "B reporting its dead worker")
        assert (own.state, own.healthy, own.failed_peers[0].pod) == (AgentState.FAILED, False, "pod-b")
        wait_for(lambda: b.process.poll() is not None, 60, "B's agent to exit")
        assert b.process.returncode == 1
        peer = operator.wait_report(
            "pod-a", lambda r: any(f.epoch == 1 for f in r.failed_peers), 60, "A reporting its failed collective"
        )
        failure = next(f for f in peer.failed_peers if f.epoch == 1)
        # gloo does not say which peer reset the connection; when the worker knows, it must be B.
        assert failure.rank in (None, 1) and failure.pod in (None, "pod-b")
        assert peer.healthy and peer.state is AgentState.RECONFIGURING

        # -- epoch 2: C takes rank 1, state from A ------------------------------------------------
        resume = a.state()["step"]
        plan2 = make_plan(
            SPEC,
            [a.pod, c.pod],
            epoch=2,
            reason=PlanReason.REPLACE,
            resume_step=resume,
            store=a.pod,
            sources={1: StateSource(rank=1, kind=StateSourceKind.PEER, peer_rank=0)},
        )
        for agent in (a, c):
            assert agent.post_plan(plan2)[0] == 200
        for agent in (a, c):
            state = agent.wait_state(
                lambda s: s["epoch"] == 2 and s["state"] == "training" and s.get("step", 0) >= resume + 2,
                180,
                "training again in epoch 2",
            )
            assert state["consumedSamples"] == state["step"] * SPEC.training.global_batch_size
        spare_report = operator.wait_report(
            "pod-c", lambda r: r.epoch == 2 and (r.step or 0) > resume, 10, "C training in epoch 2"
        )
        assert spare_report.workers[0].rank == 1
        metrics = a.metrics()
        assert "megatron_agent_recoveries_total 1.0" in metrics
        assert 'megatron_agent_recovery_phase_seconds_count{phase="rendezvous"}' in metrics
        assert a.state()["lastRecovery"]["epoch"] == 2
