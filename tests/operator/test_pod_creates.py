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
from operator_factories import make_job

from megatron_operator import builders, kube
from megatron_operator.builders import JobRef
from megatron_operator.child_keeper import CREATES_IN_FLIGHT
from megatron_operator.controller import JobController
from megatron_operator.heartbeats import HeartbeatBook
from megatron_operator.settings import OperatorSettings

PODS = 200
FIRST_SERIAL = 100


class Creates:
    """Stands in for the API calls a first pass makes; counts creates under way and bodies unsent."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
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


def test_a_large_job_creates_its_pods_a_bounded_number_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    creates = Creates(monkeypatch)
    body = make_job(replicas=PODS, spares=0)
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

    asyncio.run(ctl.reconcile_once())

    job = JobRef.of(body)
    assert sorted(creates.names) == sorted(builders.pod_name(job, FIRST_SERIAL + i) for i in range(PODS))
    assert creates.most_in_flight == CREATES_IN_FLIGHT < PODS
    assert creates.most_unsent <= CREATES_IN_FLIGHT
    assert set(ctl.children.expected) == set(creates.names)  # each awaited in the pod index
