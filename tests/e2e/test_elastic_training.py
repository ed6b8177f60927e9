"""End to end, all real: the operator (subprocess) reconciles a MegatronJob on the local control
plane; the node agent runs its pods as processes running the trainer agent and Megatron-Core
workers on CPU/gloo. Scenario: the job trains; a worker pod's process is SIGKILLed (a GPU dies);
the operator promotes the hot spare with the next epoch, the survivors reconfigure in place, and
training continues from where it was to the last step; the job ends Succeeded with one recovery."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from e2e_support import dump, job_status, make_elastic_job, wait_for

from localcluster.cluster import LocalCluster
from localcluster.nodeagent import NodeAgent
from localcluster.operator_run import running_operator

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def process_nodes(local_cluster: LocalCluster) -> NodeAgent:
    return local_cluster.add_process_nodes(4, gpus_per_node=1, prefix="e2e")


def test_spare_replaces_a_killed_worker_and_training_completes(
    local_cluster: LocalCluster, process_nodes: NodeAgent, namespace: str, tmp_path: Path
) -> None:
    log = tmp_path / "operator.log"
    job = make_elastic_job(train_iters=60)

    def show() -> str:
        return dump(local_cluster, namespace, log)

    with running_operator(local_cluster, namespace, log):
        code, body = local_cluster.request(
            "POST", f"/apis/megatron.dev/v1alpha1/namespaces/{namespace}/megatronjobs", job
        )
        assert code == 201, body
        status = wait_for(
            lambda: (s := job_status(local_cluster, namespace, "e2e")).get("step", 0) >= 5 and s,
            "training to reach step 5",
            300,
            show,
        )
        plan = status["plan"]
        assert status["epoch"] == 1 and plan["sizes"]["dp"] == 2
        victim = plan["members"][0]["pod"]
        step_at_kill = status["step"]
        process_nodes.kill_pod_process(namespace, victim, signal.SIGKILL)

        recovered = wait_for(
            lambda: (s := job_status(local_cluster, namespace, "e2e")).get("epoch", 0) >= 2 and s,
            "a new plan after the kill",
            120,
            show,
        )
        members = [m["pod"] for m in recovered["plan"]["members"]]
        assert victim not in members and recovered["plan"]["sizes"]["dp"] == 2, "the spare should replace the victim"
        assert recovered["plan"]["reason"] == "replace"
        # Status reports steps with a lag, so the step seen before the kill is a lower bound of the
        # steps done; survivors keep every completed step, so training resumes at or after it.
        assert recovered["plan"]["resumeStep"] >= step_at_kill
        wait_for(
            lambda: job_status(local_cluster, namespace, "e2e").get("step", 0) >= step_at_kill + 5,
            "training to continue after the recovery",
            180,
            show,
        )
        final = wait_for(
            lambda: (s := job_status(local_cluster, namespace, "e2e")).get("phase") == "Succeeded" and s,
            "the job to succeed",
            600,
            show,
        )
        assert final["recoveries"] == 1 and final["step"] == 60, show()
