"""End to end: three agents on loopback addresses running the real Megatron-Core workers
(tiny GPT, CPU, gloo), the test process playing the operator.

Scenarios (marked slow; each about a minute on 2 shared CPU cores):
- pods A and B train as two data-parallel replicas (plan epoch 1, store on A); pod C is a hot
  spare whose workers are up (Hello) but hold no process group;
- /v1/state and the heartbeats show epoch 1 and rising steps on A and B;
- a worker of B fails mid-training, in one of two ways:
  - SIGKILL (TP=1, one worker per pod): B's agent sees the exit at once;
  - SIGSTOP (TP=2, two workers per pod): the stopped worker's Alive messages stop, and B's agent
    kills it within seconds, well before the collective timeout (it cannot report anything itself);
  either way B's agent reports its own failure (unhealthy, its pod and rank) and exits 1, and A's
  workers see their collective fail and A reports it (naming B when the worker can tell);
- the operator (the test) pushes epoch 2, which promotes C into B's ranks with state from A's
  workers (DP peers with the same TP coordinates) and resumes at A's last completed step; A and C
  train again in epoch 2, the heartbeats and /v1/state show it, consumed samples stay
  step x global batch, and A's reconfiguration phases are in its metrics;
- C's agent is SIGKILLed: its workers see EOF on their channels and exit (no orphans).

Buddy copies (two agents, one real worker each, the distributed optimizer, a plan with buddies):
each pod's heartbeats report the steps of the copies its worker holds, newest first, at most two,
the newest one or two steps behind the pod's last (every step is refreshed), and its metrics give
the plan's interval. With a cost budget
(``replicaCostPercent``) both pods' metrics give the one interval their workers agreed on, and the
share of step time it costs by each worker's calibration, within the budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_harness import AgentProcess, RecordingOperator, make_plan, make_spec, process_gone, running_agents, wait_for

from megatron_contract.agent import AgentState
from megatron_contract.job import MegatronJobSpec
from megatron_contract.mesh import (
    MeshPlan,
    OptimizerSourceKind,
    OptimizerStatePlan,
    PlanReason,
    StateSource,
    StateSourceKind,
)

pytestmark = pytest.mark.slow

READY_TIMEOUT = 240.0  # up to six workers import torch and megatron-core on 2 shared cores


@dataclasses.dataclass(frozen=True)
class Case:
    fault: signal.Signals
    tp: int
    collective_timeout: float


CASES = [
    Case(signal.SIGKILL, tp=1, collective_timeout=20.0),
    # The agent kills a stopped worker after twice its progress limit (10 s with the 5 s gloo floor),
    # not at the collective timeout + grace (30 s + 7.5 s).
    Case(signal.SIGSTOP, tp=2, collective_timeout=30.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.fault.name}-tp{c.tp}")
def test_spare_replaces_a_failed_worker(case: Case, operator: RecordingOperator, tmp_path: Path) -> None:
    spec = make_spec(
        replicas=2,
        spares=1,
        tp=case.tp,
        gpus_per_pod=case.tp,
        global_batch=4,
        collective_timeout=case.collective_timeout,
        heartbeat_interval=0.5,
    )
    env = {"OMP_NUM_THREADS": "1"}  # several processes share two cores
    a, b, c = (
        AgentProcess(name, spec, tmp_path, operator_url=operator.url, worker_command=None, extra_env=env)
        for name in ("pod-a", "pod-b", "pod-c")
    )
    with running_agents([a, b, c]):
        for agent in (a, b, c):
            agent.wait_ready(READY_TIMEOUT)

        # -- epoch 1: A and B train, C waits ------------------------------------------------------
        plan1 = make_plan(spec, [a.pod, b.pod], epoch=1, store=a.pod)
        for agent in (a, b):
            assert agent.post_plan(plan1)[0] == 200
        # Six steps: the workers' step limits adapt after the epoch's first step and three recorded
        # ones; a worker stopped before that is found only after the hang timeout.
        for agent in (a, b):
            agent.wait_state(lambda s: s["state"] == "training" and s.get("step", 0) >= 6, 180, "epoch-1 steps")
        operator.wait_report("pod-a", lambda r: r.epoch == 1 and (r.step or 0) >= 6, 10, "epoch-1 steps")
        assert c.state()["state"] == "spare"

        # -- a worker of B fails mid-training -----------------------------------------------------
        victim = b.worker_pid(0)
        failed_at = time.monotonic()
        os.kill(victim, case.fault)
        own = operator.wait_report(
            "pod-b", lambda r: any(f.pod == "pod-b" for f in r.failed_peers), 60, "B reporting its failed worker"
        )
        detected = time.monotonic() - failed_at
        assert (own.state, own.healthy) == (AgentState.FAILED, False)
        failure = next(f for f in own.failed_peers if f.pod == "pod-b")
        assert (failure.epoch, failure.pod, failure.rank) == (1, "pod-b", spec.tp)  # B's first rank
        if case.fault is signal.SIGSTOP:
            assert "hung" in failure.reason
            if "last alive in data" in failure.reason or "last alive in checkpoint" in failure.reason:
                # Stopped inside a data read or a save, which may hold the interpreter lock for long:
                # by design the hang timeout decides (collective timeout + grace, 37.5 s), not the
                # short limit of a stopped step.
                assert detected < 45, f"stopped worker killed after {detected:.1f}s: {failure.reason}"
            else:
                assert detected < 20, f"stopped worker killed after {detected:.1f}s: {failure.reason}"
            print(f"SIGSTOP -> B's agent reported its stopped worker after {detected:.2f}s")
        wait_for(lambda: b.process.poll() is not None, 60, "B's agent to exit")
        assert b.process.returncode == 1
        peer = operator.wait_report(
            "pod-a", lambda r: any(f.epoch == 1 for f in r.failed_peers), 60, "A reporting its failed collective"
        )
        seen = next(f for f in peer.failed_peers if f.epoch == 1)
        # gloo does not say which peer reset the connection; when the worker knows, it must be on B.
        assert seen.pod in (None, "pod-b")
        assert peer.healthy

        # -- epoch 2: C takes B's ranks, state from A's workers -----------------------------------
        resume = a.state()["step"]
        b_ranks = range(spec.tp, 2 * spec.tp)
        plan2 = make_plan(
            spec,
            [a.pod, c.pod],
            epoch=2,
            reason=PlanReason.REPLACE,
            resume_step=resume,
            store=a.pod,
            sources={r: StateSource(rank=r, kind=StateSourceKind.PEER, peer_rank=r - spec.tp) for r in b_ranks},
        )
        pushed_at = time.monotonic()
        for agent in (a, c):
            assert agent.post_plan(plan2)[0] == 200
        c.wait_state(lambda s: s["epoch"] == 2 and s.get("step", 0) > resume, 180, "C's first step in epoch 2")
        first_step = time.monotonic() - pushed_at
        for agent in (a, c):
            state = agent.wait_state(
                lambda s: s["epoch"] == 2 and s["state"] == "training" and s.get("step", 0) >= resume + 2,
                180,
                "training again in epoch 2",
            )
            assert state["consumedSamples"] == state["step"] * spec.training.global_batch_size
        promoted = operator.wait_report(
            "pod-c", lambda r: r.epoch == 2 and (r.step or 0) > resume, 10, "C training in epoch 2"
        )
        assert [w.rank for w in promoted.workers] == list(b_ranks)
        metrics = a.metrics()
        assert "megatron_agent_recoveries_total 1.0" in metrics
        assert 'megatron_agent_recovery_phase_seconds_count{phase="rendezvous"}' in metrics
        assert a.state()["lastRecovery"]["epoch"] == 2
        # Durations only: a timestamp among the phases would make this ~1.8e9.
        last = next(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("megatron_agent_last_recovery_seconds ")
        )
        assert 0 < last < 120, f"last recovery {last}s"
        print(
            f"\n{case.fault.name}: B's agent reported the failure {detected:.2f}s after the fault; "
            f"plan push -> C's first step in epoch 2 seen at {first_step:.2f}s (polling /v1/state); "
            f"A's phases {a.state()['lastRecovery']['phases']}; C's phases {c.state()['lastRecovery']['phases']}"
        )
        # -- the agent dies: its workers see EOF on their channels and exit -------------------------
        orphans = [w["pid"] for w in c.state()["workers"]]
        c.process.kill()
        c.process.wait(timeout=10)
        wait_for(lambda: all(process_gone(pid) for pid in orphans), 60, "C's workers to exit after their agent")


@contextlib.contextmanager
def _two_pods_with_copies(
    operator: RecordingOperator, tmp_path: Path, iters: int, cost_percent: float | None = None
) -> Iterator[tuple[AgentProcess, AgentProcess]]:
    """Two agents of one real worker each, training with the distributed optimizer and buddy copies
    (every step, or under ``cost_percent``), until the block ends."""
    wire = make_spec(replicas=2, spares=0, global_batch=4, train_iters=iters, heartbeat_interval=0.2).to_wire()
    wire["training"]["optimizer"]["distributed"] = True
    wire["checkpoint"] = {"path": str(tmp_path / "ckpt"), "intervalSteps": 1000}
    spec = MegatronJobSpec.model_validate(wire)
    env = {"OMP_NUM_THREADS": "1"}
    a, b = (
        AgentProcess(name, spec, tmp_path, operator_url=operator.url, worker_command=None, extra_env=env)
        for name in ("pod-a", "pod-b")
    )
    with running_agents([a, b]):
        for agent in (a, b):
            agent.wait_ready(READY_TIMEOUT)
        plan = make_plan(spec, [a.pod, b.pod], epoch=1, store=a.pod)
        buddies = OptimizerStatePlan(buddies=True, source=OptimizerSourceKind.INIT, replica_cost_percent=cost_percent)
        changes = {"default_source": StateSourceKind.INIT, "state_sources": [], "optimizer_state": buddies}
        plan = MeshPlan.model_validate(plan.model_dump() | changes)
        for agent in (a, b):
            assert agent.post_plan(plan)[0] == 200
        yield a, b


def test_heartbeats_report_the_buddy_copies_the_workers_hold(operator: RecordingOperator, tmp_path: Path) -> None:
    with _two_pods_with_copies(operator, tmp_path, iters=40) as pods:
        for pod in ("pod-a", "pod-b"):
            operator.wait_report(pod, lambda r: bool(r.replica_steps) and (r.step or 0) >= 10, 180, "copies")
        # No budget: the pods export the plan's interval (every step).
        intervals = [_gauge(agent.metrics(), "megatron_agent_buddy_copy_interval_steps") for agent in pods]
        assert intervals == [1.0, 1.0], intervals
    for pod in ("pod-a", "pod-b"):
        reports = [r for r in operator.reports_from(pod) if r.replica_steps]
        assert reports, pod
        for r in reports:
            assert r.epoch == 1 and r.step is not None, (pod, r)
            assert r.replica_steps == sorted(set(r.replica_steps), reverse=True) and len(r.replica_steps) <= 2
            # Each step's refresh finishes after the next step (or once the job ended), and the worker
            # tells of it after that step's progress: a report may fall in between.
            assert r.replica_steps[0] in (r.step - 2, r.step - 1, r.step), (pod, r.step, r.replica_steps)


def _gauge(metrics: str, name: str) -> float | None:
    found = [float(line.split()[1]) for line in metrics.splitlines() if line.startswith(f"{name} ")]
    return found[0] if found else None


def test_under_a_cost_budget_the_pods_export_the_interval_their_workers_agreed_on(
    operator: RecordingOperator, tmp_path: Path
) -> None:
    with _two_pods_with_copies(operator, tmp_path, iters=60, cost_percent=50) as pods:
        # Calibrated over steps 4-20, agreed at step 20 (worker/copy_schedule.py).
        for pod in ("pod-a", "pod-b"):
            operator.wait_report(pod, lambda r: (r.step or 0) >= 24, 180, "training past the calibration")
        metrics = [agent.metrics() for agent in pods]
    intervals = [_gauge(m, "megatron_agent_buddy_copy_interval_steps") for m in metrics]
    costs = [_gauge(m, "megatron_agent_buddy_copy_cost_ratio") for m in metrics]
    assert intervals[0] is not None and intervals[0] >= 1 and intervals[0] == intervals[1], intervals
    # Each pod's worker needed at most the agreed interval, so its own cost at it is within budget.
    assert all(c is not None and 0 <= c <= 0.5 + 1e-9 for c in costs), costs
