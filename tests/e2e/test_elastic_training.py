"""End to end, all real: the operator (subprocess) reconciles a MegatronJob on the local control
plane; the node agent runs its pods as processes running the trainer agent and Megatron-Core
workers on CPU/gloo. Scenario: the job trains; a worker pod's process is SIGKILLed (a GPU dies);
the operator promotes the hot spare with the next epoch, the survivors reconfigure in place, and
training continues from where it was to the last step (no step trained twice, every step's samples
once); the job ends Succeeded with one recovery.
Second scenario: the job's token Secret and Service are deleted while the operator is down; the
next operator process recreates them with the same token, the running trainers keep reporting, a
killed worker is replaced (the new spare starts with the recreated Secret) and the job succeeds.
Third scenario, with Megatron's distributed optimizer (each rank holds only its shard of the
optimizer state; buddy copies on the other pod): a killed pod's shard is planned from the copy its
buddy keeps, from the agents' reports of the copies they hold, and the spare takes it from there:
no checkpoint exists, training completes with each step's samples once and at most the steps of
one refresh redone; the job's status named the newest step every pod held copies of
(``buddyCopyStep``), and the recovery went back no further."""

from __future__ import annotations

import base64
import signal
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    RECOVERY_RUN_ITERS,
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
from localcluster.cluster import LocalCluster, free_port
from localcluster.jobs import GLOBAL_BATCH
from localcluster.nodeagent import NodeAgent
from localcluster.operator_run import running_operator

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


process_nodes = process_nodes_fixture(4, "e2e")
ITERS = RECOVERY_RUN_ITERS


def test_spare_replaces_a_killed_worker_and_training_completes(
    local_cluster: LocalCluster, process_nodes: NodeAgent, namespace: str, tmp_path: Path
) -> None:
    log, samples = tmp_path / "operator.log", tmp_path / "samples"
    samples.mkdir()
    job = make_elastic_job(train_iters=ITERS, samples=samples)

    show = partial(dump, local_cluster, namespace, log)

    with running_operator(local_cluster, namespace, log):
        status, recovered = _kill_a_member(local_cluster, process_nodes, namespace, job, show)
        assert status["epoch"] == 1 and status["plan"]["sizes"]["dp"] == 2
        victim = status["plan"]["members"][0]["pod"]
        members = [m["pod"] for m in recovered["plan"]["members"]]
        assert victim not in members and recovered["plan"]["sizes"]["dp"] == 2, "the spare should replace the victim"
        assert recovered["plan"]["reason"] == "replace"
        _succeeds_after(local_cluster, namespace, status["step"], show)
    # Survivors keep every completed step: none is trained again, and every step took its samples once
    # (the plan's resumeStep is the operator's estimate from lagging reports: the members resume at
    # the newest step they hold, which it may trail).
    problems, _history, redone = check_history(read_samples(samples), ITERS, GLOBAL_BATCH, victims={victim})
    assert problems == [] and redone == [], (problems, redone)


def test_children_deleted_while_the_operator_is_down_are_restored_and_training_completes(
    local_cluster: LocalCluster, process_nodes: NodeAgent, namespace: str, tmp_path: Path
) -> None:
    log = tmp_path / "operator.log"
    name = "e2e-kids"
    secret_path = f"/api/v1/namespaces/{namespace}/secrets/{name}-token"
    service_path = f"/api/v1/namespaces/{namespace}/services/{name}"

    show = partial(dump, local_cluster, namespace, log)

    def token() -> str | None:
        code, secret = local_cluster.request("GET", secret_path)
        return base64.b64decode(secret["data"]["token"]).decode() if code == 200 else None

    port = free_port()  # both operator processes: the pods report to the URL they were created with
    with running_operator(local_cluster, namespace, log, port):
        # Long enough that the new spare is warm before training ends (a finished job drops its spares):
        # the job trains on while the operator restarts, and the new spare takes ~10 s to start.
        submit(local_cluster, namespace, make_elastic_job(name, train_iters=5 * ITERS))
        wait_for_step(local_cluster, namespace, name, 5, 300, show)
    before = token()
    assert before
    for path in (secret_path, service_path):
        assert local_cluster.request("DELETE", path)[0] == 200
    with running_operator(local_cluster, namespace, log, port):
        wait_for(
            lambda: token() is not None and local_cluster.request("GET", service_path)[0] == 200,
            60,
            "the Secret and the Service recreated by the new operator",
            details=show,
        )
        assert token() == before, "the recreated Secret holds another token: running pods would be locked out"
        status = job_status(local_cluster, namespace, name)
        victim = status["plan"]["members"][0]["pod"]
        process_nodes.kill_pod_process(namespace, victim, signal.SIGKILL)
        # The plan reaches the survivors and the spare only with the job's first token; the new
        # spare can start only with the recreated Secret (the node agent waits for it, as kubelet).
        wait_for(
            lambda: (
                (s := job_status(local_cluster, namespace, name)).get("epoch", 0) >= 2 and s.get("sparesReady") == 1
            ),
            180,
            "the spare promoted and a new spare running",
            details=show,
        )
        final = wait_for_phase(local_cluster, namespace, name, "Succeeded", 600, show)
        assert final["recoveries"] == 1 and final["step"] == 5 * ITERS, show()


