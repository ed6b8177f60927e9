"""Creating a job's children without looping: backoff per kind of child, and what to tell the user.

Three kinds of children are created: the token Secret, the headless Service and the pods. Each
has a :class:`Backoff`: a failed attempt (the API server refused the create, or for pods, a pod
this operator created failed within :data:`START_GRACE_SECONDS`) delays the next one, doubling
up to :data:`MAX_DELAY_SECONDS`. After :data:`REPORT_AFTER` failures in a row the job gets the
``CreateFailed`` condition and a Warning event naming the child and the API server's reason; the
operator keeps retrying at the capped delay (quota freed, RBAC fixed, spec edited), and clears
the condition once the child is created (for pods: once one survives its start).

Pure: no clock of its own (callers pass ``time.monotonic()``), no API calls.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Container, Iterable, Mapping

from megatron_operator.failures import Failure, PodFacts, PodHealth, classify_pod

#: Failures in a row before the job's condition and an event say so.
REPORT_AFTER = 3
#: A pod that fails this soon after its creation failed to start: its replacement waits.
START_GRACE_SECONDS = 30.0
#: A created pod never seen in the index by then is forgotten (the controller has created another).
FORGET_UNSEEN_SECONDS = 600.0
BASE_DELAY_SECONDS = 1.0
MAX_DELAY_SECONDS = 60.0
#: A pod's labels asked for and not yet seen on it are not asked for again before this.
LABEL_RESEND_SECONDS = 30.0


class Child(enum.StrEnum):
    """The kinds of children, in the order they are needed (pods need the Secret and Service)."""

    SECRET = "Secret"
    SERVICE = "Service"
    DISRUPTION_BUDGET = "PodDisruptionBudget"
    POD = "Pod"


def delay_after(failures: int) -> float:
    """Seconds to wait before the next attempt after ``failures`` failures in a row.

    A single failure costs nothing (a pod killed by a test or an eviction is replaced at once);
    from the second on the delay doubles from :data:`BASE_DELAY_SECONDS` to :data:`MAX_DELAY_SECONDS`.
    """
    if failures <= 1:
        return 0.0
    return min(MAX_DELAY_SECONDS, BASE_DELAY_SECONDS * 2.0 ** (failures - 2))


@dataclasses.dataclass
class Backoff:
    """Failures in a row of one kind of child, and when the next attempt may go."""

    failures: int = 0
    next_at: float = 0.0
    error: str = ""
    reason: str = ""

    def ready(self, now: float) -> bool:
        """Whether an attempt may go now."""
        return now >= self.next_at

    def failed(self, now: float, reason: str, error: str) -> None:
        """One more failure (``reason``: CamelCase, for the condition and event): the next attempt waits."""
        self.failures += 1
        self.reason, self.error = reason, error
        self.next_at = now + delay_after(self.failures)

    def succeeded(self) -> None:
        """The child exists (or a pod started): the next failure is the first again."""
        self.failures, self.next_at, self.error, self.reason = 0, 0.0, "", ""

    @property
    def reportable(self) -> bool:
        """Enough failures in a row to tell the user."""
        return self.failures >= REPORT_AFTER


@dataclasses.dataclass(frozen=True)
class StartOutcome:
    """What became of the pods this operator created, since the last look."""

    started: tuple[str, ...] = ()  # survived START_GRACE_SECONDS
    failed: tuple[str, ...] = ()  # each with its message in ``messages``
    messages: tuple[str, ...] = ()


class StartTracker:
    """The pods this operator created and has not yet seen survive (or fail) their start."""

    def __init__(self) -> None:
        self._created: dict[str, float] = {}  # pod name -> time.monotonic() of the create
        self._seen: set[str] = set()

    def __len__(self) -> int:
        return len(self._created)

    def created(self, names: Iterable[str], now: float) -> None:
        """Pods just created."""
        for name in names:
            self._created[name] = now

    def observe(
        self,
        pods: Iterable[PodFacts],
        failed: Mapping[str, Failure],
        retired: Container[str],
        nodes: Mapping[str, str],
        now: float,
        reported: Container[str] = (),
    ) -> StartOutcome:
        """Settle every tracked pod that started or failed.

        Args:
            pods: the job's pods as indexed now.
            failed: pods the controller declared failed (heartbeats, peers, ...), by name.
            retired: pods the operator itself deleted on purpose (never a failed start).
            nodes: Ready status by node name.
            now: ``time.monotonic()``.
            reported: pods whose agent has reported: they started, however soon they fail later.
        """
        by_name = {p.name: p for p in pods}
        started: list[str] = []
        failures: list[str] = []
        messages: list[str] = []
        for name, at in list(self._created.items()):
            pod = by_name.get(name)
            if name in retired:
                del self._created[name]
                continue
            if pod is None:
                if name in self._seen:  # it was there and is gone: deleted before it started
                    failures.append(name)
                    messages.append(f"pod {name} was deleted {now - at:.0f} s after its creation")
                    del self._created[name]
                elif now - at > FORGET_UNSEEN_SECONDS:  # never showed up: the controller creates another
                    del self._created[name]
                continue
            self._seen.add(name)
            health, failure = classify_pod(pod, nodes)
            failure = failed.get(name) or failure
            if failure is not None or health is PodHealth.FAILED:
                failures.append(name)
                why = failure.message if failure is not None else f"pod {name} failed"
                messages.append(f"{why} ({now - at:.0f} s after its creation)")
                del self._created[name]
            elif health is PodHealth.SUCCEEDED or (
                health is PodHealth.READY and (name in reported or now - at >= START_GRACE_SECONDS)
            ):
                started.append(name)
                del self._created[name]
        self._seen &= set(self._created)
        return StartOutcome(tuple(started), tuple(failures), tuple(messages))


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The ``CreateFailed`` condition a job should carry."""

    failing: bool
    reason: str
    message: str


