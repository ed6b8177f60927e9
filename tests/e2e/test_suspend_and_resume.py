"""End to end, all real: ``spec.suspend`` stops a training job with its work in a checkpoint, and
``false`` resumes it from there.

The operator (subprocess) reconciles a job of two workers on process nodes (the trainer agent and
Megatron-Core workers, CPU/gloo) next to its twin, the same job that is never suspended. Mid-run the
job is patched ``suspend: true``: its members train to a step boundary, write a distributed
checkpoint of that step (complete and verified), and the operator deletes every pod. Checked: the
phase is Suspended, the Suspended condition is True and names the step, the checkpoint of that step
is on disk, no pod of the job is left and no step beyond it was committed. Patched ``suspend:
false``, new pods load the checkpoint and the job trains to the end. Checked: the job succeeds with
no recovery and no failure recorded, the Suspended condition turned False (Resumed), every step was
committed once (none redone) with exactly its global batch, the steps after the checkpoint in the
resumed epoch, and every loss is bitwise the twin's.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    JOBS,
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

from localcluster.chaos import check_history, compare_losses, read_samples
from localcluster.cluster import LocalCluster
from localcluster.jobs import GLOBAL_BATCH
from localcluster.nodeagent import NodeAgent
from localcluster.operator_run import running_operator
from megatron_contract.wire import LABEL_JOB
from megatron_trainer.worker.checkpoint_files import MANIFEST, checkpoint_dir

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

process_nodes = process_nodes_fixture(4, "suspend")
ITERS = LONG_RUN_ITERS


def _patch_suspend(cluster: LocalCluster, namespace: str, name: str, value: bool) -> None:
    code, body = cluster.request(
        "PATCH",
        JOBS.format(ns=namespace) + f"/{name}",
        {"spec": {"suspend": value}},
        content_type="application/merge-patch+json",
    )
    assert code == 200, body


def _pods(cluster: LocalCluster, namespace: str, name: str) -> list[str]:
    code, body = cluster.request("GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector={LABEL_JOB}%3D{name}")
    assert code == 200, body
    return [p["metadata"]["name"] for p in body["items"]]


def _suspended_condition(status: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == "Suspended"), {})


def test_suspend_checkpoints_and_stops_the_pods_and_resume_goes_on_from_that_step(
    local_cluster: LocalCluster,
    process_nodes: NodeAgent,
    namespace: str,
    tmp_path: Path,
) -> None:
    log = tmp_path / "operator.log"
    samples, reference, checkpoints = tmp_path / "samples", tmp_path / "reference", tmp_path / "checkpoints"
    samples.mkdir()
    reference.mkdir()
    show = partial(dump, local_cluster, namespace, log)
    checkpoint = {"path": str(checkpoints), "intervalSteps": 1000}  # no periodic one: only the suspension's
    job = make_elastic_job(
        "suspend", pool="suspend", train_iters=ITERS, spares=0, samples=samples, checkpoint=checkpoint
    )
    twin = make_elastic_job("twin", pool="suspend", train_iters=ITERS, spares=0, samples=reference)
    with running_operator(local_cluster, namespace, log):
        submit(local_cluster, namespace, job)
        submit(local_cluster, namespace, twin)
        wait_for_step(local_cluster, namespace, "suspend", 3, 300, show)

        _patch_suspend(local_cluster, namespace, "suspend", True)
        stopped = wait_for_phase(local_cluster, namespace, "suspend", "Suspended", 120, show)
        cond = _suspended_condition(stopped)
        step = stopped.get("checkpointStep")
        assert cond.get("status") == "True" and cond.get("reason") == "JobSuspended", show()
        assert step is not None and 3 < step < ITERS and f"checkpoint of step {step}" in cond["message"], stopped
        assert (checkpoint_dir(checkpoints, step) / MANIFEST).is_file(), sorted(p.name for p in checkpoints.iterdir())
        wait_for(lambda: _pods(local_cluster, namespace, "suspend") == [], 60, "the job's pods to go", details=show)
        before = read_samples(samples)
        assert max(s for _, s in before) == step - 1, sorted({s for _, s in before})  # trained up to it, no further

        _patch_suspend(local_cluster, namespace, "suspend", False)
        final = wait_for_phase(local_cluster, namespace, "suspend", "Succeeded", 600, show)
        wait_for(
            lambda: job_status(local_cluster, namespace, "twin").get("phase") == "Succeeded",
            600,
            "the twin to succeed",
            details=show,
        )
    assert final.get("recoveries", 0) == 0 and "lastFailure" not in final, final
    assert _suspended_condition(final).get("reason") == "Resumed", final
    records = read_samples(samples)
    problems, history, redone = check_history(records, ITERS, GLOBAL_BATCH, victims=set())
    assert problems == [] and redone == [], (problems, redone)
    suspended_epoch = stopped["epoch"]
    assert all((epoch > suspended_epoch) == (s >= step) for s, epoch in history.items()), history
    losses = compare_losses(records, history, read_samples(reference))
    assert losses["unequalWhileFullMesh"] == [] and losses["bitwiseUntil"] == ITERS, losses
    print(f"suspended at step {step} (epoch {suspended_epoch}); resumed in epoch {final['epoch']}")
