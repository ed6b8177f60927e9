"""When an epoch refreshes its buddy copies (worker/buddy_copies.py): every ``replicaIntervalSteps``
steps, or, with a cost budget (``spec.training.optimizer.replicaCostPercent``), every ``N`` steps
measured at the epoch's start.

A refresh slows the steps that run beside it by a near-fixed time, whatever their length (on 2xH200,
22-38 ms for a 1.1 B GPT's 6.6 GB shards), so the cost of refreshing every step ranges from a
fraction of a percent of a long step to a tenth of a short one. With a budget the epoch first
*calibrates*: :data:`CALIBRATION_REFRESHES` refreshes, :data:`CALIBRATION_PERIOD` steps apart (or
the interval in force, when longer: ``replicaIntervalSteps`` at first), charge each refresh the time by which the
:data:`BESIDE_STEPS` steps after its start outlast the median step clear of any refresh (the steps
after those, up to the next refresh), plus the training thread's time starting it between two
steps. Then

    N = max(replicaIntervalSteps, ceil(cost / (budget x clear step)), steps a refresh took)

(the last term: a refresh still in flight when the next is due holds the training thread up). Every
rank proposes its ``N`` and all adopt the largest (``BuddyCopies.agree``): sends and receives pair
up, and the planner restores every shard at one step, so all ranks refresh at the same steps. A
failure then finds copies at most ``N - 1`` steps old (the plan says how many steps are redone).
Every :data:`RECALIBRATE_STEPS` steps the epoch calibrates again (steps grow longer or shorter
over a long run), at the current interval when that is longer than the calibration's period.

Pure: the training loop (worker/training_loop.py) tells it each step's time and when a refresh
started and ended, and asks it which step boundaries refresh and when to agree.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

#: Refreshes measured while calibrating.
CALIBRATION_REFRESHES = 4

#: Steps from one calibrating refresh to the next, at least: two beside it, two clear of it.
CALIBRATION_PERIOD = 4

#: Steps after a refresh's start that are charged with its cost (one that outlasts two steps also
#: slows the third; it is then held to its duration by the last term of N).
BESIDE_STEPS = 2

#: The largest interval proposed (``OptimizerSpec.replica_interval_steps``' bound).
MAX_INTERVAL = 1_000_000

#: Steps from one agreement to the next calibration.
RECALIBRATE_STEPS = 1000


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What the calibrating refreshes measured on this rank, and the interval it proposes."""

    cost_s: float  # a refresh's cost to the steps beside it (median over the refreshes, >= 0)
    clear_step_s: float  # the median step clear of any refresh
    refresh_steps: int  # the most step boundaries a refresh took to end (1: by the next one)
    refreshes: int  # how many were measured
    proposal: int  # the interval this rank needs


def propose(
    times: dict[int, float],
    starts: list[int],
    ends: dict[int, int],
    interval: int,
    budget_percent: float,
    between: dict[int, float] | None = None,
) -> Calibration:
    """The interval a rank needs: ``times`` are step times by step count (the count after the step),
    ``starts`` the counts after which the calibrating refreshes started, ``ends`` the count at which
    each was seen finished, ``interval`` the floor (replicaIntervalSteps), ``budget_percent`` the
    budget, ``between`` the training thread's time at each start's step boundary (seconds)."""
    between = between or {}
    beside: set[int] = set()
    for s in starts:
        beside.update(range(s + 1, s + 1 + BESIDE_STEPS))
    clear = [t for n, t in times.items() if n not in beside]
    if not clear:
        raise ValueError("no step clear of a refresh was measured")
    clear_s = statistics.median(clear)
    costs = [
        sum(times[n] for n in range(s + 1, s + 1 + BESIDE_STEPS)) - BESIDE_STEPS * clear_s + between.get(s, 0.0)
        for s in starts
        if all(n in times for n in range(s + 1, s + 1 + BESIDE_STEPS))
    ]
    if not costs:
        raise ValueError("no refresh was measured with the steps beside it")
    cost_s = max(0.0, statistics.median(costs))
    took = max((ends[s] - s for s in starts if s in ends), default=1)
    # (rounding error in the step times is no reason for one more step)
    by_cost = math.ceil(cost_s / (budget_percent / 100 * clear_s) - 1e-9) if clear_s > 0 else MAX_INTERVAL
    proposal = min(MAX_INTERVAL, max(interval, by_cost, took, 1))
    return Calibration(cost_s, clear_s, took, len(costs), proposal)


