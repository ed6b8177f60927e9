"""The kopf-facing layer (``megatron_operator.handlers``) and a job controller's report intake,
with no API server: a fast test of each handler function.

Scenarios: the pod index keys pods by (namespace, job) and keeps their facts; the node index keeps
Ready; the registry routes reports to the job's controller by UID and knows its token; a report
with an older epoch schedules an immediate re-push and wakes the controller; a report holding the
epoch counts as acknowledgement (no push is due to it any more, not even a retry of a push that
failed meanwhile) and wakes nobody, nor does a member's step of the plan's epoch until the last
member's; a report naming a failed peer or an unhealthy agent wakes it; pod events
wake only their job's controller, and only when the pod is new or gone or a fact the operator keeps
of it changed other than the role and replica labels it sets itself; node events wake every job
only when a node's readiness, labels or draining state changed, and half a second later (a burst
of them wakes one pass; a pass begun meanwhile voids the call still due); a deleted Service has only its
job's controller apply its children at once; the diff base kopf keeps is kopf's own, made without
copying the status; a wake-up call keeps when and why it first came (a pod, node or report event)
until the pass takes it; at startup kopf is told to keep its bookkeeping in our annotations and to end an
object's task half a second after its last event (its default 5 s held thousands of pod bodies).
"""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
from operator_factories import JOB_UID, make_job, make_node, make_pod, make_pod_refs, make_spec

from megatron_contract import wire
from megatron_contract.agent import AgentReport
from megatron_operator import handlers
from megatron_operator.builders import JobRef
from megatron_operator.controller import JobController
from megatron_operator.planner import plan_mesh
from megatron_operator.push import PushOutcome, PushResult
from megatron_operator.settings import OperatorSettings


def _registry_with_job() -> tuple[handlers.Registry, JobController]:
    registry = handlers.Registry(OperatorSettings(leader_election=False))
    plan = plan_mesh(make_spec(replicas=2), JOB_UID, make_pod_refs(2), [], [], None).plan
    assert plan is not None
    body: dict[str, Any] = make_job(status={"phase": "Running", "epoch": 1, "plan": plan.to_wire()})
    job = JobRef.of(body)
    ctl = JobController(job, body, registry.settings, registry.book, registry.pusher, pods_of=list, nodes=dict)
    ctl.token = "tok"
    ctl.delivery.acked_epoch = 1
    registry.by_uid[job.uid] = ctl
    registry.by_key[(job.namespace, job.name)] = ctl
    return registry, ctl


def _report(pod: str, epoch: int, **kw: Any) -> AgentReport:
    return AgentReport.model_validate({"jobUid": JOB_UID, "pod": pod, "epoch": epoch, "state": "training", **kw})


def test_indexes() -> None:
    pod = make_pod("job-3", index=3)
    key_value = asyncio.run(handlers.pods_by_job(namespace="ns", labels=pod["metadata"]["labels"], body=pod))  # type: ignore[arg-type]
    ((key, facts),) = key_value.items()
    assert key == ("ns", "job") and facts.name == "job-3" and facts.serial == 3
    readiness = asyncio.run(handlers.node_readiness(name="gpu-1", body=make_node("gpu-1", "False")))  # type: ignore[arg-type]
    assert readiness == {"gpu-1": "False"}


def test_reports_route_to_the_controller() -> None:
    registry, ctl = _registry_with_job()
    assert registry.token_for(JOB_UID) == "tok" and registry.token_for("other") is None
    assert registry.accept_reports(JOB_UID, [_report("p0", 1)]) == 1
    # Held: acknowledged, and nothing for a pass to do before its time (the next push leaves it out).
    assert ctl.delivery.acked == {"p0"} and not ctl.wake.is_set()
    assert registry.book.last(JOB_UID, "p0") is not None


def test_a_member_that_reports_the_plan_is_due_no_push() -> None:
    registry, ctl = _registry_with_job()
    ctl.delivery.push_due = {"p0": 5.0, "p1": 7.0}  # retries after failed pushes
    ctl.delivery.push_backoff = {"p0": 1.0, "p1": 1.0}
    registry.accept_reports(JOB_UID, [_report("p0", 1)])
    assert ctl.delivery.push_due == {"p1": 7.0} and ctl.delivery.due_in(4.0) == [3.0]
    # A push that failed for a member which reported the plan meanwhile schedules no retry.
    ctl.delivery.acked.add("p1")
    failed = PushOutcome("p1", PushResult.ERROR, "TimeoutError", 5.0)
    assert ctl.delivery._settle(failed)
    assert ctl.delivery.push_due == {} and ctl.delivery.due_in(4.0) == []


