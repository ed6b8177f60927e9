"""A new job's pods are created a bounded number at a time, each manifest built as it is sent.

Scenario: a job of 200 pods, no pod yet; the API calls recorded, each create taking a moment. Every
pod is created once, under the names its reserved serials give; no more than ``CREATES_IN_FLIGHT``
creates are under way at once and the bound is reached (nothing waits needlessly); no more manifests
exist unsent than creates under way (all 200 were built up front before).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from operator_factories import make_job, make_spec

from megatron_contract import wire
from megatron_contract.job import MegatronJobStatus
from megatron_operator import builders, kube
from megatron_operator.builders import JobRef
from megatron_operator.child_keeper import CREATES_IN_FLIGHT
from megatron_operator.controller import JobController
from megatron_operator.failures import PodFacts
from megatron_operator.heartbeats import HeartbeatBook
from megatron_operator.reconcile import AgentSignals, assess
from megatron_operator.settings import OperatorSettings

PODS = 200
FIRST_SERIAL = 100


class Creates:
    """Stands in for the API calls a first pass makes; counts creates under way and bodies unsent."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = self.most_in_flight = 0
        self.unsent = self.most_unsent = 0
        build = builders.build_pod

        def counted_build(*args: Any, **kwargs: Any) -> dict[str, Any]:
            self.unsent += 1
            self.most_unsent = max(self.most_unsent, self.unsent)
            return build(*args, **kwargs)

        async def create_pod(body: dict[str, Any]) -> bool:
            self.unsent -= 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            await asyncio.sleep(0.002)
            self.in_flight -= 1
            self.names.append(body["metadata"]["name"])
            self.bodies.append(body)
            return True

        async def reserve_serials(*_: Any) -> int:
            return FIRST_SERIAL

        async def nothing(*_: Any, **__: Any) -> None:
            return None

        monkeypatch.setattr(builders, "build_pod", counted_build)
        monkeypatch.setattr(kube, "create_pod", create_pod)
        monkeypatch.setattr(kube, "reserve_serials", reserve_serials)
        for name in ("apply_service", "apply_secret", "apply_disruption_budget", "write_status", "write_conditions"):
            monkeypatch.setattr(kube, name, nothing)
        monkeypatch.setattr(kube, "post_event", lambda *_: None)


class NoPusher:
    def prepare(self, members: int) -> None:
        """Nothing to push before the pods run."""


def _controller(body: dict[str, Any]) -> JobController:
    ctl = JobController(
        JobRef.of(body),
        body,
        OperatorSettings(leader_election=False),
        HeartbeatBook(),
        NoPusher(),  # type: ignore[arg-type]
        pods_of=list,
        nodes=lambda: {"gpu-0": "True"},
    )
    ctl.token = "tok"
    return ctl


def test_a_large_job_creates_its_pods_a_bounded_number_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    creates = Creates(monkeypatch)
    body = make_job(replicas=PODS, spares=0)
    ctl = _controller(body)

    asyncio.run(ctl.reconcile_once())

    job = JobRef.of(body)
    assert sorted(creates.names) == sorted(builders.pod_name(job, FIRST_SERIAL + i) for i in range(PODS))
    assert creates.most_in_flight == CREATES_IN_FLIGHT < PODS
    assert creates.most_unsent <= CREATES_IN_FLIGHT
    assert set(ctl.children.expected) == set(creates.names)  # each awaited in the pod index


@pytest.mark.parametrize(
    "shape",
    [
        {"replicas": 8, "spares": 2},
        {"replicas": 8, "min_replicas": 2, "spares": 1, "tp": 2, "gpus_per_pod": 4},  # two replicas a pod
        {"replicas": 4, "spares": 2, "tp": 4, "pp": 2, "gpus_per_pod": 4},  # a replica over two pods
    ],
)
def test_a_new_jobs_workers_carry_the_replica_label_its_first_plan_gives_them(
    monkeypatch: pytest.MonkeyPatch, shape: dict[str, Any]
) -> None:
    creates = Creates(monkeypatch)
    body = make_job(**shape)
    asyncio.run(_controller(body).reconcile_once())

    pods = []
    for i, pod in enumerate(reversed(creates.bodies)):  # the plan orders them itself
        pod["metadata"]["uid"] = f"uid-{i}"
        pod["spec"]["nodeName"] = "gpu-0"
        running = {"name": "trainer", "ready": True, "restartCount": 0, "state": {"running": {}}}
        pod["status"] = {"phase": "Running", "podIP": f"10.0.0.{i + 1}", "containerStatuses": [running]}
        pods.append(PodFacts.of(pod))
    spec = make_spec(**shape)
    plan = assess(spec, body["metadata"]["uid"], MegatronJobStatus(), pods, {"gpu-0": "True"}, AgentSignals(), {})
    assert plan.decision is not None and plan.decision.plan is not None
    first = plan.decision.plan
    given = {m.pod: str(first.sizes.coords_of(m.ranks[0]).dp) for m in first.members}
    labels = {p["metadata"]["name"]: p["metadata"]["labels"] for p in creates.bodies}
    assert {n: lab[wire.LABEL_REPLICA] for n, lab in labels.items() if wire.LABEL_REPLICA in lab} == given
    assert all(lab[wire.LABEL_ROLE] == wire.ROLE_SPARE for n, lab in labels.items() if n not in given)
