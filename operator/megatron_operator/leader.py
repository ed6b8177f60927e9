"""Leader election on a coordination.k8s.io Lease: only the holder runs the controllers.

A replica blocks in :func:`acquire` until it holds the Lease (it is free, or its holder stopped
renewing it for ``lease_seconds``), then renews it from a background thread. A leader that cannot
renew before its Lease expires exits at once: another replica may already be acting, and two
acting replicas would both plan and both create pods.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time

from kubernetes import client

from megatron_operator import kube

log = logging.getLogger(__name__)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class LeaderElector:
    """Holds (or waits for) the Lease ``namespace/name`` as ``identity``."""

    def __init__(self, namespace: str, name: str, identity: str, lease_seconds: float) -> None:
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_seconds = lease_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _spec(self, acquire_time: dt.datetime | None, transitions: int) -> client.V1LeaseSpec:
        now = _now()
        return client.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=max(1, round(self.lease_seconds)),
            acquire_time=acquire_time or now,
            renew_time=now,
            lease_transitions=transitions,
        )

    def try_acquire(self) -> bool:
        """One attempt to take or renew the Lease."""
        lease = kube.read_lease(self.namespace, self.name)
        if lease is None:
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=self._spec(None, 0),
            )
            return kube.create_lease(self.namespace, body)
        spec = lease.spec or client.V1LeaseSpec()
        mine = spec.holder_identity == self.identity
        renewed = spec.renew_time or spec.acquire_time
        duration = spec.lease_duration_seconds or self.lease_seconds
        expired = renewed is None or (_now() - renewed).total_seconds() > duration
        if not mine and not expired and spec.holder_identity:
            return False
        transitions = (spec.lease_transitions or 0) + (0 if mine else 1)
        lease.spec = self._spec(spec.acquire_time if mine else None, transitions)
        return kube.replace_lease(self.namespace, self.name, lease)

    def acquire(self) -> None:
        """Block until this replica holds the Lease, then keep renewing it in the background."""
        announced = False
        while not self.try_acquire():
            if not announced:
                log.info("waiting for leadership (lease %s/%s) as %s", self.namespace, self.name, self.identity)
                announced = True
            time.sleep(max(0.2, self.lease_seconds / 5))
        log.info("acquired leadership (lease %s/%s) as %s", self.namespace, self.name, self.identity)
        self._thread = threading.Thread(target=self._renew, name="leader-renew", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.lease_seconds / 3):
            try:
                if self.try_acquire():
                    last_ok = time.monotonic()
                    continue
                log.error("lost the lease %s/%s to another replica; exiting", self.namespace, self.name)
            except Exception:
                log.exception("could not renew the lease")
                if time.monotonic() - last_ok < self.lease_seconds * 0.8:
                    continue
                log.error("lease not renewed for %.1f s; exiting", time.monotonic() - last_ok)
            logging.shutdown()
            os._exit(3)

    def release(self) -> None:
        """Stop renewing and give the Lease up, so a standby takes over at once."""
        self._stop.set()
        try:
            lease = kube.read_lease(self.namespace, self.name)
            if lease is not None and lease.spec is not None and lease.spec.holder_identity == self.identity:
                lease.spec.holder_identity = None
                lease.spec.renew_time = None
                kube.replace_lease(self.namespace, self.name, lease)
        except Exception:
            log.exception("could not release the lease")
