"""Progress-based hang detection: a step that takes far longer than the epoch's recent steps is a hang.

A hung rank (a stopped process, a collective that never completes) makes every other rank wait in
a collective. Waiting out ``collectiveTimeoutSeconds`` (30 s by default) costs most of a recovery,
so each worker's watchdog thread watches its own progress instead: the main thread marks which
phase of training it is in (:class:`Phase`), and a step phase that runs past

    limit = min(collectiveTimeoutSeconds, max(hangDetectionFloorSeconds, hangDetectionStepMultiple x median))

where ``median`` is the median time of the last :data:`RECENT_STEPS` steps of this epoch (once it has
:data:`MIN_RECORDED_STEPS`), is a hang. On gloo (CPU: tests, the demo) the floor is at least
:data:`GLOO_FLOOR_SECONDS`: processes there share a few cores and their steps jitter by whole
seconds (measured on 2 shared cores: a 0.3 s median step, then a step past 1 s with no fault).
Every survivor stalls in the same step, so each one's watchdog fires on its own, within about one
limit of the hang; the stopped rank itself detects nothing (its supervisor kills it).

What is not a hang, and how it is told apart:

- the first step of an epoch (compilation, allocator warm-up, new communicators), and the step
  after a checkpoint save or while one is being written in the background (the writer competes for
  the host; measured on CPU: the step after a 1.4 s synchronous save took over 1 s against a 0.2 s
  median): these are warm-up steps, never recorded, allowed the collective timeout;
- reading the step's data, and a checkpoint save: these are phases of their own
  (:attr:`Phase.DATA`, :attr:`Phase.CHECKPOINT`) allowed the collective timeout, and not counted in
  the step time;
- a *peer's* slow data read or save, which stalls this rank in a collective like a hang would: a
  rank in such a phase for longer than a fraction of its step limit announces it by incrementing a
  counter in the epoch's store (:class:`PeerActivity`); a stalled rank reads the counter halfway to
  its limit and again at the limit, and a changed value (some peer is alive and busy) postpones the
  decision by one more limit. A stopped peer announces nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import statistics
import threading
import time
from collections import deque

import torch.distributed as dist

from megatron_contract.job import FailureDetectionSpec

log = logging.getLogger(__name__)

#: Steps of the current epoch whose median sets the step limit.
RECENT_STEPS = 8
#: Recorded steps (warm-ups excluded) the epoch needs before the limit adapts.
MIN_RECORDED_STEPS = 3
#: The least floor on gloo (CPU), whatever ``hangDetectionFloorSeconds`` says.
GLOO_FLOOR_SECONDS = 5.0

#: The store key (under the epoch's prefix) busy ranks increment.
BUSY_KEY = "watchdog/busy"

#: A rank in a data read or save announces itself every ``step limit / ANNOUNCE_DIVISOR`` once the
#: phase has run that long: a stalled peer's two readings, half a limit apart, always straddle one.
ANNOUNCE_DIVISOR = 5

#: How long the watchdog waits for one request to the busy counter (:class:`PeerActivity`).
STORE_CALL_SECONDS = 1.0


class Phase(enum.StrEnum):
    """What the main thread is doing while training."""

    STEP = "step"  # forward/backward, the step's collectives, the optimizer update
    DATA = "data"  # reading the step's samples (before any collective of the step)
    # Starting, polling or completing a checkpoint save (collective), or a buddy-copy refresh.
    CHECKPOINT = "checkpoint"


class StepLimit:
    """How long a step may run in the current epoch, from the epoch's recent step times."""

    def __init__(self, detection: FailureDetectionSpec, min_floor: float = 0.0) -> None:
        self.ceiling = detection.collective_timeout_seconds
        self.floor = min(max(detection.hang_detection_floor_seconds, min_floor), self.ceiling)
        self.multiple = detection.hang_detection_step_multiple
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self._lock = threading.Lock()
        self._warm_up = True  # the next step is a warm-up: collective timeout, not recorded

    def reset(self) -> None:
        """A new epoch: its first step is a warm-up, earlier epochs' times say nothing about it."""
        with self._lock:
            self._recent.clear()
            self._warm_up = True

    def warm_up_next(self) -> None:
        """The next step is a warm-up too (a checkpoint save just ran, or is being written)."""
        with self._lock:
            self._warm_up = True

    def record(self, seconds: float) -> None:
        """A completed step of this epoch, data read excluded; a warm-up step is not recorded."""
        with self._lock:
            if self._warm_up:
                self._warm_up = False
            else:
                self._recent.append(seconds)

    def median(self) -> float | None:
        """The median recent step time; None before the epoch has recorded enough steps."""
        with self._lock:
            return statistics.median(self._recent) if len(self._recent) >= MIN_RECORDED_STEPS else None

    def step_limit(self) -> float:
        """Seconds the step phase may take before it counts as hung."""
        with self._lock:
            warm_up = self._warm_up
        median = self.median()
        if median is None or self.multiple == 0 or warm_up:
            return self.ceiling
        return min(self.ceiling, max(self.floor, self.multiple * median))

    def describe(self) -> str:
        """How the step limit was set, for a log line or a report."""
        median = self.median()
        if median is None or self.multiple == 0 or self.step_limit() == self.ceiling:
            return f"collective timeout {self.ceiling:g}s"
        return f"{self.multiple:g} x median step {median:.3f}s, floor {self.floor:g}s, cap {self.ceiling:g}s"


