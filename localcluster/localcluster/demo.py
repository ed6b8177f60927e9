"""The local demo (``make demo``): the whole system on one machine, with no cluster and no GPU.

1. A real control plane on loopback, the CRD, and nodes whose pods run as local processes;
   Prometheus scraping the operator and every trainer pod as the chart's monitors say.
2. The operator (``python -m megatron_operator``) and ``examples/megatronjob-local.yaml``: worker
   pods and a hot spare running the trainer agent and Megatron-Core workers on CPU/gloo, with
   Megatron's distributed optimizer and buddy copies of its shards; beside it, the same job
   without a failure (``-reference``), to compare losses with.
3. A GPU "dies" (a worker pod's process is SIGKILLed): the spare takes its place and the lost
   shards from the copies kept on the other pod, the survivors rebuild their process groups in
   place, and training goes on to the last step.
4. The story: a timeline of the recovery with durations, the losses around the failure next to
   the failure-free run's, the job's goodput, and the dashboard rendered from Prometheus.
5. A bad job is refused at the door, naming its fields.

With ``KEEP=1`` the cluster, the operator and Prometheus stay up at the end until interrupted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from localcluster import dashboard
from localcluster.cluster import REPO_ROOT, ClusterError, LocalCluster, free_port
from localcluster.jobs import with_sample_log
from localcluster.operator_run import running_operator
from localcluster.prometheus import LocalPrometheus, PrometheusError, expose_operator, render_chart
from localcluster.waiting import wait_for

EXAMPLE = REPO_ROOT / "examples" / "megatronjob-local.yaml"
NAMESPACE = "default"
BAD_JOB = """\
apiVersion: megatron.dev/v1alpha1
kind: MegatronJob
metadata: {name: bad-demo}
spec: {image: trainer, tp: 2, gpusPerPod: 3, replicas: 2, minReplicas: 4}
"""


class DemoError(RuntimeError):
    """A step of the demo did not happen in time; the message says which."""


def _step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def _kubectl(cluster: LocalCluster, *args: str, stdin: str | None = None) -> int:
    print(f"$ kubectl {' '.join(args)}", flush=True)
    proc = cluster.kubectl(*args, input=stdin, check=False)
    sys.stdout.write(proc.stdout + proc.stderr)
    sys.stdout.flush()
    return proc.returncode


def _status(cluster: LocalCluster, name: str) -> dict[str, Any]:
    code, job = cluster.request("GET", f"/apis/megatron.dev/v1alpha1/namespaces/{NAMESPACE}/megatronjobs/{name}")
    if code != 200:
        raise DemoError(f"cannot read job {name}: {code} {job}")
    status: dict[str, Any] = job.get("status") or {}
    return status


def _watch(cluster: LocalCluster, name: str, until: Any, what: str, timeout: float) -> dict[str, Any]:
    """Print a line whenever the job's status changes, until ``until(status)`` holds."""
    last = None

    def reached() -> dict[str, Any] | None:
        nonlocal last
        s = _status(cluster, name)
        line = (
            f"  phase={s.get('phase', '-'):<10} mesh={s.get('mesh', '-'):<7} ready={s.get('ready', '-'):<5} "
            f"spares={s.get('sparesReady', 0)} epoch={s.get('epoch', 0)} step={s.get('step', 0)} "
            f"recoveries={s.get('recoveries', 0)}" + (f" copies={s['buddyCopyStep']}" if "buddyCopyStep" in s else "")
        )
        if line != last:
            print(line, flush=True)
            last = line
        if until(s):
            return s
        if s.get("phase") == "Failed":
            raise DemoError(f"the job failed: {json.dumps(s.get('conditions'), indent=1)}")
        return None

    return wait_for(reached, timeout, what, interval=0.5, error=DemoError)


def _losses(directory: Path) -> dict[int, float]:
    """Step (1-based, as status counts) -> loss, from data-parallel rank 0's records; a step
    trained again after a resume keeps its last record."""
    losses: dict[int, float] = {}
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["dpRank"] == 0:
                losses[record["step"] + 1] = record["loss"]
    return losses


def _resumed_at(directory: Path, epoch: int) -> int | None:
    """Steps completed when training resumed in ``epoch``, by the sample logs: the plan's resume step
    is the operator's estimate from lagging reports, the survivors may hold a newer one."""
    steps = [
        record["step"]
        for path in sorted(directory.glob("*.jsonl"))
        for record in map(json.loads, path.read_text().splitlines())
        if record["epoch"] == epoch
    ]
    return min(steps, default=None)


def _seconds(stamp: str | None) -> float | None:
    return datetime.fromisoformat(stamp).timestamp() if stamp else None