def test_only_the_last_members_first_step_wakes_the_controller() -> None:
    registry, ctl = _registry_with_job()
    assert ctl.status.committed_epoch < 1  # the plan's epoch has not trained yet
    registry.accept_reports(JOB_UID, [_report("p0", 1, step=5), _report("p0", 1, step=6)])
    assert not ctl.wake.is_set()
    registry.accept_reports(JOB_UID, [_report("spare-9", 1, step=5)])  # not a member
    assert not ctl.wake.is_set()
    registry.accept_reports(JOB_UID, [_report("p1", 1, step=5)])
    assert ctl.wake.is_set() and ctl.wake.why == "report"


def test_older_epoch_schedules_a_push_now() -> None:
    registry, ctl = _registry_with_job()
    ctl.delivery.acked = {"p0", "p1"}
    registry.accept_reports(JOB_UID, [_report("p1", 0)])
    assert ctl.delivery.acked == {"p0"} and ctl.delivery.push_due["p1"] == 0.0 and ctl.wake.is_set()


def test_failed_peer_and_unhealthy_agent_wake_the_controller() -> None:
    for report in (
        _report("p0", 1, failedPeers=[{"epoch": 1, "rank": 1, "reason": "x"}]),
        _report("spare-9", 0, healthy=False),
    ):
        registry, ctl = _registry_with_job()
        ctl.delivery.acked = {"p0", "p1"}
        registry.accept_reports(JOB_UID, [report])
        assert ctl.wake.is_set()


def test_a_wake_up_call_keeps_when_and_why_it_first_came_until_the_pass_takes_it() -> None:
    _, ctl = _registry_with_job()
    assert (ctl.wake.since, ctl.wake.why) == (None, "timer")
    ctl.wake.set("pod")
    first = ctl.wake.since
    assert first is not None
    ctl.wake.set("node")  # a second call before the pass: the first one's time and cause stay
    assert (ctl.wake.since, ctl.wake.why) == (first, "pod")
    ctl.wake.clear()  # the pass took it
    assert (ctl.wake.since, ctl.wake.why, ctl.wake.is_set()) == (None, "timer", False)


def _pod_event(pod: dict[str, Any], type: str | None = "MODIFIED") -> None:
    labels = pod["metadata"]["labels"]
    asyncio.run(handlers.pod_event(type=type, namespace="ns", labels=labels, body=pod, pods_by_job={}))  # type: ignore[arg-type]


def test_pod_events_wake_only_their_job() -> None:
    registry, ctl = _registry_with_job()
    handlers.REGISTRY, saved = registry, handlers.REGISTRY
    try:
        _pod_event(make_pod("other-0", job="other"), None)
        assert not ctl.wake.is_set()
        _pod_event(make_pod("job-0"), None)
        assert ctl.wake.is_set() and ctl.wake.why == "pod"
    finally:
        handlers.REGISTRY = saved


async def _node_event(node: dict[str, Any], type: str | None = "MODIFIED") -> None:
    await handlers.node_event(
        type=type, name=node["metadata"]["name"], body=node, node_readiness={}, node_labels={}, node_draining_state={}
    )  # type: ignore[arg-type]


async def _woken_after_node_delay(ctl: JobController) -> bool:
    """Whether the controller is woken once node events' delay has passed (and not before it)."""
    before = ctl.wake.is_set()
    await asyncio.sleep(handlers.NODE_WAKE_DELAY_SECONDS + 0.05)
    return not before and ctl.wake.is_set() and ctl.wake.why == "node"


def test_node_events_wake_the_jobs_only_when_readiness_labels_or_draining_change() -> None:
    registry, ctl = _registry_with_job()
    handlers.REGISTRY, saved = registry, handlers.REGISTRY

    async def scenario() -> None:
        node = make_node("gpu-1")
        await _node_event(node, None)  # the initial listing
        node["status"]["conditions"][0]["lastHeartbeatTime"] = "2026-01-01T00:00:10Z"  # a kubelet's heartbeat
        await _node_event(node)
        await asyncio.sleep(handlers.NODE_WAKE_DELAY_SECONDS + 0.05)
        assert not ctl.wake.is_set()
        for change in (
            make_node("gpu-1", "Unknown"),
            make_node("gpu-1", "Unknown") | {"metadata": {"name": "gpu-1", "labels": {"zone": "b"}}},
            make_node("gpu-1", "Unknown")
            | {"metadata": {"name": "gpu-1", "labels": {"zone": "b"}}}
            | {"spec": {"unschedulable": True}},
        ):
            await _node_event(change)
            assert await _woken_after_node_delay(ctl)
            ctl.wake.clear()
        await _node_event(make_node("gpu-1"), "DELETED")
        assert await _woken_after_node_delay(ctl)
        ctl.wake.clear()
        # A burst of node changes wakes one pass; a pass that began meanwhile (it reads the nodes as
        # they are then) voids the wake-up call still due.
        for i in range(5):
            await _node_event(make_node(f"gpu-{i + 2}"), "DELETED")
        assert await _woken_after_node_delay(ctl)
        ctl.wake.clear()
        await asyncio.sleep(handlers.NODE_WAKE_DELAY_SECONDS + 0.05)
        assert not ctl.wake.is_set()
        await _node_event(make_node("gpu-1"), "DELETED")
        ctl.wake.set("pod")
        ctl.wake.clear()  # the pass woken by the pod
        await asyncio.sleep(handlers.NODE_WAKE_DELAY_SECONDS + 0.05)
        assert not ctl.wake.is_set()

    try:
        asyncio.run(scenario())
    finally:
        handlers.REGISTRY = saved


