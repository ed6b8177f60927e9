"""End to end, all real: `kubectl drain` of a node that runs a member of a training job.

The operator (subprocess; the job's PodDisruptionBudget is on by default) reconciles a job of two workers
and a spare on process nodes (the trainer agent and Megatron-Core workers, CPU/gloo). Mid-run the
node of a member is drained with kubectl: the cordon makes the operator move that member's ranks to
the spare in a ``migrate`` plan (state from the data-parallel peer, in memory), the budget refuses
evicting the member meanwhile, and once the new plan has trained the operator deletes the pod and
the drain completes. Checked: the drain succeeds, the job made no recovery and recorded no failure,
no step was committed twice (none redone) and each step consumed exactly its global batch, the
drained node keeps no pod of the job, and the job succeeds.

With no spare, the same drain shrinks the mesh around the leaving member (a ``migrate`` plan of one
data-parallel replica, the state already in the survivor), with the same checks: the old mesh trains
every step before the plan's boundary, the new epochs every step from it.
"""

from __future__ import annotations

import subprocess
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    LONG_RUN_ITERS,
    dump,
    job_status,
    make_elastic_job,
    process_nodes_fixture,
    submit,
    wait_for,
    wait_for_phase,
    wait_for_step,
)

from localcluster.chaos import check_history, read_samples
from localcluster.cluster import LocalCluster
from localcluster.jobs import GLOBAL_BATCH
from localcluster.nodeagent import NodeAgent
from localcluster.operator_run import running_operator

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

process_nodes = process_nodes_fixture(4, "drain")
ITERS = LONG_RUN_ITERS


def test_kubectl_drain_moves_a_member_to_the_spare_without_losing_a_step(
    local_cluster: LocalCluster,
    process_nodes: NodeAgent,
    namespace: str,
    tmp_path: Path,
) -> None:
    log = tmp_path / "operator.log"
    samples = tmp_path / "samples"
    samples.mkdir()
    show = partial(dump, local_cluster, namespace, log)
    with running_operator(local_cluster, namespace, log):
        submit(local_cluster, namespace, make_elastic_job("drain", pool="drain", train_iters=ITERS, samples=samples))
        wait_for_step(local_cluster, namespace, "drain", 5, 300, show)
        # Drain once the spare is up: a spare still starting (imports take long on a busy machine) lets
        # the job train to its end before the migration, and then no step shows the new mesh.
        status = wait_for(
            lambda: (s := job_status(local_cluster, namespace, "drain")).get("sparesReady") == 1 and s,
            300,
            "the spare to be ready",
            details=show,
        )
        leaving = status["plan"]["members"][0]["pod"]
        node = _node_of(local_cluster, namespace, leaving)

        started = time.monotonic()
        drain = subprocess.run(
            [
                *("kubectl", f"--kubeconfig={local_cluster.kubeconfig}", "drain", node),
                *("--ignore-daemonsets", "--delete-emptydir-data", "--timeout=240s"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        took = time.monotonic() - started
        try:
            assert drain.returncode == 0, f"kubectl drain failed:\n{drain.stdout}\n{drain.stderr}\n{show()}"
            print(f"kubectl drain of {node} ({leaving}) completed in {took:.1f}s")
            moved = job_status(local_cluster, namespace, "drain")
            assert moved["plan"]["reason"] == "migrate" and leaving not in {
                m["pod"] for m in moved["plan"]["members"]
            }, show()
            code, left = local_cluster.request(
                "GET", f"/api/v1/namespaces/{namespace}/pods?fieldSelector=spec.nodeName%3D{node}"
            )
            assert code == 200 and left["items"] == [], show()

            final = wait_for_phase(local_cluster, namespace, "drain", "Succeeded", 600, show)
        finally:
            local_cluster.kubectl("uncordon", node, check=False)
        assert final.get("recoveries", 0) == 0 and "lastFailure" not in final, final
        problems, history, redone = check_history(read_samples(samples), ITERS, GLOBAL_BATCH, victims=set())
        assert problems == [] and redone == [], (problems, redone)
        # Steps were committed after the move, in the new epoch, from its step boundary on.
        boundary = moved["plan"]["resumeStep"]
        assert boundary < ITERS and {s for s, epoch in history.items() if epoch >= 2} == set(range(boundary, ITERS)), (
            boundary,
            history,
        )


def test_kubectl_drain_with_no_spare_shrinks_the_mesh_without_losing_a_step(
    local_cluster: LocalCluster,
    process_nodes: NodeAgent,
    namespace: str,
    tmp_path: Path,
) -> None:
    log = tmp_path / "operator.log"
    samples = tmp_path / "samples"
    samples.mkdir()
    show = partial(dump, local_cluster, namespace, log)
    job = make_elastic_job("shrink", pool="drain", spares=0, train_iters=ITERS, samples=samples)
    with running_operator(local_cluster, namespace, log):
        submit(local_cluster, namespace, job)
        status = wait_for_step(local_cluster, namespace, "shrink", 5, 300, show)
        assert len(status["plan"]["members"]) == 2, status["plan"]
        leaving = status["plan"]["members"][0]["pod"]
        node = _node_of(local_cluster, namespace, leaving)

        drain = _start_drain(local_cluster, node)
        try:
            # The operator may grow the job back once a new pod is warm: catch the move's own plan.
            moved: dict[str, Any] = wait_for(
                lambda: (p := job_status(local_cluster, namespace, "shrink")["plan"])["reason"] == "migrate" and p,
                240,
                "the migrate plan",
                details=show,
            )
            out, err = drain.communicate(timeout=300)
            assert drain.returncode == 0, f"kubectl drain failed:\n{out}\n{err}\n{show()}"
            assert [m["pod"] for m in moved["members"]] != [leaving] and len(moved["members"]) == 1, moved
            code, left = local_cluster.request(
                "GET", f"/api/v1/namespaces/{namespace}/pods?fieldSelector=spec.nodeName%3D{node}"
            )
            assert code == 200 and left["items"] == [], show()
            final = wait_for_phase(local_cluster, namespace, "shrink", "Succeeded", 600, show)
        finally:
            _end(drain)
            local_cluster.kubectl("uncordon", node, check=False)
        assert final.get("recoveries", 0) == 0 and "lastFailure" not in final, final
        problems, history, redone = check_history(read_samples(samples), ITERS, GLOBAL_BATCH, victims=set())
        assert problems == [] and redone == [], (problems, redone)
        boundary = moved["resumeStep"]
        assert boundary < ITERS and {s for s, epoch in history.items() if epoch >= 2} == set(range(boundary, ITERS)), (
            boundary,
            history,
        )


def _node_of(cluster: LocalCluster, namespace: str, pod: str) -> str:
    code, body = cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}")
    assert code == 200, body
    node: str = body["spec"]["nodeName"]
    return node


def _start_drain(cluster: LocalCluster, node: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *("kubectl", f"--kubeconfig={cluster.kubeconfig}", "drain", node),
            *("--ignore-daemonsets", "--delete-emptydir-data", "--timeout=240s"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _end(process: subprocess.Popen[str]) -> None:
    """Kill a drain still running (a failed assertion) and reap it."""
    if process.poll() is None:
        process.kill()
    process.communicate()
