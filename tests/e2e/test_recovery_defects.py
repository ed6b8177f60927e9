"""Recovery through the whole stack when failures combine or land at bad moments: the real
operator (subprocess), the local control plane, process nodes running the real trainer agents and
Megatron-Core workers on CPU/gloo.

Scenarios (each a defect once found on main):
- two workers SIGKILLed at the same instant, one spare: the job recovers (one recovery, not a
  cascade of blamed newcomers), succeeds, and every step consumed exactly its global batch once;
- the spare SIGKILLed while it is being promoted (the survivors still joining): the job recovers
  and succeeds, one recovery; every step consumed exactly its global batch once. The kill follows
  the plan as the test sees it in the status (polled every 0.25 s), and a join with fast CPU steps
  can be done and its first step committed by then: that recovery was complete, and the kill is a
  second one, so two recoveries are accepted (nothing but the count differs);
- a failed-peer report that nobody corroborates (a pod's token accusing a healthy peer): no pod
  is deleted, the epoch stays, the report is announced as ignored;
- every node NotReady at once while the pods keep running (a partition): no pod fails, training
  goes on, and after the nodes return the job succeeds without a recovery.
The operator's log, the job, the pods and each pod's log tail are printed when a test fails.
``MEGATRON_E2E_REPEAT=10`` runs the first two scenarios ten times each (in one cluster).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import urllib.request
from collections.abc import Callable, Collection
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from e2e_support import (
    JOBS,
    RECOVERY_RUN_ITERS,
    dump,
    job_status,
    make_elastic_job,
    process_nodes_fixture,
    submit,
    wait_for,
)

from localcluster.cluster import LocalCluster
from localcluster.nodeagent import NodeAgent
from localcluster.operator_run import running_operator
from megatron_contract import wire

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
POOL = "defects"
ITERS = RECOVERY_RUN_ITERS
#: The partition test trains through two waits for the operator's events: a few times longer.
CALM_ITERS = 4 * RECOVERY_RUN_ITERS
REPEAT = range(int(os.environ.get("MEGATRON_E2E_REPEAT", "1")))


process_nodes = process_nodes_fixture(6, POOL)


def _job(name: str, samples: Path, **spec: Any) -> dict[str, Any]:
    spec.setdefault(
        "training", {"globalBatchSize": 6, "microBatchSize": 1, "trainIters": ITERS, "lr": 0.001, "seed": 7}
    )
    samples.mkdir(parents=True, exist_ok=True)
    return make_elastic_job(name, pool=POOL, samples=samples, **spec)


def _events(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    code, body = cluster.request("GET", f"/api/v1/namespaces/{namespace}/events")
    assert code == 200, body
    items: list[dict[str, Any]] = body["items"]
    return items


def _check_samples(
    samples: Path, iters: int, global_batch: int, show: Callable[[], str], killed: Collection[str] = ()
) -> None:
    """Every step 0..iters-1 committed in one epoch, with exactly samples [step*G, (step+1)*G), and
    one loss that every member of the step agrees on bit for bit.

    A pod SIGKILLed (``killed``) after a step's last collective has contributed its samples to it
    but may not have logged them: only the step after a killed pod's last logged one may lack
    samples, never more than that pod's share, and none may be missing or doubled otherwise. A
    killed pod that logged no step (a spare killed in the first step of the epoch it joined) may
    have left one step unlogged: the first of an epoch, lacking exactly one member's share.
    """
    by_step: dict[int, list[int]] = {}
    epochs: dict[int, set[int]] = {}
    losses: dict[int, set[float]] = {}
    last_logged: dict[str, tuple[int, int]] = {}  # killed pod -> (last step it logged, its share)
    records: dict[int, int] = {}  # step -> members that logged it
    for path in samples.glob("*.jsonl"):
        pod = path.stem.rsplit("-", 1)[0]
        for line in path.read_text().splitlines():
            r = json.loads(line)
            by_step.setdefault(r["step"], []).extend(r["samples"])
            epochs.setdefault(r["step"], set()).add(r["epoch"])
            losses.setdefault(r["step"], set()).add(r["loss"])
            records[r["step"]] = records.get(r["step"], 0) + 1
            if pod in killed:
                last_logged[pod] = max(last_logged.get(pod, (-1, 0)), (r["step"], len(r["samples"])))
    assert sorted(by_step) == list(range(iters)), f"steps committed: {sorted(by_step)}\n{show()}"
    never_logged = len(set(killed) - set(last_logged))
    for step, got in sorted(by_step.items()):
        want = list(range(step * global_batch, (step + 1) * global_batch))
        unlogged = sum(share for last, share in last_logged.values() if last + 1 == step)
        share = len(want) // (records[step] + 1)  # one member more than logged the step
        first_of_epoch = step > 0 and epochs[step] != epochs[step - 1]
        if never_logged and first_of_epoch and len(want) - unlogged - len(got) == share:
            unlogged, never_logged = unlogged + share, never_logged - 1
        ok = len(got) == len(set(got)) and set(got) <= set(want) and len(want) - unlogged <= len(got)
        assert ok, f"step {step} consumed {sorted(got)}, not {want}\n{show()}"  # show() only on failure
        assert len(epochs[step]) == 1, f"step {step} committed in epochs {epochs[step]}\n{show()}"
        assert len(losses[step]) == 1, f"step {step}: members disagree on the loss {losses[step]}\n{show()}"


def _running(cluster: LocalCluster, namespace: str, name: str, epoch: int, show: Callable[[], str]) -> dict[str, Any]:
    return wait_for(  # type: ignore[no-any-return]
        lambda: (
            (s := job_status(cluster, namespace, name)).get("phase") == "Running"
            and s.get("epoch") == epoch
            and s.get("step", 0) >= 5
            and s
        ),
        300,
        f"{name} training at epoch {epoch}",
        details=show,
    )


def _succeeded_after_recoveries(
    cluster: LocalCluster, namespace: str, name: str, show: Callable[[], str], allowed: Collection[int] = (1,)
) -> dict[str, Any]:
    final: dict[str, Any] = wait_for(
        lambda: (s := job_status(cluster, namespace, name)).get("phase") in ("Succeeded", "Failed") and s,
        600,
        "the job to end",
        details=show,
    )
    assert final["phase"] == "Succeeded", show()
    assert final["recoveries"] in allowed, show()
    return final


@pytest.mark.parametrize("run", REPEAT)
def test_two_workers_killed_at_once_with_one_spare(
    local_cluster: LocalCluster, process_nodes: NodeAgent, namespace: str, tmp_path: Path, run: int
) -> None:
    log, samples = tmp_path / "operator.log", tmp_path / "samples"
    job = _job("two", samples, replicas=3, spares=1)

    show = partial(dump, local_cluster, namespace, log)

    with running_operator(local_cluster, namespace, log):
        submit(local_cluster, namespace, job)
        status = _running(local_cluster, namespace, "two", 1, show)
        a, b, _ = (m["pod"] for m in status["plan"]["members"])
        process_nodes.kill_pod_process(namespace, a, signal.SIGKILL)
        process_nodes.kill_pod_process(namespace, b, signal.SIGKILL)
        final = _succeeded_after_recoveries(local_cluster, namespace, "two", show)
        # The last plan trained, or it is a growth (a spare warm again) that the job's last step beat.
        grown_at_the_end = final["plan"]["reason"] == "grow" and final["committedEpoch"] == final["epoch"] - 1
        assert final["epoch"] >= 2 and (final["committedEpoch"] == final["epoch"] or grown_at_the_end), show()
        members = {m["pod"] for m in final["plan"]["members"]}
        assert not members & {a, b}, show()
        _check_samples(samples, ITERS, 6, show, killed={a, b})


@pytest.mark.parametrize("run", REPEAT)
def test_spare_killed_while_it_is_promoted(
    local_cluster: LocalCluster, process_nodes: NodeAgent, namespace: str, tmp_path: Path, run: int
) -> None:
    log, samples = tmp_path / "operator.log", tmp_path / "samples"
    job = _job("promo", samples, replicas=2, spares=1)

    show = partial(dump, local_cluster, namespace, log)

    with running_operator(local_cluster, namespace, log):
        submit(local_cluster, namespace, job)
        status = _running(local_cluster, namespace, "promo", 1, show)
        members = [m["pod"] for m in status["plan"]["members"]]
        process_nodes.kill_pod_process(namespace, members[0], signal.SIGKILL)
        plan = wait_for(
            lambda: (s := job_status(local_cluster, namespace, "promo")).get("epoch", 0) >= 2 and s["plan"],
            60,
            "the replacement plan",
            details=show,
        )
        promoted = [m["pod"] for m in plan["members"] if m["pod"] not in members]
        assert len(promoted) == 1, plan
        process_nodes.kill_pod_process(namespace, promoted[0], signal.SIGKILL)  # while the survivors join
        _succeeded_after_recoveries(local_cluster, namespace, "promo", show, allowed=(1, 2))
        _check_samples(samples, ITERS, 6, show, killed={members[0], promoted[0]})


def _report(url: str, token: str, report: dict[str, Any]) -> int:
    req = urllib.request.Request(
        url + wire.OPERATOR_REPORT_PATH,
        data=json.dumps(report).encode(),
        method="POST",
        headers={"Content-Type": "application/json", wire.AUTH_HEADER: f"{wire.AUTH_SCHEME} {token}"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return int(resp.status)


def test_an_uncorroborated_peer_report_deletes_nobody_and_partitions_fail_no_pod(
    local_cluster: LocalCluster, process_nodes: NodeAgent, namespace: str, tmp_path: Path
) -> None:
    log, samples = tmp_path / "operator.log", tmp_path / "samples"
    job = _job(
        "calm",
        samples,
        replicas=2,
        spares=1,
        training={"globalBatchSize": 6, "microBatchSize": 1, "trainIters": CALM_ITERS, "lr": 0.001, "seed": 7},
    )

    show = partial(dump, local_cluster, namespace, log)

    with running_operator(local_cluster, namespace, log) as url:
        submit(local_cluster, namespace, job)
        status = _running(local_cluster, namespace, "calm", 1, show)
        accuser, accused = (m["pod"] for m in status["plan"]["members"])
        code, secret = local_cluster.request("GET", f"/api/v1/namespaces/{namespace}/secrets/calm-token")
        assert code == 200, secret
        token = base64.b64decode(secret["data"][wire.TOKEN_SECRET_KEY]).decode()
        uid = local_cluster.request("GET", JOBS.format(ns=namespace) + "/calm")[1]["metadata"]["uid"]
        code = _report(
            url,
            token,
            {
                "jobUid": uid,
                "pod": accuser,
                "epoch": 1,
                "state": "training",
                "healthy": True,
                "failedPeers": [{"epoch": 1, "pod": accused, "reason": "a lie"}],
            },
        )
        assert code == 200
        wait_for(
            lambda: any(e.get("reason") == "PeerReportIgnored" for e in _events(local_cluster, namespace)),
            60,
            "the report announced as ignored",
            details=show,
        )
        step = job_status(local_cluster, namespace, "calm")["step"]

        # Every node NotReady at once, the pods still running and reporting.
        process_nodes.set_ready(False)
        try:
            wait_for(
                lambda: any(e.get("reason") == "NodesNotReadyTogether" for e in _events(local_cluster, namespace)),
                60,
                "the partition announced",
                details=show,
            )
            wait_for(
                lambda: job_status(local_cluster, namespace, "calm").get("step", 0) >= step + 10,
                120,
                "training to go on while the nodes are NotReady",
                details=show,
            )
        finally:
            process_nodes.set_ready(True)
        final = wait_for(
            lambda: (s := job_status(local_cluster, namespace, "calm")).get("phase") in ("Succeeded", "Failed") and s,
            600,
            "the job to end",
            details=show,
        )
        assert final["phase"] == "Succeeded" and final["recoveries"] == 0 and final["epoch"] == 1, show()
        assert {m["pod"] for m in final["plan"]["members"]} == {accuser, accused}
        assert not any(
            e.get("reason") in ("PeerReportedFailure", "NodeNotReady") for e in _events(local_cluster, namespace)
        ), show()
        _check_samples(samples, CALM_ITERS, 6, show)
