"""A job controller under version skew, with the API server and the agents faked (fast unit tests).

Scenarios:
- a status this version cannot read (a plan reason a newer operator added): the controller plans,
  pushes, deletes and creates nothing, however long it runs; it says so once (Warning event
  ``StatusUnreadable``) and adds ``ReconcilePaused=True`` to the conditions as stored, leaving the
  rest of the status alone; once the status can be read again it resumes from the epoch stored
  (``ReconcilePaused=False``, ``ReconcileResumed``), never from epoch 1;
- agents holding a newer epoch than the status (reported in heartbeats, or in the answer to a
  push): no acknowledgement, nothing pushed again, no pod touched, ``StatusBehindAgents``; the hold
  ends when those pods are gone;
- an unknown spec field: the job keeps running, one ``SpecFieldsIgnored`` event names the field;
- the status computed from an old one keeps the fields another version wrote;
- the ``ReconcilePaused`` condition is written into the stored conditions without touching others.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import pytest
from operator_factories import JOB_UID, make_job, make_pod, make_pod_refs, make_spec

from megatron_contract.agent import AgentReport
from megatron_contract.job import JobPhase, MegatronJobStatus
from megatron_contract.mesh import MeshPlan
from megatron_operator import kube, skew
from megatron_operator.builders import JobRef
from megatron_operator.controller import JobController
from megatron_operator.failures import PodFacts
from megatron_operator.heartbeats import HeartbeatBook
from megatron_operator.planner import plan_mesh
from megatron_operator.push import PushOutcome, PushResult
from megatron_operator.settings import OperatorSettings
from megatron_operator.status import Observation, Reason, compute_status

NOW = datetime(2026, 1, 1, tzinfo=UTC)
POD_CHANGES = ("create_pod", "delete_pod", "patch_pod_labels", "reserve_serials")


class FakeKube:
    """Records every API call the controller makes (and the events it posts)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.events: list[tuple[str, str, str]] = []
        for name in (*POD_CHANGES, "apply_service", "apply_secret", "apply_disruption_budget"):
            monkeypatch.setattr(kube, name, self._recorder(name))
        monkeypatch.setattr(kube, "write_status", self._recorder("write_status"))
        monkeypatch.setattr(kube, "write_conditions", self._recorder("write_conditions"))
        monkeypatch.setattr(kube, "post_event", lambda _body, t, r, m: self.events.append((t, r, m)))

    def _recorder(self, name: str) -> Any:
        async def call(*args: Any, **_: Any) -> Any:
            self.calls.append((name, args))
            return 100 if name == "reserve_serials" else True

        return call

    def named(self, *names: str) -> list[tuple[Any, ...]]:
        return [args for name, args in self.calls if name in names]

    def reasons(self) -> list[str]:
        return [reason for _, reason, _ in self.events]


class FakePusher:
    """Answers pushes as configured per pod (accepted unless told otherwise)."""

    def __init__(self) -> None:
        self.pushed: list[tuple[int, set[str]]] = []
        self.answers: dict[str, tuple[PushResult, int | None]] = {}

    def prepare(self, members: int) -> None:
        """No push processes here."""

    async def push(self, plan: MeshPlan, token: str, pods: set[str] | None = None) -> list[PushOutcome]:
        targets = {m.pod for m in plan.members if pods is None or m.pod in pods}
        self.pushed.append((plan.epoch, targets))
        out = []
        for pod in sorted(targets):
            result, held = self.answers.get(pod, (PushResult.ACCEPTED, None))
            out.append(PushOutcome(pod, result, f"{result.value}", 0.0, held))
        return out


class Stop:
    """A kopf ``stopped`` flag."""

    def __init__(self) -> None:
        self.set = False

    def __bool__(self) -> bool:
        return self.set


def _plan(epoch: int = 2) -> MeshPlan:
    plan = plan_mesh(make_spec(replicas=2, spares=0), JOB_UID, make_pod_refs(2), [], [], None).plan
    assert plan is not None
    return plan.model_copy(update={"epoch": epoch})


def _pods() -> list[PodFacts]:
    return [PodFacts.of(make_pod(r.name, ip=r.address, uid=r.uid, index=i)) for i, r in enumerate(make_pod_refs(2))]


