"""Goodput: where a job's wall time went, from the operator's view.

Wall time runs from the job's creation. Each reconcile (:meth:`GoodputLedger.observe`) files the
time since the previous one under the job's state then:

- **waiting for capacity**: no plan in force has trained yet and no recovery is open (pods being
  scheduled, pulled, started; too few pods for a mesh);
- **reconfiguration**: a failure was declared and not every member of the new plan has committed a
  step (less the time of that first step, which is training);
- **training** otherwise. Of training time, the steps kept are **productive** (each step's own
  duration, as the workers measured it); the rest is split into **checkpoint stalls** (the time the
  training thread was blocked starting saves, reported by the agents), **detection** (from the last
  step committed before a failure to the operator declaring it), **redone steps** (steps trained and
  then discarded because the job resumed from an older step, i.e. a checkpoint), and **other**
  (between steps: data loading outside the step, reporting lag; and any time the operator did not
  see, such as its own restart).

Goodput is productive / wall: the effective training time ratio. Nothing is estimated from targets
or benchmarks; every term comes from a measured duration or an observed interval.
"""

from __future__ import annotations

import dataclasses

from megatron_contract.job import Goodput, LostTime


@dataclasses.dataclass
class GoodputLedger:
    """Accumulates a job's time by cause. Times are Unix seconds (``time.time()``)."""

    created: float
    productive: float = 0.0
    detection: float = 0.0
    reconfiguration: float = 0.0
    redone_steps: float = 0.0
    waiting_for_capacity: float = 0.0
    checkpoint_stalls: float = 0.0
    training: float = 0.0  # observed time in the training state (productive and the rest)
    unobserved: float = 0.0  # time no reconcile observed (before this process, or between processes)
    _last: float | None = None  # time of the previous observation
    _step: int | None = None  # the job's step at the previous observation
    _step_time: float = 0.0  # mean duration of the steps counted so far
    _steps_counted: int = 0
    _last_progress: float | None = None  # when the step last advanced
    _recovering_since: float | None = None
    _blocking: dict[str, float] = dataclasses.field(default_factory=dict)  # pod -> cumulative save blocking
    _resumed: bool = False
    _was_training: bool = False  # the previous observation found the plan in force training

    @classmethod
    def resume(cls, created: float, saved: Goodput | None) -> GoodputLedger:
        """A ledger that continues from a status written by an earlier operator process; the time
        since that status was written is unobserved."""
        ledger = cls(created)
        if saved is None:
            return ledger
        ledger._resumed = True
        lost = saved.lost_seconds
        ledger.productive = saved.productive_seconds
        ledger.detection = lost.detection
        ledger.reconfiguration = lost.reconfiguration
        ledger.redone_steps = lost.redone_steps
        ledger.waiting_for_capacity = lost.waiting_for_capacity
        ledger.checkpoint_stalls = lost.checkpoint_stalls
        # The saved "other" was training time not in steps, or unobserved: both count as training here.
        ledger.training = saved.productive_seconds + lost.checkpoint_stalls + lost.detection + lost.redone_steps
        ledger.training += lost.other
        return ledger

    def observe(
        self,
        now: float,
        *,
        trained: bool,
        step: int | None,
        step_time: float | None,
        checkpoint_blocking: dict[str, float] | None = None,
    ) -> None:
        """File the time since the last observation; count new steps (or discarded ones).

        Args:
            trained: every member of the plan in force committed a step (the job trains).
            step: steps every member has completed (None when unknown).
            step_time: the duration of the latest step, as the slowest member measured it.
            checkpoint_blocking: per pod, the total time its workers were blocked starting saves.
        """
        if self._last is None:
            # Creation to the first observation: waiting for a fresh job; for one resumed from an
            # earlier process's status, the time since that status, which nobody observed.
            gap = max(0.0, now - self.created - self.total_observed())
            if self._resumed:
                self.unobserved += gap
            else:
                self.waiting_for_capacity += gap
        else:
            dt = max(0.0, now - self._last)
            if self._recovering_since is not None:
                self.reconfiguration += dt
            elif trained:
                self.training += dt
            else:
                self.waiting_for_capacity += dt
        self._last = now
        if step is not None:
            if self._step is not None and step < self._step:
                # Resumed from an older step: the steps after it were trained for nothing.
                redone = (self._step - step) * self._step_time
                self.productive -= redone
                self.redone_steps += redone
            elif self._step is not None and step > self._step and step_time is not None:
                new = step - self._step
                self.productive += new * step_time
                self._steps_counted += new
                self._step_time += (step_time - self._step_time) * new / self._steps_counted
            if self._step is None or step > self._step:
                self._last_progress = now
            self._step = step
        stall = 0.0
        for pod, total in (checkpoint_blocking or {}).items():
            before = self._blocking.get(pod)
            self._blocking[pod] = total
            if before is not None and total > before:
                stall = max(stall, total - before)  # every rank blocks at once: the longest counts
        self.checkpoint_stalls += stall
        # Only the steps counted on the job's way back to training ran while it was filed as waiting
        # or reconfiguring; steps counted while it trained all along ran in training time.
        self._rebalance(early=not self._was_training)
        self._was_training = trained and self._recovering_since is None

    def _rebalance(self, early: bool) -> None:
        """Steps (and stalls) counted beyond the training time filed so far: when ``early``, a plan's
        first steps, done before the last member's report made it 'trained', while the job was filed
        as waiting or reconfiguring; that time was training: move it over, so the parts add up.
        Otherwise, and for what is left, an over-count: the steps since the previous observation are
        counted at the slowest member's latest step time, which is noisy and biased up. A CI run
        whose steps were counted so moved all its waiting and reconfiguration into training; what is
        over is taken off the productive time, which never exceeds the time there was."""
        excess = self.productive + self.redone_steps + self.checkpoint_stalls + self.detection - self.training
        if early:
            for bucket in ("waiting_for_capacity", "reconfiguration"):
                if excess <= 0:
                    break
                take = min(excess, getattr(self, bucket))
                setattr(self, bucket, getattr(self, bucket) - take)
                self.training += take
                excess -= take
        if excess > 0:
            self.productive = max(0.0, self.productive - excess)

    def failure_declared(self, now: float) -> None:
        """A failure stopped training: the time since the last committed step was detection."""
        if self._recovering_since is not None:
            return  # part of the recovery already open
        self.observe(now, trained=True, step=None, step_time=None)
        if self._last_progress is not None:
            self.detection += min(now - self._last_progress, self.training_other())
        self._recovering_since = now

    def recovered(self, now: float, first_step_time: float | None) -> None:
        """Every member of the new plan committed a step; that step's time was training."""
        if self._recovering_since is None:
            return
        self.observe(now, trained=True, step=None, step_time=None)
        first = min(first_step_time or 0.0, self.reconfiguration)
        self.reconfiguration -= first
        self.training += first
        self._recovering_since = None

    def total_observed(self) -> float:
        return self.training + self.reconfiguration + self.waiting_for_capacity

    def training_other(self) -> float:
        """Training time not accounted for by steps, stalls or detection (never below zero)."""
        return max(0.0, self.training - self.productive - self.redone_steps - self.checkpoint_stalls - self.detection)

    def snapshot(self, now: float) -> Goodput:
        """The figures for the job's status and metrics."""
        wall = max(0.0, now - self.created)
        other = self.training_other() + self.unobserved
        if self._last is not None:
            other += max(0.0, now - self._last)  # since the last observation: not filed yet
        productive = max(0.0, self.productive)
        return Goodput(
            ratio=min(1.0, round(productive / wall, 4)) if wall > 0 else 0.0,
            wall_seconds=round(wall, 3),
            productive_seconds=round(productive, 3),
            lost_seconds=LostTime(
                detection=round(self.detection, 3),
                reconfiguration=round(self.reconfiguration, 3),
                redone_steps=round(self.redone_steps, 3),
                waiting_for_capacity=round(self.waiting_for_capacity, 3),
                checkpoint_stalls=round(self.checkpoint_stalls, 3),
                other=round(other, 3),
            ),
        )
