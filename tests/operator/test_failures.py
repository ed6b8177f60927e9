"""Failure classification (``megatron_operator.failures``) and heartbeats (``.heartbeats``), pure.

Scenarios: every pod-level source (deleting, evicted, phase Failed, container terminated with an
error, container restarted, node NotReady or Unknown) marks a pod failed with its reason; exit 0
is success; a running pod with an address is ready, one without is pending; heartbeat watchdogs are
armed by the first heartbeat only; self-reported failure, accusations by epoch, the step every
member completed, the newest checkpoint, the steps of each pod's host copies of optimizer shards
(of one epoch), a restore that gave up and success of all members are read from the book.
"""

from __future__ import annotations

import pytest
from operator_factories import make_node, make_pod

from megatron_contract.agent import AgentReport
from megatron_operator.failures import FailureReason, PodFacts, PodHealth, classify_pod, node_ready_status
from megatron_operator.heartbeats import HeartbeatBook


@pytest.mark.parametrize(
    ("pod", "health", "reason"),
    [
        (make_pod("a"), PodHealth.READY, None),
        (make_pod("a", phase="Pending", ip=None), PodHealth.PENDING, None),
        (make_pod("a", deleting=True), PodHealth.FAILED, FailureReason.POD_DELETED),
        (make_pod("a", phase="Failed", reason="Evicted"), PodHealth.FAILED, FailureReason.POD_EVICTED),
        (make_pod("a", phase="Failed"), PodHealth.FAILED, FailureReason.POD_FAILED),
        (
            make_pod("a", terminated={"exitCode": 137, "reason": "OOMKilled"}),
            PodHealth.FAILED,
            FailureReason.CONTAINER_TERMINATED,
        ),
        (make_pod("a", phase="Succeeded", terminated={"exitCode": 0}), PodHealth.SUCCEEDED, None),
        (make_pod("a", restarts=1), PodHealth.FAILED, FailureReason.CONTAINER_RESTARTED),
        (make_pod("a", node="dead"), PodHealth.FAILED, FailureReason.NODE_NOT_READY),
        (make_pod("a", node="lost"), PodHealth.FAILED, FailureReason.NODE_NOT_READY),
    ],
)
def test_classify_pod(pod: dict, health: PodHealth, reason: FailureReason | None) -> None:
    nodes = {"gpu-0": "True", "dead": "False", "lost": "Unknown"}
    got_health, failure = classify_pod(PodFacts.of(pod), nodes)
    assert got_health is health
    assert (failure.reason if failure else None) is reason
    if failure:
        assert failure.pod == "a" and failure.message


def test_pod_facts_read_labels() -> None:
    facts = PodFacts.of(make_pod("job-12", role="spare", index=12))
    assert (facts.role, facts.serial, facts.ip, facts.node) == ("spare", 12, "127.64.0.9", "gpu-0")


def test_node_ready_status() -> None:
    assert node_ready_status(make_node(ready="False")) == "False"
    assert node_ready_status({"metadata": {"name": "x"}, "status": {}}) == "Unknown"


def _report(pod: str, epoch: int = 1, **kw: object) -> AgentReport:
    return AgentReport.model_validate({"jobUid": "j", "pod": pod, "epoch": epoch, "state": "training", **kw})


def test_heartbeat_watchdog_is_armed_by_the_first_heartbeat() -> None:
    book = HeartbeatBook()
    book.record(_report("a"), now=100.0)
    assert book.missing("j", ["a", "b"], timeout=5, now=104.0) == []
    assert book.missing("j", ["a", "b"], timeout=5, now=106.0) == ["a"]  # b never reported: not armed
    book.record(_report("a"), now=106.0)
    assert book.missing("j", ["a"], timeout=5, now=107.0) == []


def test_book_reads_accusations_steps_and_success() -> None:
    book = HeartbeatBook()
    book.record(_report("a", step=9, failedPeers=[{"epoch": 1, "rank": 3, "reason": "timeout"}]), 0)
    book.record(_report("b", step=7, healthy=False), 0)
    assert [(x.reporter, x.rank) for x in book.accusations("j", 1)] == [("a", 3)]
    assert book.accusations("j", 2) == []
    assert book.self_reported_failed("j", ["a", "b"]) == ["b"]
    assert book.completed_step("j", ["a", "b"]) == 7
    assert book.epochs("j") == {"a": 1, "b": 1}
    assert book.checkpoint_step("j") is None
    book.record(_report("b", step=8, checkpointStep=5), 0)
    book.record(_report("a", step=9, checkpointStep=0), 0)
    assert book.checkpoint_step("j") == 5  # a checkpoint is global: the newest any agent reported
    book.record(_report("b", step=8, replicaSteps=[8, 7]), 0)
    book.record(_report("c", epoch=2, replicaSteps=[3]), 0)
    assert book.replica_steps("j", 1) == {"a": [], "b": [8, 7]}  # copies of another epoch do not count
    assert book.checkpoint_unusable("j") is None
    book.record(_report("b", step=8, checkpointUnusable="no usable checkpoint at or before step 5"), 0)
    assert book.checkpoint_unusable("j") == "no usable checkpoint at or before step 5"
    assert not book.finished("j", ["a", "b"], 10)
    book.record(_report("a", step=10, state="succeeded"), 1)
    book.record(_report("b", step=10), 1)
    assert not book.finished("j", ["a", "b"], 10)  # b still writes its final checkpoint
    book.record(_report("b", step=10, state="succeeded"), 1)
    assert book.finished("j", ["a", "b"], 10)
    book.forget("j")
    assert book.last("j", "a") is None


def test_training_finished_in_an_epoch_the_plan_in_force_replaced() -> None:
    # The shrunk mesh (a alone, epoch 3) trained to the end while the operator planned a grow
    # (epoch 4: a and the promoted spare c); a refused the plan, finished, and stops reporting.
    book = HeartbeatBook()
    book.record(_report("a", epoch=3, step=10, state="succeeded"), 1)
    book.record(_report("c", epoch=4, state="reconfiguring"), 1)
    assert book.finished("j", ["a", "c"], 10)
    assert book.finished("j", ["c"], 10)  # a declared failed since: still finished