@dataclasses.dataclass(frozen=True)
class PhaseMark:
    """The phase the main thread entered, at which step, when (monotonic), and the step limit in
    force as it began."""

    phase: Phase
    step: int
    started: float
    serial: int  # tells two consecutive phases of the same kind and step apart
    # Taken by the main thread, not by the watchdog when it judges: a tick late enough to see the
    # mark after the step ended would otherwise judge a warm-up step by the next step's limit (the
    # step's end records it and clears the warm-up), a false hang on a loaded host.
    step_limit: float

    def allowance(self, ceiling: float) -> float:
        """Seconds this phase may take: a data read or a save gets the collective timeout."""
        return self.step_limit if self.phase is Phase.STEP else ceiling


class ProgressMarks:
    """The main thread's current phase, readable by the watchdog thread."""

    def __init__(self, limits: StepLimit) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._mark: PhaseMark | None = None
        self._serial = 0

    def begin(self, phase: Phase, step: int) -> None:
        """Enter ``phase`` of step ``step`` (ends the previous phase)."""
        step_limit = self.limits.step_limit()
        with self._lock:
            self._serial += 1
            self._mark = PhaseMark(phase, step, time.monotonic(), self._serial, step_limit)

    def end(self) -> float:
        """Leave the current phase; returns how long it ran (0 when none)."""
        with self._lock:
            mark, self._mark = self._mark, None
        return time.monotonic() - mark.started if mark is not None else 0.0

    def current(self) -> PhaseMark | None:
        """The phase in progress, if any."""
        with self._lock:
            return self._mark


class PeerActivity:
    """Through the epoch's store: announce that this rank is alive but busy, and see whether any
    peer did. One counter for the whole epoch, so a reading costs one store request whatever the
    world size; only slow phases write, and only stalled ranks read.

    Each request runs on a thread of its own and is waited for at most :data:`STORE_CALL_SECONDS`:
    the store's host (an agent) may be stopped or cut off, and a TCPStore request then blocks
    past the client's timeout (measured: still blocked after 20 s with a 5 s timeout). Blocked
    there, the watchdog would never reach its verdict. A request that has not returned counts as
    unreadable, and so does every later one until it returns."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self._baseline: int | None = None
        self._blocked: threading.Thread | None = None  # a request that did not return in time

    def announce(self) -> None:
        """This rank is alive, in a phase that may keep its peers waiting (a failed request is
        logged: the peers then decide as if nobody were busy)."""
        self._add(1, "announce a busy phase")

    def read(self) -> int | None:
        """The counter now (``add`` of 0 never blocks on a missing key); None when unreadable."""
        return self._add(0, "read the peers' busy counter")

    def _add(self, amount: int, what: str) -> int | None:
        if self._blocked is not None and self._blocked.is_alive():
            return None
        answer: list[int | Exception] = []

        def request() -> None:
            try:
                answer.append(int(self.store.add(BUSY_KEY, amount)))
            except Exception as err:  # the store may be gone with its host: detection goes on
                answer.append(err)

        thread = threading.Thread(target=request, name="busy-counter", daemon=True)
        thread.start()
        thread.join(STORE_CALL_SECONDS)
        if thread.is_alive():
            self._blocked = thread
            log.warning("could not %s: no answer from the store in %gs", what, STORE_CALL_SECONDS)
            return None
        value = answer[0]
        if isinstance(value, Exception):
            log.warning("could not %s: %s", what, value)
            return None
        return value

    def set_baseline(self) -> None:
        """Remember the counter; :meth:`busy_since_baseline` compares against it."""
        self._baseline = self.read()

    def busy_since_baseline(self) -> bool:
        """Whether some peer announced itself since the baseline; the baseline moves to now."""
        value = self.read()
        busy = self._baseline is not None and value is not None and value != self._baseline
        self._baseline = value
        return busy

    def clear(self) -> None:
        """Forget the baseline (the stalled phase ended)."""
        self._baseline = None


class HangWatch:
    """The watchdog's decision, one :meth:`check` per tick: the reason to abort the epoch, or None.

    Side effects through ``activity``: announces this rank while it is in a long data read or save,
    and reads the peers' announcements while its own step is stalled."""

    def __init__(self, limits: StepLimit) -> None:
        self.limits = limits
        self._announced_at = 0.0
        self._stalled: int | None = None  # serial of the step phase being judged
        self._deadline = 0.0  # when the stalled step phase is judged (next)

    def check(self, mark: PhaseMark | None, now: float, activity: PeerActivity | None) -> str | None:
        """Judge the main thread's phase ``mark`` at monotonic time ``now``."""
        if mark is None:
            self._forget(activity)
            return None
        elapsed = now - mark.started
        limit = mark.step_limit
        if mark.phase is not Phase.STEP:
            self._forget(activity)
            allowance = mark.allowance(self.limits.ceiling)
            if elapsed > allowance:
                return f"hang: {mark.phase.value} of step {mark.step} running for more than {allowance:g}s"
            period = limit / ANNOUNCE_DIVISOR
            if activity is not None and elapsed > period and now - self._announced_at >= period:
                activity.announce()
                self._announced_at = now
            return None
        if elapsed > self.limits.ceiling:
            return f"hang: step {mark.step} running for more than the collective timeout {self.limits.ceiling:g}s"
        if limit >= self.limits.ceiling:
            return None  # no recent step time (first step of the epoch): the collective timeout decides
        if self._stalled != mark.serial:
            if elapsed < limit / 2:
                return None
            self._stalled, self._deadline = mark.serial, mark.started + limit
            if activity is not None:
                activity.set_baseline()  # halfway: what the peers had announced so far
        if now < self._deadline:
            return None
        if activity is not None and activity.busy_since_baseline():
            self._deadline = now + limit  # a peer is alive and reading data or saving: give it a limit more
            return None
        return (
            f"hang: step {mark.step} made no progress for {elapsed:.2f}s (limit {limit:.2f}s: {self.limits.describe()})"
        )

    def _forget(self, activity: PeerActivity | None) -> None:
        self._stalled = None
        if activity is not None:
            activity.clear()
