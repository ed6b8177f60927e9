"""Benchmark of the agent's own latencies (stand-in workers, so only the agent is measured).

Run: ``PYTHONPATH=contract:operator:trainer:localcluster:tests python tests/trainer/agent_benchmark.py``

Prints, over several trials:
- startup: agent process start -> control port answering, and -> every worker said Hello;
- plan push: ``POST /v1/plan`` round trip for a 2-pod plan and for a 4096-pod plan;
- crash report: worker SIGKILLed -> a report naming it arrives at the operator (a recording endpoint);
- hang kill: worker SIGSTOPped -> the operator holds the "hung" report, minus the hang timeout
  (how far past its deadline the watchdog kills).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from agent_harness import AgentProcess, PodAddress, RecordingOperator, make_plan, make_spec, wait_for

from megatron_contract.agent import AgentState


def summary(name: str, seconds: list[float]) -> None:
    ms = sorted(s * 1000 for s in seconds)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    print(
        f"{name:<44} n={len(ms):<3} median {statistics.median(ms):8.1f} ms   p95 {p95:8.1f} ms   "
        f"min {ms[0]:8.1f} ms   max {ms[-1]:8.1f} ms",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    hang_timeout = 1.0
    spec = make_spec(collective_timeout=hang_timeout, heartbeat_interval=1.0)
    operator = RecordingOperator()
    logs = Path(tempfile.mkdtemp(prefix="agent-bench-"))
    started = time.monotonic()
    agent = AgentProcess(
        "pod-a",
        spec,
        logs,
        operator_url=operator.url,
        extra_env={"MEGATRON_WORKER_MAX_RESTARTS": "1000", "MEGATRON_WORKER_HANG_TIMEOUT_SECONDS": str(hang_timeout)},
    )
    try:
        wait_for(lambda: agent.state(), 60, "control port")
        port_up = time.monotonic() - started
        agent.wait_ready()
        ready = time.monotonic() - started
        agent.wait_state(lambda s: s["rendezvous"]["running"], 60, "the store (imports torch)")
        store = time.monotonic() - started
        print(
            f"startup: control port {port_up * 1000:.0f} ms, stand-in workers ready {ready * 1000:.0f} ms, "
            f"rendezvous store up {store * 1000:.0f} ms",
            flush=True,
        )

        other = PodAddress("pod-b", "127.0.0.9")
        epoch = 0
        small: list[float] = []
        for _ in range(args.trials * 5):
            epoch += 1
            pods = [agent.pod, other] if epoch % 2 else [other, PodAddress("pod-x", "127.0.0.10")]
            plan = make_plan(spec, pods, epoch=epoch)
            t0 = time.monotonic()
            assert agent.post_plan(plan)[0] == 200
            small.append(time.monotonic() - t0)
        summary("POST /v1/plan, 2 pods", small)

        big_spec = make_spec(replicas=4096, global_batch=4096)
        many = [agent.pod, *(PodAddress(f"pod-{i}", f"127.1.{i // 250}.{i % 250 + 1}") for i in range(4095))]
        large: list[float] = []
        size = 0
        for _ in range(args.trials):
            epoch += 1
            plan = make_plan(big_spec, many, epoch=epoch)
            size = len(plan.model_dump_json(by_alias=True))
            t0 = time.monotonic()
            status, body = agent.post_plan(plan)
            assert status == 200, body
            large.append(time.monotonic() - t0)
        summary(f"POST /v1/plan, 4096 pods ({size / 1e6:.2f} MB)", large)

        crash: list[float] = []
        hang: list[float] = []
        for trial in range(args.trials * 2):
            epoch += 1
            assert agent.post_plan(make_plan(spec, [agent.pod, other], epoch=epoch))[0] == 200
            state = agent.wait_state(
                lambda s, e=epoch: s["epoch"] == e and s["state"] == "training" and s.get("step", 0) >= 2,
                30,
                "training",
            )
            pid = state["workers"][0]["pid"]
            seen = len(operator.reports_from("pod-a"))
            fault = signal.SIGKILL if trial % 2 == 0 else signal.SIGSTOP
            t0 = time.time()
            os.kill(pid, fault)
            report = operator.wait_report(
                "pod-a",
                lambda r, n=seen, e=epoch: (
                    operator.reports_from("pod-a").index(r) >= n and any(f.epoch == e for f in r.failed_peers)
                ),
                30,
                "the failure report",
            )
            elapsed = operator.arrival_of(report) - t0  # arrival time, not when the poll noticed
            (crash if fault == signal.SIGKILL else hang).append(
                elapsed - (0 if fault == signal.SIGKILL else hang_timeout)
            )
            agent.wait_state(lambda s: s["state"] == "spare", 30, "a fresh worker")
        summary("worker SIGKILL -> failure report at operator", crash)
        summary(f"worker SIGSTOP -> kill report, past the {hang_timeout:g}s limit", hang)
        assert all(r.state is not AgentState.FAILED or not r.healthy for r in operator.reports_from("pod-a"))
    finally:
        agent.stop()
        operator.close()


if __name__ == "__main__":
    main()
