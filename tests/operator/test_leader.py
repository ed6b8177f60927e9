"""Leader election's expiry logic, with the Lease API faked (a dict) and the clock in the test's hands.

Scenarios: a standby takes a Lease only after its record stayed unchanged for the Lease duration
on the standby's own clock, whatever the holder's ``renewTime`` says (written by a clock far behind,
or far ahead, of the standby's); a holder that keeps renewing is never taken over; a free or
released Lease is taken at once and counts a transition; a leader steps down when it has not renewed
for its renew deadline (a margin short of the duration) or when another replica holds the Lease;
``acquire`` waits through API errors and a live holder, and ``release`` gives the Lease back; a
leader whose API server stops answering exits before its Lease could expire.
The real API server and processes: tests/integration/test_operator_faults.py (failover).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from typing import Any

import pytest
from kubernetes import client

from megatron_operator import kube
from megatron_operator import leader as leader_module
from megatron_operator.leader import ExpiryClock, LeaderElector

NS, NAME = "ops", "megatron-operator"


class FakeLeases:
    """One Lease in memory, with the resourceVersion check of a replace."""

    def __init__(self) -> None:
        self.lease: client.V1Lease | None = None
        self.version = 0

    def read(self, namespace: str, name: str, timeout: float | None = None) -> client.V1Lease | None:
        if self.lease is None:
            return None
        return client.V1Lease(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace, resource_version=str(self.version)),
            spec=client.V1LeaseSpec(**self.lease.spec.to_dict()),
        )

    def create(self, namespace: str, body: client.V1Lease, timeout: float | None = None) -> bool:
        if self.lease is not None:
            return False
        self.lease, self.version = body, 1
        return True

    def replace(self, namespace: str, name: str, body: client.V1Lease, timeout: float | None = None) -> bool:
        if body.metadata.resource_version != str(self.version):
            return False
        self.lease, self.version = body, self.version + 1
        return True

    def hold(self, holder: str | None, renew_time: dt.datetime | None, transitions: int = 0) -> None:
        """Another replica writes the Lease."""
        spec = client.V1LeaseSpec(
            holder_identity=holder,
            lease_duration_seconds=10,
            acquire_time=renew_time,
            renew_time=renew_time,
            lease_transitions=transitions,
        )
        self.lease, self.version = client.V1Lease(spec=spec), self.version + 1

    @property
    def holder(self) -> str | None:
        return self.lease.spec.holder_identity if self.lease is not None else None


@pytest.fixture
def leases(monkeypatch: pytest.MonkeyPatch) -> FakeLeases:
    fake = FakeLeases()
    monkeypatch.setattr(kube, "read_lease", fake.read)
    monkeypatch.setattr(kube, "create_lease", fake.create)
    monkeypatch.setattr(kube, "replace_lease", fake.replace)
    return fake


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _elector(identity: str, clock: Clock) -> LeaderElector:
    return LeaderElector(NS, NAME, identity, lease_seconds=10, clock=clock)


UTC_NOW = dt.datetime.now(dt.UTC)


@pytest.mark.parametrize(
    "renew_time",
    [UTC_NOW - dt.timedelta(hours=1), UTC_NOW + dt.timedelta(hours=1), UTC_NOW],
    ids=["holder-clock-behind", "holder-clock-ahead", "clocks-agree"],
)
def test_a_standby_waits_one_duration_from_its_own_observation(leases: FakeLeases, renew_time: dt.datetime) -> None:
    clock = Clock()
    leases.hold("dead-leader", renew_time)
    standby = _elector("standby", clock)
    assert not standby.try_acquire()  # first sight: the Lease counts from now, whatever renewTime says
    clock.now += 9.9
    assert not standby.try_acquire()
    assert leases.holder == "dead-leader"
    clock.now += 0.2  # 10.1 s without a change
    assert standby.try_acquire()
    assert leases.holder == "standby" and leases.lease is not None
    assert leases.lease.spec.lease_transitions == 1


def test_a_renewing_holder_is_never_taken_over(leases: FakeLeases) -> None:
    clock = Clock()
    standby = _elector("standby", clock)
    for i in range(10):
        # The holder's clock is an hour behind, but it renews: every read shows a new record.
        leases.hold("leader", UTC_NOW - dt.timedelta(hours=1) + dt.timedelta(seconds=i))
        assert not standby.try_acquire()
        clock.now += 6.0
    assert leases.holder == "leader"


def test_a_free_or_released_lease_is_taken_at_once(leases: FakeLeases) -> None:
    clock = Clock()
    first = _elector("first", clock)
    assert first.try_acquire() and leases.holder == "first"  # created
    first.release()
    assert leases.holder is None
    second = _elector("second", clock)
    assert second.try_acquire() and leases.holder == "second"


def test_the_leader_renews_and_steps_down_before_a_standby_may_take_over(leases: FakeLeases) -> None:
    clock = Clock()
    leader = _elector("leader", clock)
    assert leader.try_acquire()
    clock.now += 2
    assert leader.try_acquire()  # a renewal keeps acquireTime and counts no transition
    assert leases.lease is not None and leases.lease.spec.lease_transitions == 0
    assert leader.renewed_at == clock.now
    assert not leader.must_step_down(clock.now + leader.renew_deadline - 0.1)
    assert leader.must_step_down(clock.now + leader.renew_deadline + 0.1)
    assert leader.renew_deadline < leader.lease_seconds * 0.7  # the margin
    # Another replica took the Lease (say, this one was paused): step down at once.
    leases.hold("other", UTC_NOW, transitions=1)
    assert not leader.try_acquire()
    assert leader.must_step_down(clock.now)


def test_expiry_clock_restarts_on_every_change() -> None:
    expiry = ExpiryClock()
    record: Any = ("a", None, UTC_NOW, 10, 0)
    expiry.observe(record, 0.0)
    expiry.observe(record, 8.0)
    assert not expiry.expired(10, 9.0) and expiry.expired(10, 10.5)
    expiry.observe(("a", None, UTC_NOW + dt.timedelta(seconds=1), 10, 0), 10.5)
    assert not expiry.expired(10, 20.0) and expiry.expired(10, 20.6)


def test_acquire_waits_through_api_errors_and_a_live_holder(
    leases: FakeLeases, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The real wait, on the real monotonic clock: an API server down at first, then a holder that
    stopped renewing; the Lease is taken one duration after it was first seen, then given back."""
    read = leases.read
    failures = iter([ConnectionError("API server down")])

    def flaky_read(namespace: str, name: str, timeout: float | None = None) -> client.V1Lease | None:
        for exc in failures:
            raise exc
        return read(namespace, name, timeout)

    monkeypatch.setattr(kube, "read_lease", flaky_read)
    leases.hold("dead-leader", UTC_NOW)
    leases.lease.spec.lease_duration_seconds = 1  # type: ignore[union-attr]
    standby = LeaderElector(NS, NAME, "standby", lease_seconds=1.0)
    caplog.set_level("INFO", logger="megatron_operator.leader")
    started = time.monotonic()
    asyncio.run(standby.acquire())
    try:
        assert leases.holder == "standby"
        assert 1.0 < time.monotonic() - started < 10
        messages = [r.getMessage() for r in caplog.records]
        assert sum("API server down" in m for m in messages) == 1
        assert sum("waiting for leadership" in m for m in messages) == 1
    finally:
        standby.release()
    assert leases.holder is None


def test_a_leader_that_cannot_renew_exits_before_the_lease_expires(
    leases: FakeLeases, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The renew thread, on the real clock, against an API server that stopped answering."""
    leader = LeaderElector(NS, NAME, "leader", lease_seconds=3.0)
    assert leader.try_acquire()

    def down(*_: Any, **__: Any) -> None:
        raise ConnectionError("API server down")

    exited = threading.Event()

    def fake_exit(code: int) -> None:
        exited.set()
        leader._stop.set()  # ends the renew thread, as os._exit would end the process

    monkeypatch.setattr(kube, "read_lease", down)
    monkeypatch.setattr(leader_module.os, "_exit", fake_exit)
    monkeypatch.setattr(leader_module.logging, "shutdown", lambda: None)
    thread = threading.Thread(target=leader._renew, daemon=True)
    thread.start()
    assert exited.wait(10)
    gone_after = time.monotonic() - leader.renewed_at
    thread.join(5)
    assert leader.renew_deadline <= gone_after < leader.lease_seconds, gone_after