class CopySchedule:
    """The refreshes of one epoch on one rank. Step counts are ``TrainState.step`` after a step: a
    refresh due at ``n`` copies the state after ``n`` steps and runs beside step ``n + 1``."""

    def __init__(self, interval: int, budget_percent: float | None, first: int) -> None:
        """``interval``: replicaIntervalSteps; ``budget_percent``: replicaCostPercent (None: none);
        ``first``: the step count the epoch starts at (its first step is a warm-up, not measured)."""
        if interval < 1:
            raise ValueError(f"interval {interval} < 1")
        if budget_percent is not None and not 0 < budget_percent <= 100:
            raise ValueError(f"budget {budget_percent} % is not in (0, 100]")
        self.floor = self.interval = interval
        self.budget_percent = budget_percent
        self.calibration: Calibration | None = None
        self.starts: list[int] = []
        self.agree_at: int | None = None  # the step count of the next agreement
        self._open_window(first)

    def _open_window(self, after: int) -> None:
        """Plan a calibration: its refreshes start past ``after`` (and the step after it), on
        multiples of the period, the current interval when that is longer (it then costs nothing
        more); none starts in the two steps before it, so the refresh before is done."""
        self._times: dict[int, float] = {}
        self._ends: dict[int, int] = {}
        self._between: dict[int, float] = {}
        self._in_flight: int | None = None  # the count of the calibrating refresh in flight
        if self.budget_percent is None:
            return
        period = max(CALIBRATION_PERIOD, self.interval)
        start = -(-(after + 2) // period) * period
        self.starts = [start + i * period for i in range(CALIBRATION_REFRESHES)]
        # Agreed once the last calibrating refresh's clear steps are measured, before any other refresh.
        self.agree_at = start + CALIBRATION_REFRESHES * period

    def due(self, step: int) -> bool:
        """Whether a refresh starts after ``step`` steps."""
        if self.agree_at is not None and self.starts[0] - 2 <= step < self.agree_at:
            return step in self.starts
        return step % self.interval == 0

    def record_step(self, step: int, seconds: float) -> None:
        """The time of the step that made the count ``step``."""
        if self.agree_at is not None and self.starts[0] < step <= self.agree_at:
            self._times[step] = seconds

    def started(self, step: int, seconds: float = 0.0) -> None:
        """A refresh started after ``step`` steps; ``seconds``: the training thread's time on it
        at that boundary (starting it, and waiting for the one before)."""
        if self.agree_at is not None and step in self.starts:
            self._in_flight = step
            self._between[step] = seconds

    def ended(self, step: int) -> None:
        """The refresh in flight was seen finished at the boundary after ``step`` steps."""
        if self._in_flight is not None:
            self._ends[self._in_flight] = step
            self._in_flight = None

    def proposal(self) -> Calibration:
        """This rank's measurements and the interval it needs (once ``agree_at`` is reached)."""
        assert self.budget_percent is not None
        return propose(self._times, self.starts, self._ends, self.floor, self.budget_percent, self._between)

    def adopt(self, interval: int, calibration: Calibration) -> None:
        """Refresh every ``interval`` steps from now on (the largest any rank proposed), until the
        next calibration, :data:`RECALIBRATE_STEPS` later (steps may have grown shorter or longer)."""
        if interval < self.floor:
            raise ValueError(f"interval {interval} below replicaIntervalSteps {self.floor}")
        assert self.agree_at is not None
        self.interval, self.calibration = interval, calibration
        self._open_window(self.agree_at + RECALIBRATE_STEPS)