def test_a_killed_pod_of_a_distributed_optimizer_job_is_restored_from_its_buddy_copy(
    local_cluster: LocalCluster, process_nodes: NodeAgent, namespace: str, tmp_path: Path
) -> None:
    log, samples = tmp_path / "operator.log", tmp_path / "samples"
    samples.mkdir()
    job = make_elastic_job(train_iters=ITERS, samples=samples)
    job["spec"]["training"]["optimizer"] = {"distributed": True, "replicaIntervalSteps": 1}
    # Required with this optimizer (the fallback), but none is written before the kill.
    job["spec"]["checkpoint"] = {"path": str(tmp_path / "checkpoints"), "intervalSteps": 10 * ITERS}
    show = partial(dump, local_cluster, namespace, log)

    with running_operator(local_cluster, namespace, log):
        status, recovered = _kill_a_member(
            local_cluster, process_nodes, namespace, job, show, also=lambda s: "buddyCopyStep" in s
        )
        plan = status["plan"]
        assert plan["optimizerState"]["buddies"] is True, plan["optimizerState"]
        # The status names the newest step every pod holds copies of, a refresh or two from the step
        # (they can be ahead of the lagging step reports); the recovery goes back no further.
        assert abs(status["step"] - status["buddyCopyStep"]) <= 3, status
        assert recovered["plan"]["resumeStep"] >= status["buddyCopyStep"], (status["buddyCopyStep"], recovered["plan"])
        victim = plan["members"][0]["pod"]
        (victim_rank,) = plan["members"][0]["ranks"]
        state = recovered["plan"]["optimizerState"]
        assert recovered["plan"]["reason"] == "replace" and state["source"] == "self", state
        from_buddy = [c for c in state.get("copies", []) if c["previousRank"] == victim_rank]
        assert len(from_buddy) == 1 and from_buddy[0]["buddy"] is True, state
        assert from_buddy[0]["holderPod"] != victim, state
        _succeeds_after(local_cluster, namespace, status["step"], show)
    problems, _history, redone = check_history(read_samples(samples), ITERS, GLOBAL_BATCH, victims={victim})
    # The plan may go back to the copy's step: the steps after it (with a refresh every step, the
    # one whose refresh the kill beat, and the one the survivor was in) are trained again, their
    # samples once in the end.
    assert problems == [] and len(redone) <= 2, (problems, redone, state)


def _kill_a_member(
    cluster: LocalCluster,
    nodes: NodeAgent,
    namespace: str,
    job: dict[str, Any],
    show: Callable[[], str],
    also: Callable[[dict[str, Any]], bool] = lambda _: True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Submit ``job``, let it train 5 steps with its spare ready (and ``also`` true of its status),
    and SIGKILL its first member's pod: the job's status at the kill, and once the plan that
    follows is in it."""
    submit(cluster, namespace, job)
    wait_for_step(cluster, namespace, "e2e", 5, 300, show)
    status = wait_for(
        lambda: (s := job_status(cluster, namespace, "e2e")).get("sparesReady", 0) >= 1 and also(s) and s,
        120,
        "the spare to be ready",
        details=show,
    )
    nodes.kill_pod_process(namespace, status["plan"]["members"][0]["pod"], signal.SIGKILL)
    recovered = wait_for(
        lambda: (s := job_status(cluster, namespace, "e2e")).get("epoch", 0) >= 2 and s,
        120,
        "a new plan after the kill",
        details=show,
    )
    return status, recovered


def _succeeds_after(cluster: LocalCluster, namespace: str, step_at_kill: int, show: Callable[[], str]) -> None:
    """Training goes on past the step of the kill and the job succeeds with that one recovery."""
    wait_for(
        lambda: job_status(cluster, namespace, "e2e").get("step", 0) >= step_at_kill + 5,
        180,
        "training to continue after the recovery",
        details=show,
    )
    final = wait_for_phase(cluster, namespace, "e2e", "Succeeded", 600, show)
    assert final["recoveries"] == 1 and final["step"] == ITERS, show()