def verdict(backoffs: Mapping[Child, Backoff], cleared_reason: str) -> Verdict:
    """The condition from the backoffs: True with the first reportable child's reason, else False.

    Args:
        backoffs: the backoff of each kind of child.
        cleared_reason: the reason when nothing is failing.
    """
    failing = [c for c in Child if c in backoffs and backoffs[c].reportable]
    if not failing:
        return Verdict(False, cleared_reason, "")
    message = "; ".join(
        f"{c.value}: {backoffs[c].failures} failures in a row, last: {backoffs[c].error}" for c in failing
    )
    return Verdict(True, backoffs[failing[0]].reason, message[:4000])


class LabelRequests:
    """The labels asked of each pod and not yet seen on it, so that no pass asks again meanwhile.

    A pass relabels the pods whose labels differ from the plan in force, as the pod index shows
    them; the index lags the API server by the watch events still queued (seconds, under load).
    Without this, every pass sent the patches of the passes before it again: after the first plan
    of a 1,024-pod job thousands of patches, each a pod event that woke the job for another pass.
    A patch not seen within :data:`LABEL_RESEND_SECONDS` (it failed, or someone changed the
    label back) is sent again.
    """

    def __init__(self) -> None:
        self._asked: dict[str, tuple[Mapping[str, str | None], float]] = {}

    def due(self, pod: str, labels: Mapping[str, str | None], shown: bool, now: float) -> bool:
        """Whether to send ``labels`` to ``pod`` now: they are not ``shown`` on it and were not
        asked for lately (recorded as asked for when so)."""
        if shown:
            self._asked.pop(pod, None)
            return False
        asked = self._asked.get(pod)
        if asked is not None and asked[0] == labels and now - asked[1] < LABEL_RESEND_SECONDS:
            return False
        self._asked[pod] = (labels, now)
        return True

    def keep_only(self, pods: Container[str]) -> None:
        """Forget the pods not among ``pods`` (deleted)."""
        self._asked = {p: v for p, v in self._asked.items() if p in pods}

    def pending(self) -> int:
        """How many pods were asked for labels they do not show yet."""
        return len(self._asked)
