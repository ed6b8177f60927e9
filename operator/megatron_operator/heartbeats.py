"""Agent heartbeats, kept in memory only (no API-server write per heartbeat).

One operator replica must keep up with a 4096-pod job: a report costs a dict update, and the
deadline check is a pass over the members of a plan when the job reconciles. A pod's watchdog is
armed by its first heartbeat, so a restarted operator (which has forgotten every heartbeat) and a
pod whose agent has not started yet are never declared failed for silence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from megatron_contract.agent import AgentReport, AgentState


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """The last report of one pod's agent and when it arrived (monotonic seconds)."""

    report: AgentReport
    received: float


@dataclasses.dataclass(frozen=True)
class Accusation:
    """A survivor's word that a collective with ``pod`` (or ``rank``) failed in ``epoch``."""

    epoch: int
    reporter: str
    pod: str | None
    rank: int | None
    reason: str


# A pod is fit to join a plan only when its agent says its workers are warm and waiting.
_WARM = (AgentState.SPARE,)


class HeartbeatBook:
    """The last heartbeat of every agent, and the failed peers they reported, by job UID."""

    def __init__(self) -> None:
        self._last: dict[str, dict[str, Heartbeat]] = {}
        self._accusations: dict[str, list[Accusation]] = {}
        # pod -> (newest epoch in which it reported a committed step, when that first arrived)
        self._first_commit: dict[str, dict[str, tuple[int, float]]] = {}

    def record(self, report: AgentReport, now: float) -> None:
        """Store a report (replacing the pod's previous one)."""
        self._last.setdefault(report.job_uid, {})[report.pod] = Heartbeat(report, now)
        # An agent reports a step only from progress of the epoch it holds: a step in the report
        # means a training step of that epoch was committed.
        if report.step is not None and report.state in (AgentState.TRAINING, AgentState.SUCCEEDED):
            commits = self._first_commit.setdefault(report.job_uid, {})
            if report.epoch > commits.get(report.pod, (0, 0.0))[0]:
                commits[report.pod] = (report.epoch, now)
        if report.failed_peers:
            found = self._accusations.setdefault(report.job_uid, [])
            for peer in report.failed_peers:
                found.append(Accusation(peer.epoch, report.pod, peer.pod, peer.rank, peer.reason))
            del found[:-1024]  # a bounded memory of accusations per job

    def last(self, job_uid: str, pod: str) -> Heartbeat | None:
        """The last heartbeat of a pod, if any."""
        return self._last.get(job_uid, {}).get(pod)

    def fresh(self, job_uid: str, pods: Iterable[str], max_age: float, now: float) -> list[str]:
        """Pods among ``pods`` whose agent reported within ``max_age``, freshest first."""
        seen = self._last.get(job_uid, {})
        alive = [p for p in pods if p in seen and now - seen[p].received <= max_age]
        return sorted(alive, key=lambda p: -seen[p].received)

    def warm(self, job_uid: str, pods: Iterable[str], max_age: float, now: float) -> list[str]:
        """Pods whose agent reported recently that its workers are warm, healthy and hold no rank."""
        seen = self._last.get(job_uid, {})
        return [
            p
            for p in self.fresh(job_uid, pods, max_age, now)
            if seen[p].report.healthy and seen[p].report.state in _WARM
        ]

    def committed(self, job_uid: str, pods: Iterable[str], epoch: int) -> float | None:
        """When the last of ``pods`` reported its first committed step of ``epoch`` (or later);
        None while some pod has not."""
        commits = self._first_commit.get(job_uid, {})
        times = []
        for p in pods:
            got = commits.get(p)
            if got is None or got[0] < epoch:
                return None
            times.append(got[1])
        return max(times) if times else None

    def missing(self, job_uid: str, pods: Iterable[str], timeout: float, now: float) -> list[str]:
        """Pods among ``pods`` whose last heartbeat is older than ``timeout`` (armed pods only)."""
        seen = self._last.get(job_uid, {})
        return [p for p in pods if p in seen and now - seen[p].received > timeout]

    def self_reported_failed(self, job_uid: str, pods: Iterable[str]) -> list[str]:
        """Pods whose agent says it is unhealthy or failed."""
        seen = self._last.get(job_uid, {})
        return [
            p for p in pods if p in seen and (not seen[p].report.healthy or seen[p].report.state is AgentState.FAILED)
        ]

    def accusations(self, job_uid: str, epoch: int) -> list[Accusation]:
        """Failed peers reported for ``epoch``."""
        return [a for a in self._accusations.get(job_uid, []) if a.epoch == epoch]

    def completed_step(self, job_uid: str, pods: Iterable[str]) -> int | None:
        """How many steps every reporting pod among ``pods`` completed (None when none reported)."""
        seen = self._last.get(job_uid, {})
        steps = [seen[p].report.step for p in pods if p in seen and seen[p].report.step is not None]
        return min(s for s in steps if s is not None) if steps else None

    def step_seconds(self, job_uid: str, pods: Iterable[str]) -> float | None:
        """The fastest recent step among ``pods``, as their agents reported it (None when none did):
        a step boundary ahead is counted in it, so that no member overtakes the boundary."""
        seen = self._last.get(job_uid, {})
        times = [seen[p].report.step_time_seconds for p in pods if p in seen]
        return min((t for t in times if t), default=None)

    def checkpoint_step(self, job_uid: str) -> int | None:
        """The newest complete checkpoint any agent of the job reported (a checkpoint is global)."""
        steps = [hb.report.checkpoint_step for hb in self._last.get(job_uid, {}).values()]
        return max((s for s in steps if s is not None), default=None)

    def replica_steps(self, job_uid: str, epoch: int) -> dict[str, list[int]]:
        """By pod: the steps of the complete host copies of optimizer shards it holds, from reports
        of ``epoch`` only (an older epoch's copies follow another buddy assignment); the planner's
        ``copy_steps``."""
        seen = self._last.get(job_uid, {})
        return {pod: list(hb.report.replica_steps) for pod, hb in seen.items() if hb.report.epoch == epoch}

    def checkpoint_unusable(self, job_uid: str) -> str | None:
        """Why a restore gave up, if an agent of the job reported one (no checkpoint passed verification)."""
        found = [hb.report.checkpoint_unusable for hb in self._last.get(job_uid, {}).values()]
        return next((reason for reason in found if reason), None)

    def suspend_outcome(self, job_uid: str, pods: Iterable[str], epoch: int) -> tuple[int | None, str | None]:
        """What the agents of ``pods`` holding ``epoch`` (a suspend plan) said of its checkpoint: its
        step once complete, or why it failed (the save is collective: one member's word is the world's)."""
        seen = self._last.get(job_uid, {})
        reports = [seen[p].report for p in pods if p in seen and seen[p].report.epoch == epoch]
        step = max((r.suspend_step for r in reports if r.suspend_step is not None), default=None)
        error = next((r.suspend_error for r in reports if r.suspend_error), None)
        return step, error

    def epochs(self, job_uid: str) -> dict[str, int]:
        """The plan epoch each reporting pod holds."""
        return {pod: hb.report.epoch for pod, hb in self._last.get(job_uid, {}).items()}

    def finished(self, job_uid: str, members: Iterable[str], train_iters: int) -> bool:
        """Whether training finished: some pod's agent reported it, and none of ``members`` still
        writes its final checkpoint (reported the last step but not yet that it finished).

        One report is enough: the members of a mesh commit every step together, so one that
        finished means the last step was committed by all. The mesh may have been planned again
        meanwhile (a grow that its finished members refused), so the members of the plan in force
        need not all finish.
        """
        seen = self._last.get(job_uid, {})
        if not any(hb.report.state is AgentState.SUCCEEDED for hb in seen.values()):
            return False
        return not any(
            p in seen and seen[p].report.state is AgentState.TRAINING and (seen[p].report.step or 0) >= train_iters
            for p in members
        )

    def forget(self, job_uid: str, pods: Iterable[str] | None = None) -> None:
        """Drop what is known of some pods of a job (all of the job when ``pods`` is None)."""
        if pods is None:
            self._last.pop(job_uid, None)
            self._accusations.pop(job_uid, None)
            self._first_commit.pop(job_uid, None)
            return
        seen = self._last.get(job_uid, {})
        commits = self._first_commit.get(job_uid, {})
        for p in pods:
            seen.pop(p, None)
            commits.pop(p, None)