def _controller(status: dict[str, Any] | None, book: HeartbeatBook | None = None, **spec: Any) -> JobController:
    body = make_job(status=status, replicas=2, spares=0, **spec)
    ctl = JobController(
        JobRef.of(body),
        body,
        OperatorSettings(leader_election=False, resync_seconds=0.02),
        book or HeartbeatBook(),
        FakePusher(),  # type: ignore[arg-type]
        pods_of=_pods,
        nodes=lambda: {"gpu-0": "True"},
    )
    ctl.token = "tok"
    return ctl


def _running_status(epoch: int = 2) -> dict[str, Any]:
    return {"phase": "Running", "epoch": epoch, "committedEpoch": epoch, "plan": _plan(epoch).to_wire()}


async def _run_for(ctl: JobController, seconds: float) -> None:
    stop = Stop()
    task = asyncio.create_task(ctl.run(stop))
    await asyncio.sleep(seconds)
    stop.set = True
    ctl.wake.set()
    await asyncio.wait_for(task, 5)


def _report(pod: str, epoch: int) -> AgentReport:
    return AgentReport.model_validate({"jobUid": JOB_UID, "pod": pod, "epoch": epoch, "state": "training", "step": 5})


def test_an_unreadable_status_is_refused_loudly_and_nothing_is_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeKube(monkeypatch)
    stored = _running_status()
    stored["plan"]["reason"] = "rebalance"  # a reason a newer operator plans for
    stored["conditions"] = [
        {"type": "Ready", "status": "True", "reason": "Training", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    ]
    ctl = _controller(stored)
    asyncio.run(_run_unreadable_then_fixed(ctl, fake, stored))


async def _run_unreadable_then_fixed(ctl: JobController, fake: FakeKube, stored: dict[str, Any]) -> None:
    await _run_for(ctl, 0.3)

    assert not fake.named(*POD_CHANGES, "write_status", "apply_secret", "apply_service")
    assert ctl.pusher.pushed == []  # type: ignore[attr-defined]
    assert fake.reasons() == [Reason.STATUS_UNREADABLE]  # once, over many passes
    assert "status.plan.reason" in fake.events[0][2]
    ((_, _, conditions),) = fake.named("write_conditions")[:1]
    assert conditions[0] == stored["conditions"][0]
    assert conditions[1]["type"] == "ReconcilePaused" and conditions[1]["status"] == "True"
    assert conditions[1]["reason"] == Reason.STATUS_UNREADABLE

    # The newer operator rewrote the status, or a person fixed it: this version resumes from it.
    fake.calls.clear()
    ctl.body["status"] = {**stored, "plan": {**stored["plan"], "reason": "replace"}, "conditions": conditions}
    await _run_for(ctl, 0.3)
    assert Reason.RECONCILE_RESUMED in fake.reasons()
    written = [MegatronJobStatus.model_validate(s) for _, _, s in fake.named("write_status")]
    assert written and all(s.epoch == 2 for s in written), [s.epoch for s in written]
    paused = next(c for c in written[0].conditions if c.type == "ReconcilePaused")
    assert (paused.status, paused.reason) == ("False", Reason.RECONCILE_RESUMED)
    assert all(epoch == 2 for epoch, _ in ctl.pusher.pushed)  # type: ignore[attr-defined]


def test_agents_ahead_of_the_status_are_not_fought(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeKube(monkeypatch)
    book = HeartbeatBook()
    ctl = _controller(_running_status(epoch=1), book)
    asyncio.run(_ahead_in_heartbeats(ctl, fake, book))


async def _ahead_in_heartbeats(ctl: JobController, fake: FakeKube, book: HeartbeatBook) -> None:
    # A report of a newer epoch is no acknowledgement of the plan in force.
    book.record(_report("p0", 3), time.monotonic())
    ctl.delivery.acked_epoch = 1
    ctl.accept_reports([_report("p0", 3)])
    assert "p0" not in ctl.delivery.acked and ctl.wake.is_set()
    ctl.settling = False
    await ctl.reconcile_once()  # a pass already under way when the report came: it stops before planning
    assert ctl.hold is not None and not fake.named(*POD_CHANGES, "write_status")
    await _run_for(ctl, 0.3)
    assert not fake.named(*POD_CHANGES, "write_status")
    assert ctl.pusher.pushed == []  # type: ignore[attr-defined]
    assert fake.reasons() == [Reason.STATUS_BEHIND_AGENTS]
    assert "p0 (epoch 3)" in fake.events[0][2]
    (conditions,) = [args[2] for args in fake.named("write_conditions")][:1]
    assert conditions[-1]["reason"] == Reason.STATUS_BEHIND_AGENTS

    # Those pods deleted (their replacements hold no epoch): the operator acts again.
    ctl.pods_of = list
    ctl.body["status"]["conditions"] = conditions
    assert await ctl._held() is False and ctl.hold is None


def test_a_push_refused_by_an_agent_holding_a_newer_epoch_stops_the_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeKube(monkeypatch)
    ctl = _controller(_running_status(epoch=2))
    pusher: FakePusher = ctl.pusher  # type: ignore[assignment]
    pusher.answers["p1"] = (PushResult.AHEAD, 5)
    ctl.settling = False

    async def scenario() -> None:
        await ctl.reconcile_once()
        assert pusher.pushed == [(2, {"p0", "p1"})]
        assert ctl.delivery.acked == {"p0"} and ctl.delivery.ahead == {"p1": 5}
        assert not fake.named(*POD_CHANGES)
        assert await ctl._held()
        assert ctl.hold is not None and ctl.hold.reason == Reason.STATUS_BEHIND_AGENTS
        await ctl.delivery.push(ctl.plan, ctl.token, ctl.pusher)  # type: ignore[arg-type]
        assert len(pusher.pushed) == 1  # never pushed to it again

    asyncio.run(scenario())


def test_an_unknown_spec_field_is_announced_once_and_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeKube(monkeypatch)
    ctl = _controller(_running_status())
    ctl.body["spec"]["futureKnob"] = 3
    ctl.settling = False

    async def twice() -> None:
        await ctl.reconcile_once()
        await ctl.reconcile_once()

    asyncio.run(twice())
    assert fake.reasons().count(Reason.SPEC_FIELDS_IGNORED) == 1
    assert Reason.INVALID_SPEC not in fake.reasons() and not ctl.done
    assert "spec.futureKnob" in next(m for _, r, m in fake.events if r == Reason.SPEC_FIELDS_IGNORED)
    assert ctl.status.phase is not JobPhase.FAILED and ctl.status.epoch == 2


def test_the_new_status_keeps_fields_another_version_wrote() -> None:
    old = MegatronJobStatus.model_validate({**_running_status(), "migration": {"state": "idle"}})
    obs = Observation(
        phase=JobPhase.RUNNING,
        reason=Reason.TRAINING,
        message="",
        plan=old.plan,
        replicas=2,
        ready_workers=2,
        spares_ready=0,
        spares_wanted=0,
        recoveries=0,
    )
    assert compute_status(old, obs, NOW).to_wire()["migration"] == {"state": "idle"}


def test_the_paused_condition_goes_into_the_conditions_as_stored() -> None:
    hold = skew.Hold(Reason.STATUS_UNREADABLE, "cannot read")
    other = {"type": "Ready", "status": "True", "reason": "Training", "lastTransitionTime": "x", "future": 1}
    first = skew.paused_conditions({"conditions": [other]}, hold, NOW, 3)
    assert first is not None and first[0] == other and first[1]["observedGeneration"] == 3
    assert skew.paused_conditions({"conditions": first}, hold, NOW, 3) is None  # already says so
    later = datetime(2026, 2, 1, tzinfo=UTC)
    again = skew.paused_conditions({"conditions": first}, skew.Hold(Reason.STATUS_BEHIND_AGENTS, "behind"), later, 3)
    assert again is not None and len(again) == 2 and again[1]["reason"] == Reason.STATUS_BEHIND_AGENTS
    assert again[1]["lastTransitionTime"] == first[1]["lastTransitionTime"]  # still True: no transition
    assert skew.paused_conditions({"conditions": "garbled"}, hold, NOW, 3) is None
    (alone,) = skew.paused_conditions({}, hold, NOW, None) or []
    assert (alone["type"], alone["status"], "observedGeneration" in alone) == ("ReconcilePaused", "True", False)
