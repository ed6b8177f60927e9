"""The local demo (``make demo``): the whole system on one machine, with no cluster and no GPU.

1. A real control plane on loopback, the CRD, and nodes whose pods run as local processes.
2. The operator (``python -m megatron_operator``) and ``examples/megatronjob-local.yaml``: worker
   pods and a hot spare running the trainer agent and Megatron-Core workers on CPU/gloo.
3. A GPU "dies" (a worker pod's process is SIGKILLed): the spare takes its place, the survivors
   rebuild their process groups in place, and training goes on to the last step.
4. A bad job is refused at the door, naming its fields.

With a terminal attached the cluster stays up at the end until Enter is pressed.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from typing import Any

import yaml

from localcluster.cluster import REPO_ROOT, ClusterError, LocalCluster
from localcluster.operator_run import running_operator

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
    deadline = time.monotonic() + timeout
    last = None
    while True:
        s = _status(cluster, name)
        line = (
            f"  phase={s.get('phase', '-'):<10} mesh={s.get('mesh', '-'):<7} ready={s.get('ready', '-'):<5} "
            f"spares={s.get('sparesReady', 0)} epoch={s.get('epoch', 0)} step={s.get('step', 0)} "
            f"recoveries={s.get('recoveries', 0)}"
        )
        if line != last:
            print(line, flush=True)
            last = line
        if until(s):
            return s
        if s.get("phase") == "Failed":
            raise DemoError(f"the job failed: {json.dumps(s.get('conditions'), indent=1)}")
        if time.monotonic() > deadline:
            raise DemoError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def main() -> int:
    workdir = REPO_ROOT / ".localcluster" / "demo"
    cluster = LocalCluster(workdir)
    operator_log = workdir / "operator.log"
    job_name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
    try:
        _step("Starting a Kubernetes control plane on loopback (the first run builds it from Go modules)")
        cluster.start()
        cluster.install_crds()
        nodes = cluster.add_process_nodes(4, gpus_per_node=1, prefix="node")
        _kubectl(cluster, "get", "nodes")

        _step(f"Starting the operator (log: {operator_log.relative_to(REPO_ROOT)})")
        with running_operator(cluster, NAMESPACE, operator_log):
            _step(f"Applying {EXAMPLE.relative_to(REPO_ROOT)}: 2 data-parallel replicas and 1 hot spare")
            if _kubectl(cluster, "apply", "-f", str(EXAMPLE)) != 0:
                return 1
            status = _watch(cluster, job_name, lambda s: s.get("step", 0) >= 5, "training to reach step 5", 300)
            _kubectl(cluster, "get", "pods", "-L", "megatron.dev/role")

            victim = status["plan"]["members"][0]["pod"]
            _step(f"A GPU dies: SIGKILL the process of pod {victim}")
            nodes.kill_pod_process(NAMESPACE, victim, signal.SIGKILL)
            status = _watch(cluster, job_name, lambda s: s.get("epoch", 0) >= 2, "the recovery plan", 120)
            plan = status["plan"]
            print(
                f"\nplan epoch {plan['epoch']} ({plan['reason']}): members "
                f"{[m['pod'] for m in plan['members']]}, resume at step {plan['resumeStep']}"
            )
            _step("Training continues in the same processes, and the spare pool is refilled")
            status = _watch(cluster, job_name, lambda s: s.get("phase") == "Succeeded", "the job to finish", 600)
            _kubectl(cluster, "get", "megatronjobs", "-o", "wide")
            took = status.get("lastRecoveryDurationSeconds")
            if took is not None:
                print(f"last recovery, failure to the first step trained by every member: {took:.2f} s")
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
        print(f"\nDone. Pod logs: {(workdir / 'pods').relative_to(REPO_ROOT)}/")
        if sys.stdin.isatty():
            print(f"The cluster is still up: export KUBECONFIG={cluster.kubeconfig}")
            input("Press Enter to stop it... ")
        return 0
    except (ClusterError, DemoError) as err:
        print(f"demo: {err}\n(operator log: {operator_log})", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        print("control plane stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
