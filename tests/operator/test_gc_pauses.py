"""Long garbage collections are logged (``megatron_operator.gc_pauses``): a real full collection of
a heap with cyclic garbage, at a threshold it exceeds; none at a threshold it cannot reach.
A job's pass that stored and pushed a new plan collects the young generation before it ends (the
API server and the agents faked); a pass with nothing new to plan does not."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import pytest
from operator_factories import JOB_UID, make_pod_refs
from test_version_skew import FakeKube, FakePusher, _controller

from megatron_contract.agent import AgentReport
from megatron_operator import gc_pauses
from megatron_operator.heartbeats import HeartbeatBook


def _collect_cycles(count: int) -> None:
    for _ in range(count):
        a: list[object] = []
        a.append(a)
    gc.collect()


def test_a_collection_over_the_threshold_is_logged_and_one_under_it_is_not(caplog: pytest.LogCaptureFixture) -> None:
    saved = list(gc.callbacks)
    try:
        gc.callbacks[:] = [cb for cb in gc.callbacks if not isinstance(cb, gc_pauses._Timer)]
        gc_pauses.log_long_collections(threshold=3600.0)
        gc_pauses.log_long_collections(threshold=0.0)  # one timer only: the first stays
        assert sum(isinstance(cb, gc_pauses._Timer) for cb in gc.callbacks) == 1
        with caplog.at_level("WARNING", logger=gc_pauses.__name__):
            _collect_cycles(1000)
        assert not caplog.records
        gc.callbacks[:] = [cb for cb in gc.callbacks if not isinstance(cb, gc_pauses._Timer)]
        gc_pauses.log_long_collections(threshold=0.0)
        with caplog.at_level("WARNING", logger=gc_pauses.__name__):
            _collect_cycles(1000)
        messages = [r.getMessage() for r in caplog.records]
        assert any("garbage collection of generation 2 stopped the operator" in m for m in messages), messages
        assert any("objects freed" in m and "(0 objects" not in m for m in messages), messages
    finally:
        gc.callbacks[:] = saved


def test_a_pass_that_pushed_a_new_plan_collects_the_young_generation_and_no_other_pass_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    FakeKube(monkeypatch)
    book = HeartbeatBook()
    for r in make_pod_refs(2):  # warm agents: the first plan takes them
        report = {"jobUid": JOB_UID, "pod": r.name, "epoch": 0, "state": "spare"}
        book.record(AgentReport.model_validate(report), time.monotonic())
    ctl = _controller(None, book)
    pusher: FakePusher = ctl.pusher  # type: ignore[assignment]
    ctl.settling = False
    young: list[int] = []

    def seen(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info["generation"] == 0:
            young.append(len(pusher.pushed))

    enabled = gc.isenabled()
    gc.disable()  # only a collection asked for is seen
    gc.callbacks.append(seen)
    try:
        asyncio.run(ctl.reconcile_once())  # the first plan: stored, pushed
        assert [epoch for epoch, _ in pusher.pushed] == [1] and young == [1], (pusher.pushed, young)
        asyncio.run(ctl.reconcile_once())  # nothing new to plan
        assert [epoch for epoch, _ in pusher.pushed] == [1] and young == [1], (pusher.pushed, young)
    finally:
        gc.callbacks.remove(seen)
        if enabled:
            gc.enable()
