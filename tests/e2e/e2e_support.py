"""Support for end-to-end runs: process nodes, job builders, waiting with a deadline, dumps on failure."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from localcluster import waiting
from localcluster.cluster import LocalCluster
from localcluster.jobs import tiny_job
from localcluster.nodeagent import NodeAgent

JOBS = "/apis/megatron.dev/v1alpha1/namespaces/{ns}/megatronjobs"
#: Steps of a job that moves to a new plan without a failure (a drain, a suspension, an eviction). The
#: move waits for a step boundary about 6 s of training ahead (planner.boundary_lead: the reports' lag
#: and the push, twice over, counted at the fastest recent step): at this job's fastest CPU steps
#: (~0.01-0.02 s, one thread per worker) that is 300-600 steps; a suspension measured at 600 steps
#: landed at step 522. A shorter job ends before the move takes effect.
LONG_RUN_ITERS = 1500
#: Steps of a job that must still be training after a failure seen at step 5 and its recovery (a few
#: seconds; CPU steps of this job take ~0.02-0.05 s).
RECOVERY_RUN_ITERS = 600


def process_nodes_fixture(count: int, pool: str) -> Any:
    """A module-scoped fixture: ``count`` process nodes of one GPU each in ``pool``, the module's own
    (assign it to the fixture's name: ``process_nodes = process_nodes_fixture(4, "e2e")``)."""

    @pytest.fixture(scope="module")
    def process_nodes(local_cluster: LocalCluster) -> NodeAgent:
        """Process nodes of this module's own pool: its jobs' pods run nowhere else."""
        return local_cluster.add_process_nodes(count, gpus_per_node=1, prefix=pool)

    return process_nodes


def make_elastic_job(name: str = "e2e", *, pool: str = "e2e", **overrides: Any) -> dict[str, Any]:
    """The local tiny job (:func:`localcluster.jobs.tiny_job`: its defaults, ``overrides`` on top) on
    the process nodes of the test's own node agent."""
    return tiny_job(name, pool=pool, **overrides)


def job_status(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any]:
    code, job = cluster.request("GET", JOBS.format(ns=namespace) + f"/{name}")
    assert code == 200, job
    status: dict[str, Any] = job.get("status") or {}
    return status


# End-to-end waits read the API server: a few polls a second, no more (two cores run the whole stack).
wait_for = partial(waiting.wait_for, interval=0.25, error=AssertionError)


def submit(cluster: LocalCluster, namespace: str, job: dict[str, Any]) -> None:
    """Create the MegatronJob ``job``."""
    code, body = cluster.request("POST", JOBS.format(ns=namespace), job)
    assert code == 201, body


def wait_for_step(
    cluster: LocalCluster, namespace: str, name: str, step: int, timeout: float, show: Callable[[], str]
) -> dict[str, Any]:
    """The job's status once it has trained ``step`` steps; on timeout, fail with ``show()``."""
    return wait_for(  # type: ignore[no-any-return]
        lambda: (s := job_status(cluster, namespace, name)).get("step", 0) >= step and s,
        timeout,
        f"{name} to reach step {step}",
        details=show,
    )


def wait_for_phase(
    cluster: LocalCluster, namespace: str, name: str, phase: str, timeout: float, show: Callable[[], str]
) -> dict[str, Any]:
    """The job's status once its phase is ``phase``; on timeout, fail with ``show()``."""
    return wait_for(  # type: ignore[no-any-return]
        lambda: (s := job_status(cluster, namespace, name)).get("phase") == phase and s,
        timeout,
        f"{name} to be {phase}",
        details=show,
    )


def dump(cluster: LocalCluster, namespace: str, operator_log: Path) -> str:
    """The operator's log tail, the job, the pods and each pod's log tail: what a failure needs."""
    parts = ["--- operator log (tail)", _tail(operator_log, 80)]
    parts.append("--- megatronjobs")
    parts.append(cluster.kubectl("get", "mj", "-n", namespace, "-o", "yaml", check=False).stdout[-6000:])
    parts.append("--- pods")
    parts.append(cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", "--show-labels", check=False).stdout)
    parts.append(cluster.kubectl("get", "events", "-n", namespace, check=False).stdout[-4000:])
    for pod_log in sorted((cluster.workdir / "pods").glob(f"{namespace}_*.log")):
        parts += [f"--- {pod_log.name} (tail)", _tail(pod_log, 30)]
    return "\n".join(parts)


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(none)"


def to_json(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)[:4000]