def _timeline(status: dict[str, Any], killed_at: float, prom: LocalPrometheus, job: str, resumed: int) -> None:
    """Failure, detection, plan, each reconfiguration phase and the first step after, from the
    job's status (the operator's instants) and Prometheus (the agents' phase durations)."""
    failure = status.get("lastFailure") or {}
    declared = _seconds(failure.get("time"))
    planned = _seconds(status["plan"].get("createdAt"))
    took = status.get("lastRecoveryDurationSeconds")
    print("t = 0 at the SIGKILL")
    print(f"  +0.000 s  the process of pod {failure.get('pod', '?')} is killed (a GPU dies)")
    if declared is not None:
        print(f"  {declared - killed_at:+.3f} s  failure declared by the operator: {failure.get('reason')}")
    if planned is not None:
        plan = status["plan"]
        print(
            f"  {planned - killed_at:+.3f} s  plan epoch {plan['epoch']} ({plan['reason']}) stored and pushed: "
            f"members {[m['pod'] for m in plan['members']]}, resume at step {plan['resumeStep']}"
            + (f" (the survivors held step {resumed}: training resumed there)" if resumed != plan["resumeStep"] else "")
        )
        _optimizer_sources(plan, resumed)
    if declared is not None and took is not None:
        at = declared + took
        try:
            series = f'megatron_agent_last_recovery_phase_seconds{{megatronjob="{job}"}}'
            phases = prom.query(f"max by (phase) (max_over_time({series}[1m]))", at=at + 5)
        except PrometheusError as err:
            phases = []
            print(f"  (phases unavailable: {err})")
        order = ("detect", "step_exit", "abort", "rendezvous", "rebuild", "restore", "verify", "first_step")
        found = {p["metric"].get("phase", "?"): float(p["value"][1]) for p in phases}
        shown = [f"{name} {found[name]:.3f}" for name in order if name in found]
        if shown:
            print("           on the slowest member (s): " + ", ".join(shown))
        print(f"  {at - killed_at:+.3f} s  every member committed its first step of the new plan")
        print(
            f"\nTraining stopped for {at - killed_at:.2f} s; the operator's recovery time (failure declared to "
            f"every member training) was {took:.2f} s."
        )


def _optimizer_sources(plan: dict[str, Any], resumed: int) -> None:
    """Where the new plan takes the distributed optimizer's shards from (its ``optimizerState``),
    at the step the workers agreed on (``resumed``: the newest every holder has)."""
    state = plan.get("optimizerState")
    if not state or state.get("source") == "init":
        return
    if state["source"] == "checkpoint":
        print("           optimizer shards: every rank reloads the newest checkpoint (no copy survived)")
        return
    copies = state.get("copies", [])
    buddies = [
        f"rank {c['previousRank']}'s from the copy its buddy kept on {c['holderPod']}" for c in copies if c["buddy"]
    ]
    if state.get("paramsFromShards"):
        print(
            f"           optimizer shards of step {resumed}, every rank from host copies (the plan saw no newer"
            f" copy on every pod; the parameters are rebuilt from them): {', '.join(buddies)}, the others their own"
        )
    elif buddies:
        print(f"           optimizer shards of step {resumed}: {', '.join(buddies)}, the others on their GPUs")


def _compare_losses(recovered: dict[int, float], reference: dict[int, float], resume: int) -> None:
    print(f"{'step':>6}  {'with the failure':>18}  {'failure-free':>14}  same bits")
    for step in range(max(1, resume - 2), resume + 4):
        a, b = recovered.get(step), reference.get(step)
        mark = "" if a is None or b is None else ("yes" if a == b else "NO")
        note = "   <- first step after the recovery" if step == resume + 1 else ""
        print(f"{step:>6}  {a if a is not None else '-':>18}  {b if b is not None else '-':>14}  {mark}{note}")
    common = sorted(set(recovered) & set(reference))
    same = sum(recovered[s] == reference[s] for s in common)
    print(f"{same} of {len(common)} steps have bitwise the same loss as the failure-free run")


def _goodput(status: dict[str, Any]) -> None:
    g = status.get("goodput")
    if not g:
        print("(no goodput figures in the status)")
        return
    lost = ", ".join(f"{k} {v:.1f} s" for k, v in g["lostSeconds"].items() if v)
    print(
        f"goodput {g['ratio']:.1%}: {g['productiveSeconds']:.1f} s of kept steps in {g['wallSeconds']:.1f} s; "
        f"lost: {lost}"
    )
    print("(a demo job is mostly start-up: pods, imports and model build take longer than its tiny steps)")


