"""The ``HostMemoryShort`` condition (megatron_operator.host_memory) and the controller writing it.

Scenarios: a distributed-optimizer job whose trainer container requests less memory than its pods'
buddy copies need gets ``HostMemoryShort=True`` naming both byte counts, and one Warning event
however many passes run; raising the request turns it ``False``/``HostMemorySufficient``; without a
memory request it is ``False``/``MemoryNotRequested`` naming the need (no warning); a job without
copies never gets the condition, and one that had it and lost its copies gets ``NoBuddyCopies``;
the request compared is the one the pods the operator builds carry (``spec.resources``, a
template's trainer container, a limit alone).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from operator_factories import make_spec
from test_version_skew import FakeKube, _controller, _running_status

from megatron_contract.host_memory import pod_copy_bytes, quantity_bytes, trainer_memory_request
from megatron_contract.job import Condition, ConditionType, MegatronJobSpec
from megatron_operator import optimizer_sources
from megatron_operator.builders import JobRef, build_pod
from megatron_operator.host_memory import host_memory_condition
from megatron_operator.status import Reason


def _distributed(wire: dict[str, Any]) -> dict[str, Any]:
    wire["training"]["optimizer"] = {"distributed": True}
    wire["checkpoint"] = {"path": "/ckpt"}
    return wire


def _spec(memory: str | None = None) -> MegatronJobSpec:
    resources = {"resources": {"requests": {"memory": memory}}} if memory is not None else {}
    return MegatronJobSpec.model_validate(_distributed(make_spec(replicas=2, spares=0, **resources).to_wire()))


def test_a_request_below_the_need_is_short_naming_both_byte_counts() -> None:
    spec = _spec("500Ki")
    need = pod_copy_bytes(spec, 2)
    assert need > 500 * 1024  # the tiny GPT's copies: 4 x 12 bytes per shard element, about 750 KiB
    status, reason, message = host_memory_condition(spec, None, True) or (None, None, "")
    assert (status, reason) == (True, Reason.HOST_MEMORY_SHORT)
    assert f"{need} bytes" in message and f"{500 * 1024} bytes" in message and "2 data-parallel replicas" in message


def test_a_request_holding_the_copies_is_sufficient_and_none_is_said_but_not_warned() -> None:
    assert host_memory_condition(_spec("1Gi"), None, True)[:2] == (False, Reason.HOST_MEMORY_SUFFICIENT)  # type: ignore[index]
    status, reason, message = host_memory_condition(_spec(), None, True) or (None, None, "")
    assert (status, reason) == (False, Reason.MEMORY_NOT_REQUESTED) and "requests no memory" in message


def test_without_copies_the_condition_stays_absent_or_turns_false() -> None:
    plain = make_spec(replicas=2, spares=0)  # not the distributed optimizer
    assert host_memory_condition(plain, None, True) is None
    was = Condition(
        type="HostMemoryShort", status="True", reason="HostMemoryShort", last_transition_time="2026-01-01T00:00:00Z"
    )
    assert host_memory_condition(plain, was, True)[:2] == (False, Reason.NO_BUDDY_COPIES)  # type: ignore[index]


@pytest.mark.parametrize(
    "fields",
    [
        {"resources": {"requests": {"memory": "3Gi"}}},
        {"resources": {"limits": {"memory": "1.5G"}}},
        {"template": {"spec": {"containers": [{"name": "trainer", "resources": {"requests": {"memory": "2Gi"}}}]}}},
    ],
)
def test_the_request_compared_is_the_one_the_built_pods_carry(fields: dict[str, Any]) -> None:
    spec = make_spec(replicas=2, spares=0, **fields)
    pod = build_pod(JobRef("job", "ns", "uid"), spec, serial=0, role="worker", operator_url="http://op")
    resources = pod["spec"]["containers"][0]["resources"]
    carried = resources["requests"].get("memory", resources["limits"].get("memory"))
    assert trainer_memory_request(spec) == quantity_bytes(carried)


def _short(ctl: Any) -> Condition | None:
    return next((c for c in ctl.status.conditions if c.type == ConditionType.HOST_MEMORY_SHORT), None)


def test_the_controller_writes_the_condition_and_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeKube(monkeypatch)
    ctl = _controller(_running_status(), resources={"requests": {"memory": "500Ki"}})
    _distributed(ctl.body["spec"])
    ctl.settling = False

    async def scenario() -> None:
        await ctl.reconcile_once()
        await ctl.reconcile_once()
        short = _short(ctl)
        assert short is not None and (short.status, short.reason) == ("True", Reason.HOST_MEMORY_SHORT)
        assert fake.reasons().count(Reason.HOST_MEMORY_SHORT) == 1
        ctl.body["spec"]["resources"] = {"requests": {"memory": "1Gi"}}
        await ctl.reconcile_once()
        short = _short(ctl)
        assert short is not None and (short.status, short.reason) == ("False", Reason.HOST_MEMORY_SUFFICIENT)
        assert fake.reasons().count(Reason.HOST_MEMORY_SHORT) == 1

    asyncio.run(scenario())


def test_a_job_without_copies_gets_no_condition(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeKube(monkeypatch)
    ctl = _controller(_running_status())
    ctl.settling = False
    asyncio.run(ctl.reconcile_once())
    assert _short(ctl) is None


def test_no_condition_while_the_operator_asks_for_no_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """With in-memory restore switched off (optimizer_sources.IN_MEMORY_RESTORE), no copies are kept."""
    monkeypatch.setattr(optimizer_sources, "IN_MEMORY_RESTORE", False)
    assert host_memory_condition(_spec("500Ki"), None, False) is None
    FakeKube(monkeypatch)
    ctl = _controller(_running_status(), resources={"requests": {"memory": "500Ki"}})
    _distributed(ctl.body["spec"])
    ctl.settling = False
    asyncio.run(ctl.reconcile_once())
    assert _short(ctl) is None
