"""The local demo (``make demo``): a real control plane, the CRD, fake GPU nodes, the example job.

Shows what a user sees: ``kubectl apply`` of examples/megatronjob.yaml, ``kubectl get
megatronjobs``, and a bad job refused at the door. With a terminal attached it keeps the cluster
up until Enter is pressed, so you can explore it with the printed KUBECONFIG.
"""

from __future__ import annotations

import sys

from localcluster.cluster import REPO_ROOT, ClusterError, LocalCluster

EXAMPLE = REPO_ROOT / "examples" / "megatronjob.yaml"
BAD_JOB = """\
apiVersion: megatron.dev/v1alpha1
kind: MegatronJob
metadata: {name: bad-demo}
spec: {image: trainer, tp: 2, gpusPerPod: 3, replicas: 2, minReplicas: 4}
"""


def _step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def _kubectl(cluster: LocalCluster, *args: str, stdin: str | None = None) -> int:
    print(f"$ kubectl {' '.join(args)}", flush=True)
    proc = cluster.kubectl(*args, input=stdin, check=False)
    sys.stdout.write(proc.stdout + proc.stderr)
    sys.stdout.flush()
    return proc.returncode


def main() -> int:
    workdir = REPO_ROOT / ".localcluster" / "demo"
    cluster = LocalCluster(workdir)
    try:
        _step("Starting a Kubernetes control plane on loopback (first run builds it from Go modules)")
        cluster.start()
        _step("Installing the MegatronJob CRD and registering 4 fake nodes with 8 GPUs each")
        cluster.install_crds()
        cluster.add_gpu_nodes(4, gpus_per_node=8)
        _kubectl(cluster, "get", "nodes", "-L", "nvidia.com/gpu.present")
        _step(f"Applying {EXAMPLE.relative_to(REPO_ROOT)}")
        if _kubectl(cluster, "apply", "-f", str(EXAMPLE)) != 0:
            return 1
        _kubectl(cluster, "get", "megatronjobs")
        _kubectl(cluster, "get", "mj", "-o", "wide")
        _step("A bad job is refused by the API server, naming the fields")
        if _kubectl(cluster, "apply", "-f", "-", stdin=BAD_JOB) == 0:
            print("demo: the bad job was accepted; the CRD is not enforcing its rules", file=sys.stderr)
            return 1
        print(f"\nThe cluster is up: export KUBECONFIG={cluster.kubeconfig}")
        if sys.stdin.isatty():
            input("Press Enter to stop it... ")
        return 0
    except ClusterError as err:
        print(f"demo: {err}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        print("control plane stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
