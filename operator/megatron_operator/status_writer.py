"""Writing a job's status without loading the API server: goodput figures and progress throttled.

:mod:`status` computes what the status says; this module decides whether to write it. Goodput
changes on every pass, and progress (step, goodput) changes with every step: at thousands of pods
the plan makes the status a few hundred kB, so a write per heartbeat would load the API server.
Fresh goodput rides along with every other change and goes on its own at most every
:data:`GOODPUT_WRITE_SECONDS`; a change of progress alone waits out
:func:`status.progress_write_gap`. A forced write (a plan being committed) always goes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from megatron_contract.job import JobPhase, MegatronJobStatus
from megatron_operator import kube, metrics
from megatron_operator.builders import JobRef
from megatron_operator.goodput import GoodputLedger
from megatron_operator.heartbeats import HeartbeatBook
from megatron_operator.status import Observation, compute_status, progress_only, progress_write_gap, status_body

#: Fresh goodput figures alone are written at most this often.
GOODPUT_WRITE_SECONDS = 30.0


class StatusWriter:
    """One job's status writes, its goodput ledger, and the metrics that mirror the status."""

    def __init__(self, job: JobRef, book: HeartbeatBook, labels: dict[str, str], goodput: GoodputLedger) -> None:
        self.job = job
        self.book = book
        self._labels = labels
        self.goodput = goodput
        self._goodput_written = -float("inf")  # monotonic time the status last got fresh goodput figures
        # The last write (monotonic time, body), and when progress alone may be written after it:
        # worked out when first asked, from the body's size (json-encoding a plan of hundreds of kB
        # right after a plan's write would hold up its push).
        self._written: tuple[float, dict[str, Any]] | None = None
        self._progress_due: float | None = None

    async def write(
        self, old: MegatronJobStatus, obs: Observation, members: Iterable[str], now: datetime, force: bool
    ) -> MegatronJobStatus:
        """The status after ``obs``: written unless nothing but throttled figures changed."""
        members = list(members)
        new = compute_status(old, obs, now)
        wall = time.time()
        self.goodput.observe(
            wall,
            trained=obs.plan is not None and obs.committed_epoch >= obs.plan.epoch,
            step=obs.step,
            step_time=self.step_time(members),
            checkpoint_blocking=self._checkpoint_blocking(members),
        )
        metrics.export_goodput(self._labels, self.goodput.snapshot(wall))
        # Each body is made once: at thousands of pods the plan makes it a few hundred kB.
        old_body = status_body(old)
        new = new.model_copy(update={"goodput": old.goodput})
        body = status_body(new)
        fresh = force or body != old_body or time.monotonic() - self._goodput_written >= GOODPUT_WRITE_SECONDS
        if fresh:
            new = new.model_copy(update={"goodput": self.goodput.snapshot(wall)})
            body = status_body(new)
        if not force and (
            body == old_body or (progress_only(old_body, body) and time.monotonic() < self._progress_allowed())
        ):
            return old
        if fresh:
            self._goodput_written = time.monotonic()
        await kube.write_status(self.job.namespace, self.job.name, body)
        self._written, self._progress_due = (time.monotonic(), body), None
        self._export(new)
        return new

    def _progress_allowed(self) -> float:
        """Monotonic time from which progress alone may be written."""
        if self._written is None:
            return -float("inf")
        if self._progress_due is None:
            written_at, body = self._written
            self._progress_due = written_at + progress_write_gap(body)
        return self._progress_due

    def step_time(self, pods: Iterable[str]) -> float | None:
        """The latest step's duration as the slowest of ``pods`` measured it."""
        times = [hb.report.step_time_seconds for p in pods if (hb := self.book.last(self.job.uid, p)) is not None]
        return max((t for t in times if t is not None), default=None)

    def _checkpoint_blocking(self, pods: Iterable[str]) -> dict[str, float]:
        """Per pod, the total time its training was blocked starting checkpoint saves."""
        out = {}
        for pod in pods:
            hb = self.book.last(self.job.uid, pod)
            if hb is not None and hb.report.checkpoint_blocking_seconds is not None:
                out[pod] = hb.report.checkpoint_blocking_seconds
        return out

    def _export(self, status: MegatronJobStatus) -> None:
        metrics.EPOCH.labels(**self._labels).set(status.epoch)
        metrics.DP.labels(**self._labels).set(status.plan.sizes.dp if status.plan else 0)
        metrics.SPARES_READY.labels(**self._labels).set(status.spares_ready)
        metrics.READY_WORKERS.labels(**self._labels).set(status.ready_workers)
        for phase in JobPhase:
            metrics.PHASE.labels(**self._labels, phase=phase.value).set(1 if phase is status.phase else 0)
        if status.buddy_copy_step is not None and status.step is not None:
            # Copies can be ahead of the lagging step reports: no step is at risk then.
            metrics.BUDDY_COPY_LAG.labels(**self._labels).set(max(0, status.step - status.buddy_copy_step))
        else:  # no copies, or not yet complete on every member this epoch: the series goes stale
            metrics.BUDDY_COPY_LAG.remove_by_labels(self._labels)
