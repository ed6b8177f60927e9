"""queueing.py's pure parts: the Workload a queued job gets, the verdict read from a Workload, and
the status patch that gives an evicted Workload's quota back. (Against Kueue itself:
tests/integration/test_operator_kueue.py.)"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

from operator_factories import make_spec

from megatron_contract import wire
from megatron_operator import kube, queueing
from megatron_operator.builders import JobRef
from megatron_operator.queueing import Verdict
from megatron_operator.suspend import Stage, Suspension

JOB = JobRef("gpt", "ns", "uid-1")
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _workload(status: dict[str, Any] | None = None, active: bool = True) -> dict[str, Any]:
    return {
        "metadata": {"name": "megatronjob-gpt", "resourceVersion": "42", "generation": 3},
        "spec": {"active": active},
        "status": status or {},
    }


def _cond(type_: str, status: str, reason: str = "R", message: str = "") -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": "t0"}


ADMISSION = {
    "clusterQueue": "cq",
    "podSetAssignments": [
        {"name": "workers", "count": 4, "flavors": {"nvidia.com/gpu": "h100", "cpu": "default"}},
        {"name": "spares", "count": 1, "flavors": {"nvidia.com/gpu": "h100"}},
    ],
}
FLAVORS = {"h100": {"gpu": "h100"}, "default": {}}


def test_queue_name_is_the_label() -> None:
    assert queueing.queue_name({"metadata": {"labels": {queueing.QUEUE_LABEL: "team-a"}}}) == "team-a"
    assert queueing.queue_name({"metadata": {"labels": {queueing.QUEUE_LABEL: ""}}}) is None
    assert queueing.queue_name({"metadata": {}}) is None


def test_the_workload_has_workers_and_spares_as_pod_sets_owned_by_the_job() -> None:
    spec = make_spec(4, spares=2, tp=2, gpus_per_pod=2)
    wl = queueing.build_workload(JOB, spec, "team-a")
    assert wl["metadata"]["name"] == "megatronjob-gpt" and wl["metadata"]["namespace"] == "ns"
    [owner] = wl["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == (wire.KIND, "uid-1", True)
    assert wl["metadata"]["labels"] == {wire.LABEL_JOB: "gpt", queueing.QUEUE_LABEL: "team-a"}
    assert wl["spec"]["queueName"] == "team-a" and wl["spec"]["active"] is True
    sets = {p["name"]: p for p in wl["spec"]["podSets"]}
    assert {n: p["count"] for n, p in sets.items()} == {"workers": 4, "spares": 2}
    for pod_set in sets.values():
        trainer = pod_set["template"]["spec"]["containers"][0]
        assert trainer["resources"]["requests"]["nvidia.com/gpu"] == "2"
        assert "hostname" not in pod_set["template"]["spec"]
    assert sets["spares"]["template"]["metadata"]["labels"][wire.LABEL_ROLE] == wire.ROLE_SPARE


def test_no_spares_no_spare_pod_set() -> None:
    wl = queueing.build_workload(JOB, make_spec(2, spares=0), "q")
    assert [p["name"] for p in wl["spec"]["podSets"]] == ["workers"]


def test_pending_carries_kueues_reason() -> None:
    gate = queueing.read_gate(_workload({"conditions": [_cond("QuotaReserved", "False", "Pending", "no quota")]}), {})
    assert (gate.verdict, gate.message) == (Verdict.PENDING, "no quota")
    assert queueing.read_gate(_workload(), {}).verdict is Verdict.PENDING
    gate = queueing.read_gate(_workload(active=False), {})
    assert gate.verdict is Verdict.PENDING and "deactivated" in gate.message


def test_quota_reserved_but_not_admitted_is_pending() -> None:
    status = {"admission": ADMISSION, "conditions": [_cond("QuotaReserved", "True"), _cond("Admitted", "False")]}
    assert queueing.read_gate(_workload(status), FLAVORS).verdict is Verdict.PENDING


def test_admitted_gives_each_role_its_flavors_node_labels() -> None:
    checks = [{"name": "prov", "podSetUpdates": [{"name": "workers", "nodeSelector": {"zone": "a"}}]}]
    status = {
        "admission": ADMISSION,
        "admissionChecks": checks,
        "conditions": [_cond("QuotaReserved", "True"), _cond("Admitted", "True")],
    }
    gate = queueing.read_gate(_workload(status), FLAVORS)
    assert gate.verdict is Verdict.ADMITTED and "cq" in gate.message
    assert gate.node_selector(wire.ROLE_WORKER) == {"gpu": "h100", "zone": "a"}
    assert gate.node_selector(wire.ROLE_SPARE) == {"gpu": "h100"}
    assert queueing.flavors_of(_workload(status)) == {"h100", "default"}


def test_evicted_while_still_holding_quota() -> None:
    status = {
        "admission": ADMISSION,
        "conditions": [_cond("Admitted", "True"), _cond("Evicted", "True", "Preempted", "by vip")],
    }
    gate = queueing.read_gate(_workload(status), FLAVORS)
    assert gate.verdict is Verdict.EVICTED and gate.message == "Preempted: by vip"
    # Once the quota is given back it is simply pending again.
    released = {"conditions": [_cond("Evicted", "True", "Preempted"), _cond("QuotaReserved", "False", "Pending")]}
    assert queueing.read_gate(_workload(released), FLAVORS).verdict is Verdict.PENDING


def test_node_selector_merge_keeps_the_pods_own() -> None:
    pod = {"spec": {"nodeSelector": {"pool": "p", "gpu": "any"}}}
    assert queueing.with_node_selector(pod, {"gpu": "h100"})["spec"]["nodeSelector"] == {"pool": "p", "gpu": "h100"}
    bare: dict[str, Any] = {"spec": {}}
    assert queueing.with_node_selector(bare, {}) == {"spec": {}}


def _release(reason: str) -> dict[str, Any]:
    status = {
        "admission": ADMISSION,
        "conditions": [
            _cond("QuotaReserved", "True"),
            _cond("Admitted", "True"),
            _cond("Evicted", "True", reason, "why"),
        ],
    }
    return queueing.release_status(_workload(status), NOW)


def test_release_after_preemption_requeues() -> None:
    patch = _release("Preempted")
    assert patch["metadata"] == {"resourceVersion": "42"}  # a conflict rather than a lost update
    assert patch["status"]["admission"] is None
    conds = {c["type"]: c for c in patch["status"]["conditions"]}
    assert conds["Requeued"]["status"] == "True" and conds["Requeued"]["reason"] == "Preempted"
    assert (conds["QuotaReserved"]["status"], conds["QuotaReserved"]["reason"]) == ("False", "Pending")
    assert conds["QuotaReserved"]["lastTransitionTime"] == "2026-01-02T03:04:05Z"
    assert conds["Admitted"]["status"] == "False"
    assert conds["Evicted"]["status"] == "True" and conds["Evicted"]["lastTransitionTime"] == "t0"
    assert conds["QuotaReserved"]["observedGeneration"] == 3


def test_release_after_deactivation_does_not_requeue() -> None:
    conds = {c["type"]: c for c in _release("Deactivated")["status"]["conditions"]}
    assert conds["Requeued"]["status"] == "False"


def test_without_kueue_a_labelled_job_is_not_gated(monkeypatch: Any) -> None:
    calls: list[str] = []

    async def not_served(group: str, version: str, plural: str, body: dict[str, Any]) -> bool:
        calls.append(plural)
        raise kube.NotServed("workloads.kueue.x-k8s.io/v1beta2 is not served")

    monkeypatch.setattr(kube, "create_custom", not_served)
    gate = queueing.QueueGate(JOB, lambda: None)
    body = {"metadata": {"labels": {queueing.QUEUE_LABEL: "team-a"}}}
    spec = make_spec(2)
    assert asyncio.run(gate.gate(body, spec)) is None
    assert asyncio.run(gate.gate(body, spec)) is None
    assert calls == ["workloads"]  # asked once, not on every pass
    assert asyncio.run(gate.gate({"metadata": {}}, spec)) is None  # no label: never asked


def test_a_created_workload_not_watched_yet_keeps_the_pods_back(monkeypatch: Any) -> None:
    created: list[dict[str, Any]] = []

    async def create(group: str, version: str, plural: str, body: dict[str, Any]) -> bool:
        created.append(body)
        return True

    monkeypatch.setattr(kube, "create_custom", create)
    gate = queueing.QueueGate(JOB, lambda: None)
    body = {"metadata": {"labels": {queueing.QUEUE_LABEL: "team-a"}}}
    for _ in range(2):
        result = asyncio.run(gate.gate(body, make_spec(2)))
        assert result is not None and result.verdict is Verdict.PENDING
    assert len(created) == 1


def test_not_admitted_is_a_suspension_request() -> None:
    assert queueing.suspend_request(None) is None
    assert queueing.suspend_request(queueing.Gate(Verdict.ADMITTED, "ok")) is None
    pending = queueing.suspend_request(queueing.Gate(Verdict.PENDING, "no quota"))
    assert pending is not None and pending.reason == "WaitingForQueueAdmission" and "no quota" in pending.message
    evicted = queueing.suspend_request(queueing.Gate(Verdict.EVICTED, "Preempted: by vip"))
    assert evicted is not None and evicted.reason == "EvictedByQueue"
    assert queueing.admitted_condition(queueing.Gate(Verdict.ADMITTED, "")) == (True, "AdmittedByQueue")
    assert queueing.admitted_condition(queueing.Gate(Verdict.EVICTED, "")) == (False, "EvictedByQueue")


def test_the_eviction_time_is_read() -> None:
    evicted = _cond("Evicted", "True", "Preempted")
    evicted["lastTransitionTime"] = "2026-01-02T03:00:05Z"
    gate = queueing.read_gate(_workload({"admission": ADMISSION, "conditions": [evicted]}), FLAVORS)
    assert gate.since == datetime(2026, 1, 2, 3, 0, 5, tzinfo=UTC)


def _evicted(seconds_ago: float) -> queueing.Gate:
    return queueing.Gate(Verdict.EVICTED, "Preempted: by vip", since=NOW - timedelta(seconds=seconds_ago))


def test_an_eviction_waits_for_the_checkpoint_within_the_limit() -> None:
    saving = Suspension(Stage.SAVING, (False, "Suspending", ""))
    assert queueing.forced_stop(_evicted(10), saving, 60.0, NOW, 4) is None
    for done in (Stage.STOP, Stage.STOPPED, Stage.RESUME):
        assert queueing.forced_stop(_evicted(600), Suspension(done, None), 60.0, NOW, 4) is None
    assert queueing.forced_stop(_evicted(600), None, 60.0, NOW, 4) is None


def test_an_eviction_stops_the_pods_without_a_checkpoint_when_none_can_be_had() -> None:
    for stage in (Stage.FAILED, Stage.TIMED_OUT):  # the checkpoint failed: no waiting
        forced = queueing.forced_stop(_evicted(1), Suspension(stage, None), 60.0, NOW, 4)
        assert forced is not None and forced.stage is Stage.STOP and forced.step == 4
    late = queueing.forced_stop(_evicted(61), Suspension(Stage.WAIT, None), 60.0, NOW, None)
    assert late is not None and late.condition is not None
    value, reason, message = late.condition
    assert (value, reason) == (True, "EvictedByQueue") and "resumes from the start" in message
    # A job without spec.checkpoint (limit 0): at once.
    assert queueing.forced_stop(_evicted(0), Suspension(Stage.SAVE, None), 0.0, NOW, None) is not None


def test_a_workload_of_another_size_is_made_again(monkeypatch: Any) -> None:
    deleted: list[str] = []

    async def delete(group: str, version: str, plural: str, namespace: str, name: str) -> None:
        deleted.append(name)

    monkeypatch.setattr(kube, "delete_custom", delete)
    spec = make_spec(2, spares=1)
    body = {"metadata": {"labels": {queueing.QUEUE_LABEL: "team-a"}}}
    stored = queueing.build_workload(JOB, spec, "team-a")
    stored["metadata"]["resourceVersion"] = "7"
    gate = queueing.QueueGate(JOB, lambda: stored)
    assert asyncio.run(gate.gate(body, spec)) == queueing.Gate(
        Verdict.PENDING, "waiting for Kueue to admit the Workload"
    )
    assert deleted == []
    resized = asyncio.run(gate.gate(body, make_spec(3, spares=1)))
    assert resized is not None and resized.verdict is Verdict.PENDING and "made again" in resized.message
    assert deleted == ["megatronjob-gpt"]


def test_a_workload_of_an_older_job_of_that_name_is_not_used() -> None:
    stored = queueing.build_workload(JobRef("gpt", "ns", "uid-old"), make_spec(2), "team-a")
    stored["status"] = {"admission": ADMISSION, "conditions": [_cond("Admitted", "True")]}
    gate = queueing.QueueGate(JOB, lambda: stored)
    result = asyncio.run(gate.gate({"metadata": {"labels": {queueing.QUEUE_LABEL: "team-a"}}}, make_spec(2)))
    assert result is not None and result.verdict is Verdict.PENDING and "being deleted" in result.message


def test_the_quota_is_given_back_once_per_version(monkeypatch: Any) -> None:
    patches: list[dict[str, Any]] = []

    async def patch(group: str, version: str, plural: str, namespace: str, name: str, body: dict[str, Any]) -> bool:
        patches.append(body)
        return True

    monkeypatch.setattr(kube, "patch_custom_status", patch)
    evicted = {"admission": ADMISSION, "conditions": [_cond("Evicted", "True", "Preempted")]}
    stored = _workload(evicted)
    gate = queueing.QueueGate(JOB, lambda: stored)
    assert asyncio.run(gate.release()) is True
    assert asyncio.run(gate.release()) is False  # the watch has not brought the released version yet
    assert len(patches) == 1 and patches[0]["metadata"]["resourceVersion"] == "42"