def test_pod_events_that_change_no_fact_or_only_the_operators_labels_wake_nobody() -> None:
    registry, ctl = _registry_with_job()
    handlers.REGISTRY, saved = registry, handlers.REGISTRY
    try:
        pod = make_pod("job-0", role=wire.ROLE_SPARE)
        _pod_event(pod, None)  # the initial listing
        ctl.wake.clear()
        pod["metadata"]["labels"] |= {wire.LABEL_ROLE: wire.ROLE_WORKER, wire.LABEL_REPLICA: "0"}
        pod["metadata"]["annotations"] = {"seen": "by kopf"}
        _pod_event(pod)
        assert not ctl.wake.is_set()
        for change in (
            make_pod("job-0", phase="Failed"),
            make_pod("job-0", node="gpu-1"),
            make_pod("job-0", deleting=True),
            make_pod("job-0", uid="uid-job-0-again"),  # a new pod of the same name
        ):
            _pod_event(change)
            assert ctl.wake.is_set()
            ctl.wake.clear()
        _pod_event(make_pod("job-0", deleting=True), "DELETED")
        assert ctl.wake.is_set()
        # What the events said is kept per job, and dropped with the job's controller.
        pod = make_pod("job-1")
        _pod_event(pod)
        ctl.wake.clear()
        _pod_event(pod)
        assert not ctl.wake.is_set()
        registry.forget_pods(("ns", "job"))
        _pod_event(pod)
        assert ctl.wake.is_set()
    finally:
        handlers.REGISTRY = saved


def test_a_deleted_service_has_its_job_apply_its_children_now() -> None:
    registry, ctl = _registry_with_job()
    ctl.children.due = False
    handlers.REGISTRY, saved = registry, handlers.REGISTRY
    try:
        asyncio.run(handlers.service_event(type="MODIFIED", namespace="ns", labels={wire.LABEL_JOB: "job"}))
        asyncio.run(handlers.service_event(type="DELETED", namespace="ns", labels={wire.LABEL_JOB: "other"}))
        assert not ctl.children.due and not ctl.wake.is_set()
        asyncio.run(handlers.service_event(type="DELETED", namespace="ns", labels={wire.LABEL_JOB: "job"}))
        assert ctl.children.due and ctl.wake.is_set()
    finally:
        handlers.REGISTRY = saved


def test_diff_base_is_kopfs_without_copying_the_status() -> None:
    plan = plan_mesh(make_spec(replicas=4), JOB_UID, make_pod_refs(4), [], [], None).plan
    assert plan is not None
    raw = make_job(status={"phase": "Running", "epoch": 1, "plan": plan.to_wire()})
    raw["metadata"]["annotations"] = {"keep": "me", f"{wire.GROUP}/last-handled-configuration": "{}"}
    ours = handlers.DiffBaseStorage(prefix=wire.GROUP)
    theirs = kopf.AnnotationsDiffBaseStorage(prefix=wire.GROUP)
    body = kopf.Body(raw)
    essence = ours.build(body=body)
    assert essence == theirs.build(body=body) and "status" not in essence
    assert essence["metadata"]["annotations"] == {"keep": "me"} and essence["spec"] == raw["spec"]
    essence["spec"]["replicas"] = 99  # a copy: the object itself is untouched
    assert raw["spec"]["replicas"] == 4
    # A handler on a status field gets it in the diff base, as from kopf's own.
    fields = [("status", "phase")]
    assert ours.build(body=body, extra_fields=fields) == theirs.build(body=body, extra_fields=fields)
    assert ours.build(body=body, extra_fields=fields)["status"] == {"phase": "Running"}


def test_startup_configures_kopf_and_serves_reports_until_cleanup() -> None:
    saved = handlers.REGISTRY

    async def run() -> None:
        handlers.configure(OperatorSettings(leader_election=False, report_host="127.0.0.1", report_port=0))
        settings = kopf.OperatorSettings()
        await handlers.startup(settings=settings)
        try:
            assert settings.queueing.idle_timeout == handlers.OBJECT_WORKER_IDLE_SECONDS == 0.5
            assert settings.persistence.finalizer == f"{wire.GROUP}/kopf-finalizer"
            assert isinstance(settings.persistence.diffbase_storage, handlers.DiffBaseStorage)
            assert handlers.REGISTRY.runner is not None
        finally:
            await handlers.cleanup()

    try:
        asyncio.run(run())
    finally:
        handlers.REGISTRY = saved
