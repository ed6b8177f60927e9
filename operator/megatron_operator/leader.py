"""Leader election on a coordination.k8s.io Lease: only the holder runs the controllers.

A replica waits in :meth:`LeaderElector.acquire` until it holds the Lease (it is free, or its holder
stopped renewing it), then renews it from a background thread. Expiry is measured as client-go
measures it: on this replica's monotonic clock, from the moment it last saw the Lease's record
change, never by comparing the holder's ``renewTime`` with the local clock (two clocks that need
not agree). A leader steps down (exits at once) when it has not renewed for ``renew_deadline``, a
margin short of the Lease duration: a standby cannot see the Lease expire before then, since it
saw the last renewal no earlier than it was written. Two acting replicas would both plan and both
create pods.

Why not ``kubernetes.leaderelection`` (the client's port of client-go): its ``LeaderElection.run``
cannot be stopped (its acquire and renew loops are ``while True`` with no exit but a failed
renewal), it never gives the Lease up on shutdown (a standby would wait a whole Lease duration after
every rolling update), it measures expiry on the wall clock (``time.time()``, which may jump), and
its ``Config`` calls ``sys.exit`` on values it dislikes (and wants whole seconds >= 1 between tries).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import threading
import time
from collections.abc import Callable

from kubernetes import client
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, retry_if_result, wait_fixed

from megatron_operator import kube

log = logging.getLogger(__name__)

#: What a replica compares between two reads of the Lease: any change is a sign of life.
Record = tuple[str | None, dt.datetime | None, dt.datetime | None, int | None, int | None]


def _record(spec: client.V1LeaseSpec) -> Record:
    return (
        spec.holder_identity,
        spec.acquire_time,
        spec.renew_time,
        spec.lease_duration_seconds,
        spec.lease_transitions,
    )


class ExpiryClock:
    """When the Lease's record last changed, on the local monotonic clock (client-go's observedTime)."""

    def __init__(self) -> None:
        self.record: Record | None = None
        self.seen_at = 0.0

    def observe(self, record: Record, now: float) -> None:
        if record != self.record:
            self.record, self.seen_at = record, now

    def expired(self, duration: float, now: float) -> bool:
        """Whether the record has not changed for ``duration`` seconds since this replica saw it."""
        return now - self.seen_at > duration


class LeaderElector:
    """Holds (or waits for) the Lease ``namespace/name`` as ``identity``."""

    def __init__(
        self,
        namespace: str,
        name: str,
        identity: str,
        lease_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_seconds = lease_seconds
        #: Tries come this often; each API call may take as long.
        self.retry_seconds = max(0.2, lease_seconds / 5)
        #: Past this without a renewal the leader steps down (a renewal's calls are cut short so as
        #: to end by then): a third of the duration is left as margin.
        self.renew_deadline = lease_seconds * 2 / 3
        self.holder: str | None = None  # the holder the last read saw
        self.renewed_at = 0.0  # when the last successful take or renewal started (our clock)
        self._clock = clock
        self._expiry = ExpiryClock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _spec(self, acquire_time: dt.datetime | None, transitions: int) -> client.V1LeaseSpec:
        now = dt.datetime.now(dt.UTC)  # for people and other tools: no replica compares it with its clock
        return client.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=max(1, round(self.lease_seconds)),
            acquire_time=acquire_time or now,
            renew_time=now,
            lease_transitions=transitions,
        )

    def try_acquire(self, timeout: float | None = None) -> bool:
        """One attempt to take or renew the Lease; each API call may take ``timeout`` seconds."""
        now = self._clock()
        timeout = timeout or self.retry_seconds
        lease = kube.read_lease(self.namespace, self.name, timeout)
        if lease is None:
            spec = self._spec(None, 0)
            body = client.V1Lease(metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace), spec=spec)
            taken = kube.create_lease(self.namespace, body, timeout)
        else:
            spec = lease.spec or client.V1LeaseSpec()
            self._expiry.observe(_record(spec), now)
            self.holder = spec.holder_identity
            mine = spec.holder_identity == self.identity
            duration = spec.lease_duration_seconds or self.lease_seconds
            if spec.holder_identity and not mine and not self._expiry.expired(duration, now):
                return False
            transitions = (spec.lease_transitions or 0) + (0 if mine else 1)
            spec = self._spec(spec.acquire_time if mine else None, transitions)
            lease.spec = spec
            taken = kube.replace_lease(self.namespace, self.name, lease, timeout)
        if taken:
            self.holder, self.renewed_at = self.identity, now
            self._expiry.observe(_record(spec), now)
        return taken

    async def acquire(self) -> None:
        """Wait until this replica holds the Lease, then keep renewing it in the background.

        Each attempt runs in a thread, so the event loop stays free (a standby answers its liveness
        probe); an API server that does not answer is tried again, not fatal."""

        announced = False

        def waiting(state: RetryCallState) -> None:
            nonlocal announced
            assert state.outcome is not None
            if state.outcome.failed:
                exc = state.outcome.exception()
                log.warning("could not read or take the lease %s/%s: %s", self.namespace, self.name, exc)
            elif not announced:
                log.info("waiting for leadership (lease %s/%s) as %s", self.namespace, self.name, self.identity)
                announced = True

        await AsyncRetrying(
            retry=retry_if_result(lambda taken: not taken) | retry_if_exception_type(Exception),
            wait=wait_fixed(self.retry_seconds),
            before_sleep=waiting,
        )(asyncio.to_thread, self.try_acquire)
        log.info("acquired leadership (lease %s/%s) as %s", self.namespace, self.name, self.identity)
        self._thread = threading.Thread(target=self._renew, name="leader-renew", daemon=True)
        self._thread.start()

    def must_step_down(self, now: float) -> bool:
        """Whether the leader must stop acting: another replica holds the Lease, or it has not
        renewed for ``renew_deadline`` (counted from when its last successful renewal started,
        before which no standby can have seen that renewal)."""
        lost = self.holder is not None and self.holder != self.identity
        return lost or now - self.renewed_at > self.renew_deadline

    def _renew(self) -> None:
        while True:
            left = self.renewed_at + self.renew_deadline - self._clock()
            if self._stop.wait(min(self.retry_seconds, max(0.0, left))):
                return
            left = self.renewed_at + self.renew_deadline - self._clock()
            if left > 0:
                try:
                    # Two calls (read, replace), each cut short to end by the deadline.
                    if self.try_acquire(timeout=min(self.retry_seconds, left / 2)):
                        continue
                except Exception:
                    log.exception("could not renew the lease %s/%s", self.namespace, self.name)
            if self._stop.is_set() or not self.must_step_down(self._clock()):
                continue
            if self.holder != self.identity:
                log.error("lost the lease %s/%s to %s; exiting", self.namespace, self.name, self.holder)
            else:
                log.error("lease not renewed for %.1f s; exiting", self._clock() - self.renewed_at)
            logging.shutdown()
            os._exit(3)

    def release(self) -> None:
        """Stop renewing and give the Lease up, so a standby takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.retry_seconds * 2)
        try:
            lease = kube.read_lease(self.namespace, self.name, self.retry_seconds)
            if lease is not None and lease.spec is not None and lease.spec.holder_identity == self.identity:
                lease.spec.holder_identity = None
                lease.spec.renew_time = None
                kube.replace_lease(self.namespace, self.name, lease, self.retry_seconds)
        except Exception:
            log.exception("could not release the lease")
