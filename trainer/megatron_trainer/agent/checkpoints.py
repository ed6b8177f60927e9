"""What the pod knows of checkpoints from its workers' reports, for the heartbeat.

The newest complete save, the training time saves blocked, the last checkpoint a restore rejected
(or gave up on) and the outcome of the save a suspend plan asked for. Every local worker reports
the same save, so each update is idempotent across them.
"""

from __future__ import annotations

import dataclasses
import logging

from megatron_trainer.channel import CheckpointProblem, CheckpointSaved

log = logging.getLogger(__name__)

#: Saves whose blocking time is kept per step; older ones are summed (a worker may report late).
RECENT_SAVES = 4


@dataclasses.dataclass
class CheckpointRecord:
    """The checkpoint fields of the pod's report, as of the workers' last messages."""

    step: int | None = None  # newest complete checkpoint a local worker saved
    # Training time blocked starting saves: the longest local worker per save, for the newest saves
    # (step -> seconds; local workers report the same save one after another), and older ones summed.
    blocking: dict[int, float] = dataclasses.field(default_factory=dict)
    blocking_older: float = 0.0
    rejected: str | None = None  # the last checkpoint a restore rejected, and why
    unusable: str | None = None  # a restore that gave up (two rejections)
    # The checkpoint a suspend plan asked for: (epoch, step once complete, why it failed).
    suspend_outcome: tuple[int, int | None, str | None] | None = None

    def saved(self, message: CheckpointSaved, *, suspending: bool) -> bool:
        """Record a completed save; True when the operator should hear at once (a suspend's save)."""
        if message.blocking_seconds is not None:
            before = self.blocking.get(message.step, 0.0)
            self.blocking[message.step] = max(before, message.blocking_seconds)
            while len(self.blocking) > RECENT_SAVES:
                self.blocking_older += self.blocking.pop(min(self.blocking))
        if suspending:
            self.suspend_outcome = (message.epoch, message.step, None)
        # Complete for the whole world once any rank reports it (save ends with a barrier).
        if self.step is None or message.step > self.step:
            self.step = message.step
            log.info("checkpoint of step %d complete (epoch %d)", message.step, message.epoch)
        return suspending  # the operator stops the pods on it

    def problem(self, message: CheckpointProblem, *, suspending: bool) -> bool:
        """Record a save or restore that went wrong; True when the operator should hear at once."""
        failed_suspend = message.kind == "failed" and suspending
        if failed_suspend:
            self.suspend_outcome = (message.epoch, None, f"step {message.step}: {message.detail}"[:1024])
        if message.kind == "rejected":
            self.rejected = f"step {message.step}: {message.detail}"[:1024]
        elif message.kind == "unusable":
            self.unusable = message.detail[:1024]
        return failed_suspend

    def blocking_seconds(self) -> float | None:
        """Training time all saves so far blocked; None before the first save reported it."""
        return self.blocking_older + sum(self.blocking.values()) if self.blocking else None

    def suspend_outcome_of(self, epoch: int) -> tuple[int, int | None, str | None] | None:
        """The suspend save's outcome when it belongs to ``epoch`` (an older one is stale)."""
        return self.suspend_outcome if self.suspend_outcome and self.suspend_outcome[0] == epoch else None
