"""GPU recovery through the real pod agent: a worker SIGKILLed mid-step -> the job's next step, with
the agent's share measured, not assumed.

Each pod is the real agent process (``python -m megatron_trainer.agent``, on a loopback address of
its own with the standard ports, one GPU through ``CUDA_VISIBLE_DEVICES``) supervising its real
Megatron-Core worker; the script plays the operator: a recording report endpoint takes the agents'
heartbeats and reports, and plans are POSTed to the agents' control ports with the job's token.

On two GPUs pods A and B train (DP 2); a worker of B is SIGKILLed inside a step, and once B's agent
reports its worker dead (the operator acts on a pod's own report at once) the plan shrinks the job to
A (DP 1, A's own state). With three or more GPUs a warm spare C waits, and the plan gives B's rank to
C with its state from A (replace). A fault comes only once the epoch trained ``STEADY_STEPS`` steps,
so that the survivors' hang watchdog has the epoch's step time (before that a stalled collective is
allowed the collective timeout, and A's own report would take that long). Measured per fault, from
the kill (wall clock, one host):

- ``b_report_s``: B's agent reports its own worker dead (exit seen, report sent, arrived);
- ``a_report_s``: A's agent reports its failed collective, when it does before the new plan ends
  its step (null otherwise);
- ``push_s``: the plan POSTed to every member, each agent's answer in (the operator's push);
- ``first_step_s``: every member's agent shows a step of the new epoch (``/v1/state`` polled);
- the members' own phases of the new epoch (the agents' ``lastRecovery``).

The operator's share (a report -> a plan stored and pushed) is ``operator_recovery.py``'s; here the plan
goes out as soon as B's report arrives.

    python benchmarks/agent_recovery.py --gpus 2 --faults 3 --out result.json

Model: as ``trainer_recovery.py`` (default GPT ~1.1 B, bf16; ``--preset``, size flags).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "tests"), str(REPO / "tests" / "trainer")]

from agent_harness import AgentProcess, RecordingOperator, make_plan, running_agents  # noqa: E402
from trainer_recovery import add_job_args, job_spec, percentile  # noqa: E402
from worker_harness import wait_for  # noqa: E402

from megatron_contract.mesh import PlanReason, StateSource, StateSourceKind  # noqa: E402
from megatron_trainer.worker.watchdog import MIN_RECORDED_STEPS  # noqa: E402

READY_TIMEOUT = 900.0  # a ~1 B model's workers import, build and warm up
#: Steps an epoch trains before a fault: its first (a warm-up) and the watchdog's recorded steps.
STEADY_STEPS = 1 + MIN_RECORDED_STEPS + 1


def _training(agent: AgentProcess, epoch: int, after: int) -> dict[str, Any] | None:
    s = agent.state()
    return s if s["epoch"] == epoch and s["state"] == "training" and (s.get("step") or 0) > after else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=3)
    add_job_args(parser)
    parser.set_defaults(gpus=2)
    args = parser.parse_args()
    if args.gpus < 2:
        parser.error("--gpus must be at least 2: a data-parallel peer holds the state of the rank that is lost")
    rng = random.Random(args.seed)
    spare = args.gpus >= 3
    spec = job_spec(args, 2, train_iters=1_000_000, collective_timeout=60.0, spares=1 if spare else 0)
    spec = spec.model_copy(
        update={"failure_detection": spec.failure_detection.model_copy(update={"heartbeat_interval_seconds": 0.5})}
    )
    logs = Path(tempfile.mkdtemp(prefix="agent-recovery-"))
    operator = RecordingOperator()
    names = iter(f"pod-{i}" for i in range(1_000_000))
    agents: list[AgentProcess] = []
    gpu_of: dict[str, int] = {}

    def boot(gpu: int) -> AgentProcess:
        env = {"CUDA_VISIBLE_DEVICES": str(gpu), "OMP_NUM_THREADS": "1"}
        agent = AgentProcess(next(names), spec, logs, operator_url=operator.url, worker_command=None, extra_env=env)
        agents.append(agent)
        gpu_of[agent.pod.name] = gpu
        return agent

    rows: list[dict[str, Any]] = []
    try:
        with running_agents(agents):
            a, b = boot(0), boot(1)
            c = boot(2) if spare else None
            for agent in (a, b, c):
                if agent is not None:
                    agent.wait_ready(READY_TIMEOUT)
            epoch = 1
            plan = make_plan(spec, [a.pod, b.pod], epoch=epoch, store=a.pod)
            for agent in (a, b):
                assert agent.post_plan(plan)[0] == 200
            start = 0  # the epoch's first step
            wait_for(lambda: _training(a, epoch, 3) and _training(b, epoch, 3), 600, "three steps of epoch 1")
            for n in range(args.faults):
                row = _fault(n, rng, spec, operator, a, b, c, epoch, start + STEADY_STEPS)
                rows.append(row)
                epoch, start = row["epoch"], row["resume_step"]
                a_report = "none" if row["a_report_s"] is None else f"{row['a_report_s']:.3f}s"
                print(
                    f"fault {n} ({row['plan']}): B's report {row['b_report_s']:.3f}s, A's report "
                    f"{a_report}, pushed {row['push_s']:.3f}s, first step {row['first_step_s']:.3f}s"
                    f" | " + " ".join(f"{k} {v:.3f}" for k, v in row["phases"].items()),
                    flush=True,
                )
                # The job is back to A and B (or A and C): a new pod takes the dead one's place for
                # the next fault, warmed up on its GPU, and joins at a step boundary.
                dead = b
                b = boot(gpu_of[dead.pod.name])
                dead.stop()
                if c is not None:
                    a, b, c = a, c, b  # C trained with A; the new pod is the spare now
                    b.wait_state(lambda s: s["state"] == "training", 60, "training")
                    c.wait_ready(READY_TIMEOUT)
                    continue
                b.wait_ready(READY_TIMEOUT)
                epoch, boundary = epoch + 1, (a.state().get("step") or 0) + 3
                start = boundary
                grow = make_plan(
                    spec,
                    [a.pod, b.pod],
                    epoch=epoch,
                    reason=PlanReason.GROW,
                    resume_step=boundary,
                    store=a.pod,
                    sources={1: StateSource(rank=1, kind=StateSourceKind.PEER, peer_rank=0)},
                )
                for agent in (a, b):
                    assert agent.post_plan(grow)[0] == 200
                wait_for(lambda x=a, y=b, e=epoch, s=boundary: _training(x, e, s) and _training(y, e, s), 600, "DP 2")
    finally:
        operator.close()

    summary: dict[str, Any] = {}
    for key in ("b_report_s", "a_report_s", "push_s", "first_step_s"):
        values = [r[key] for r in rows if r[key] is not None]
        summary[key] = {"p50_s": statistics.median(values), "p95_s": percentile(values, 95)} if values else None
    summary["n"] = len(rows)
    summary["a_reports"] = sum(r["a_report_s"] is not None for r in rows)
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "faults": rows, "args": vars(args)}, default=str))
    return 0


def _fault(
    n: int,
    rng: random.Random,
    spec: Any,
    operator: RecordingOperator,
    a: AgentProcess,
    b: AgentProcess,
    c: AgentProcess | None,
    epoch: int,
    steady: int,
) -> dict[str, Any]:
    """Once the epoch reached step ``steady``, SIGKILL B's worker inside a step; on B's report,
    shrink to A, or give B's rank to C; time each part."""
    wait_for(lambda: _training(a, epoch, steady - 1), 600, f"step {steady} of epoch {epoch}")
    seen = a.state().get("step") or 0
    state = wait_for(lambda: _training(a, epoch, seen), 120, "a step boundary")
    step_time = state.get("stepTimeSeconds") or 0.0
    time.sleep(rng.uniform(0.1, 0.9) * step_time)  # fault timing, not synchronization
    killed_at = time.time()
    os.kill(b.worker_pid(0), signal.SIGKILL)
    own = operator.wait_report(b.pod.name, lambda r: any(f.epoch == epoch for f in r.failed_peers), 120, "B's report")
    resume = a.state().get("step") or 0
    members = [a] if c is None else [a, c]
    sources = {} if c is None else {1: StateSource(rank=1, kind=StateSourceKind.PEER, peer_rank=0)}
    reason = PlanReason.SHRINK if c is None else PlanReason.REPLACE
    plan = make_plan(
        spec, [m.pod for m in members], epoch=epoch + 1, reason=reason, resume_step=resume, store=a.pod, sources=sources
    )
    push_start = time.time()
    for m in members:
        code, body = m.post_plan(plan)
        assert code == 200, body
    pushed_at = time.time()
    wait_for(lambda: all(_training(m, epoch + 1, resume) for m in members), 600, "the first step of the new plan")
    done_at = time.time()
    peer = next((r for r in operator.reports_from(a.pod.name) if any(f.epoch == epoch for f in r.failed_peers)), None)
    phases: dict[str, float] = {}
    for m in members:
        recovery = m.state().get("lastRecovery") or {}
        for k, v in (recovery.get("phases") or {}).items():
            phases[k] = max(phases.get(k, 0.0), float(v))
    return {
        "fault": n,
        "epoch": epoch + 1,
        "plan": reason.value,
        "b_report_s": operator.arrival_of(own) - killed_at,
        "a_report_s": None if peer is None else operator.arrival_of(peer) - killed_at,
        "push_s": pushed_at - push_start,
        "first_step_s": done_at - killed_at,
        "plan_to_first_step_s": done_at - pushed_at,
        "step_time_s": step_time,
        "resume_step": resume,
        "phases": phases,
    }


if __name__ == "__main__":
    sys.exit(main())