def main() -> int:
    workdir = REPO_ROOT / ".localcluster" / "demo"
    cluster = LocalCluster(workdir)
    operator_log = workdir / "operator.log"
    example = yaml.safe_load(EXAMPLE.read_text())
    job_name = example["metadata"]["name"]
    reference_name = f"{job_name}-reference"
    samples = workdir / "samples"
    keep = os.environ.get("KEEP") == "1"
    try:
        with contextlib.ExitStack() as stack:
            _step("Starting a Kubernetes control plane on loopback (the first run builds it from Go modules)")
            cluster.start()
            cluster.install_crds()
            nodes = cluster.add_process_nodes(6, gpus_per_node=1, prefix="node")
            _kubectl(cluster, "get", "nodes")

            _step("Starting Prometheus, configured from the chart's ServiceMonitor, PodMonitor and PrometheusRule")
            docs = render_chart()
            prom = stack.enter_context(LocalPrometheus(cluster, workdir / "prometheus", docs))
            print(f"Prometheus: {prom.url} (log: {prom.log.relative_to(REPO_ROOT)})")

            _step(f"Starting the operator (log: {operator_log.relative_to(REPO_ROOT)})")
            metrics_port, report_port = free_port(), free_port()
            stack.enter_context(running_operator(cluster, NAMESPACE, operator_log, report_port, metrics_port))
            expose_operator(cluster, docs, {"metrics": metrics_port, "reports": report_port})

            _step(
                f"Applying {EXAMPLE.relative_to(REPO_ROOT)}: 2 data-parallel replicas and 1 hot spare; "
                f"beside it {reference_name}, the same job that no failure will hit (workers log their losses "
                f"to {samples.relative_to(REPO_ROOT)}/)"
            )
            reference = json.loads(json.dumps(example))
            reference["metadata"]["name"] = reference_name
            reference["spec"]["spares"] = 0
            for job, name in ((example, job_name), (reference, reference_name)):
                (samples / name).mkdir(parents=True, exist_ok=True)
                for old in (samples / name).glob("*.jsonl"):
                    old.unlink()
                if _kubectl(cluster, "apply", "-f", "-", stdin=yaml.safe_dump(with_sample_log(job, samples / name))):
                    return 1
            started = time.time()
            status = _watch(cluster, job_name, lambda s: s.get("step", 0) >= 5, "training to reach step 5", 300)
            _kubectl(cluster, "get", "pods", "-L", "megatron.dev/role,megatron.dev/job")

            victim = status["plan"]["members"][0]["pod"]
            _step(f"A GPU dies: SIGKILL the process of pod {victim}")
            killed_at = time.time()
            nodes.kill_pod_process(NAMESPACE, victim, signal.SIGKILL)
            status = _watch(
                cluster,
                job_name,
                lambda s: s.get("lastRecoveryDurationSeconds") is not None and s.get("committedEpoch", 0) >= 2,
                "the recovery",
                120,
            )
            recovered_status = status

            _step("Training continues in the same processes, and the spare pool is refilled")
            status = _watch(cluster, job_name, lambda s: s.get("phase") == "Succeeded", "the job to finish", 600)
            _watch(cluster, reference_name, lambda s: s.get("phase") == "Succeeded", "the reference job", 600)
            time.sleep(2)  # two more scrapes: the dashboard's last point shows the finished job
            ended = time.time()
            _kubectl(cluster, "get", "megatronjobs", "-o", "wide")

            _step("The recovery, step by step")
            plan = recovered_status["plan"]
            resumed = _resumed_at(samples / job_name, plan["epoch"])
            resumed = plan["resumeStep"] if resumed is None else resumed
            _timeline(recovered_status, killed_at, prom, job_name, resumed)

            _step(f"Losses around the failure, next to {reference_name} (same seed, no failure)")
            _compare_losses(_losses(samples / job_name), _losses(samples / reference_name), resumed)

            _step("Goodput: the share of wall time spent on training steps that were kept")
            _goodput(status)

            _step("The chart's Grafana dashboard, every panel evaluated against Prometheus over this run")
            panels = dashboard.evaluate(prom, started - 5, ended, namespace=NAMESPACE, job=job_name)
            png = dashboard.render(panels, workdir / "dashboard.png", f"{NAMESPACE}/{job_name}: make demo", started - 5)
            for problem in (p for panel in panels for p in panel.problems):
                print(f"  {problem}")
            print(f"dashboard: {png.relative_to(REPO_ROOT)}")
            _kubectl(
                cluster,
                "get",
                "events",
                "--sort-by=.lastTimestamp",
                "--field-selector",
                f"involvedObject.kind=MegatronJob,involvedObject.name={job_name}",
            )

            _step("A bad job is refused by the API server, naming the fields")
            if _kubectl(cluster, "apply", "-f", "-", stdin=BAD_JOB) == 0:
                print("demo: the bad job was accepted; the CRD is not enforcing its rules", file=sys.stderr)
                return 1

            _step("Where to look")
            print(f"  Prometheus:     {prom.url}  (e.g. megatron_operator_goodput_ratio, megatron_agent_step)")
            print(
                f"  operator:       http://127.0.0.1:{metrics_port}/metrics, log {operator_log.relative_to(REPO_ROOT)}"
            )
            print(
                f"  trainer agents: http://<pod IP>:29400/metrics while a pod runs; pod logs in "
                f"{(workdir / 'pods').relative_to(REPO_ROOT)}/"
            )
            print(f"  dashboard:      {png.relative_to(REPO_ROOT)}")
            if keep:
                print("\nKEEP=1: the cluster, the operator and Prometheus stay up.")
                print(f"export KUBECONFIG={cluster.kubeconfig}")
                print("Press Ctrl-C to stop them.", flush=True)
                with contextlib.suppress(KeyboardInterrupt):
                    while True:
                        time.sleep(3600)
            return 0
    except (ClusterError, DemoError, PrometheusError) as err:
        print(f"demo: {err}\n(operator log: {operator_log})", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        print("control plane stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
