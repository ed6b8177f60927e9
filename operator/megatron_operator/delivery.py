"""Getting the plan in force to every member: who holds it, when to push again, who is ahead.

A member holds the plan once a push was delivered or its agent reports the plan's epoch. A push
that fails is tried again with a doubling delay (up to :data:`PUSH_BACKOFF_MAX`); an agent that
refuses a push because it holds a newer epoch is never pushed to again: the operator's status is
behind, and pushing or planning past that agent would fight the job (skew.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from megatron_contract.mesh import MeshPlan
from megatron_operator import metrics
from megatron_operator.builders import JobRef
from megatron_operator.heartbeats import HeartbeatBook
from megatron_operator.push import PlanPusher, PushOutcome, PushResult
from megatron_operator.status import Reason

log = logging.getLogger(__name__)

PUSH_BACKOFF_MAX = 30.0
#: A failed push is announced in a Warning event once its member's delay has grown this long.
WARN_AFTER_BACKOFF = 4.0


class PlanDelivery:
    """Per member of the plan in force: acknowledged, or when the next push is due."""

    def __init__(self, job: JobRef, book: HeartbeatBook, labels: dict[str, str]) -> None:
        self.job = job
        self.book = book
        self._labels = labels
        self.acked: set[str] = set()
        self.acked_epoch = 0
        self.push_due: dict[str, float] = {}
        self.push_backoff: dict[str, float] = {}
        self.ahead: dict[str, int] = {}  # members whose agent refused a push: it holds a newer epoch

    def new_plan(self, plan: MeshPlan) -> None:
        """A plan made now: nobody holds it, everybody is due at once."""
        self.acked, self.acked_epoch = set(), plan.epoch
        self.push_due = {m.pod: 0.0 for m in plan.members}
        self.push_backoff = {}

    def adopt(self, plan: MeshPlan) -> None:
        """The plan in force as read back by a restarted operator: it does not know who holds it,
        and a second push is harmless (agents refuse an epoch they already hold)."""
        if self.acked_epoch != plan.epoch:
            self.acked, self.acked_epoch = set(), plan.epoch
            self.push_due = {m.pod: 0.0 for m in plan.members}

    def reported(self, pod: str, epoch: int, plan: MeshPlan) -> bool:
        """An agent of ``plan`` reported holding ``epoch``; whether that is news to act on now: only
        an agent behind the plan is (one that holds it needs no pass: the next push leaves it out)."""
        if epoch == plan.epoch:
            if self.acked_epoch == plan.epoch:
                self._held(pod)
            return False
        # The agent is behind (it missed a push, or restarted): send the plan again now.
        self.acked.discard(pod)
        self.push_due[pod] = 0.0
        return True

    def due_in(self, now: float) -> list[float]:
        """Seconds until each pending push."""
        return [t - now for t in self.push_due.values()]

    def _held(self, pod: str) -> None:
        # Held, however it got there: no push is due to it any more. A retry left scheduled for a
        # member that holds the plan made every pass the last (a pass every 50 ms, for good).
        self.acked.add(pod)
        self.push_due.pop(pod, None)
        self.push_backoff.pop(pod, None)

    def live_ahead(self, live: Iterable[str]) -> dict[str, int]:
        """The epochs held by agents (of pods in ``live``) that refused a push as behind them."""
        names = set(live)
        return {pod: epoch for pod, epoch in self.ahead.items() if pod in names}

    async def push(self, plan: MeshPlan, token: str | None, pusher: PlanPusher) -> list[tuple[str, str, str]]:
        """Push ``plan`` to the members that do not hold it and are due; the events to post."""
        epochs = self.book.epochs(self.job.uid)
        for m in plan.members:
            if epochs.get(m.pod, 0) == plan.epoch:
                self._held(m.pod)
        mono = time.monotonic()
        due = {
            m.pod
            for m in plan.members
            if m.pod not in self.acked and m.pod not in self.ahead and self.push_due.get(m.pod, 0.0) <= mono
        }
        if not due or token is None:
            return []
        start = time.monotonic()
        outcomes: list[PushOutcome] = await pusher.push(plan, token, due)
        took = time.monotonic() - start
        processes = len({o.origin for o in outcomes if o.origin is not None})
        metrics.PUSH_SECONDS.labels(**self._labels).observe(took)
        log.info(
            "%s/%s: pushed epoch %d to %d members in %.1f ms%s",
            self.job.namespace,
            self.job.name,
            plan.epoch,
            len(outcomes),
            took * 1000,
            f" from {processes} push processes" if processes else "",
        )
        failed = [o for o in outcomes if not self._settle(o)]
        events: list[tuple[str, str, str]] = []
        delivered = len(outcomes) - len(failed)
        if delivered:
            events.append(
                (
                    "Normal",
                    Reason.PLAN_PUSHED,
                    f"epoch {plan.epoch} pushed to {delivered} members in {time.monotonic() - start:.3f} s",
                )
            )
        if failed:
            sample = "; ".join(f"{o.pod}: {o.detail}" for o in failed[:3])
            log.info(
                "%s/%s: push of epoch %d failed for %d members (%s)",
                self.job.namespace,
                self.job.name,
                plan.epoch,
                len(failed),
                sample,
            )
            if any(self.push_backoff.get(o.pod, 0) >= WARN_AFTER_BACKOFF for o in failed):
                events.append(
                    (
                        "Warning",
                        Reason.PLAN_PUSH_FAILED,
                        f"epoch {plan.epoch} not delivered to {len(failed)} members: {sample}",
                    )
                )
        return events

    def _settle(self, o: PushOutcome) -> bool:
        """Note one push's outcome; whether it was delivered."""
        if o.result.delivered or o.pod in self.acked:  # delivered, or reported held meanwhile
            self._held(o.pod)
            return True
        if o.result is PushResult.AHEAD and o.held_epoch is not None:
            # Never pushed again: pushing, or planning past it, would fight the job (skew.py).
            self.ahead[o.pod] = o.held_epoch
            self.push_due.pop(o.pod, None)
            return False
        backoff = min(PUSH_BACKOFF_MAX, self.push_backoff.get(o.pod, 0.25) * 2)
        self.push_backoff[o.pod] = backoff
        self.push_due[o.pod] = time.monotonic() + backoff
        return False
