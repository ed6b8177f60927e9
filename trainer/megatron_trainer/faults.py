"""Fault injection for tests and benchmarks: named faults, fired inside a worker at a given
(epoch, rank, step) and injection point: mid-step by default (after the forward pass of the step's
first micro-batch, so the step's collectives are in flight on the other ranks), or while the step's
data is read, or after the step's collectives but before this rank's optimizer update, or when the
checkpoint saver runs after the step (:class:`InjectionPoint`).

Build a plan fluently and hand it to workers through the environment::

    faults = FaultPlan().fail_at(rank=1, step=3, fault=Fault.SIGKILL)
    slow = FaultPlan().fail_at(rank=2, step=4, fault=Fault.DELAY, seconds=4, point=InjectionPoint.DATA_READ)
    env[ENV_FAULTS] = faults.to_env()

The worker calls :meth:`FaultPlan.maybe_fire` at its injection point. Each firing appends one JSON
line (fault, epoch, rank, step, pid, unix time) to the file named by ``ENV_FAULT_LOG`` first, so a
benchmark knows when the fault happened.
"""

from __future__ import annotations

import enum
import json
import os
import signal
import time

from pydantic import BaseModel, Field, TypeAdapter

ENV_FAULTS = "MEGATRON_WORKER_FAULTS"
ENV_FAULT_LOG = "MEGATRON_WORKER_FAULT_LOG"


class Fault(enum.StrEnum):
    """What happens to the worker."""

    SIGKILL = "sigkill"  # the process dies at once (a crashed GPU/pod)
    SIGSTOP = "sigstop"  # the process stops (a hang); its supervisor must kill it
    EXCEPTION = "exception"  # the training step raises InjectedFault
    DELAY = "delay"  # the worker sleeps FaultSpec.seconds (a slow step, data read or save; not a failure)


class InjectionPoint(enum.StrEnum):
    """Where in a step a fault fires."""

    MID_STEP = "midStep"  # after the first micro-batch's forward pass
    DATA_READ = "dataRead"  # while the step's samples are read, before any collective of the step
    # After every collective of the step (gradients reduced, loss and grad norm known), before this
    # rank's optimizer update: a DELAY past the step limit makes the watchdog abort the step here
    # while its peers commit it, so survivors of one DP group disagree by a step.
    BEFORE_UPDATE = "beforeUpdate"
    CHECKPOINT = "checkpoint"  # at the end of the checkpoint saver's work after the step, past its collectives


class InjectedFault(RuntimeError):
    """Raised by :attr:`Fault.EXCEPTION`."""


class FaultSpec(BaseModel):
    """One fault: fire ``fault`` on global ``rank`` during ``step`` of ``epoch``."""

    fault: Fault
    rank: int = Field(ge=0)
    step: int = Field(ge=0, description="The step in progress (0-based): fires before it completes.")
    epoch: int = Field(default=1, ge=1, description="Only in this epoch, so a rank's successor is spared.")
    point: InjectionPoint = InjectionPoint.MID_STEP
    seconds: float = Field(default=0.0, ge=0, description="How long a DELAY sleeps.")


_SPECS: TypeAdapter[list[FaultSpec]] = TypeAdapter(list[FaultSpec])


class FaultPlan:
    """An ordered set of faults; empty means no injection."""

    def __init__(self, specs: list[FaultSpec] | None = None) -> None:
        self.specs: list[FaultSpec] = list(specs or [])

    def fail_at(
        self,
        rank: int,
        step: int,
        fault: Fault = Fault.SIGKILL,
        epoch: int = 1,
        point: InjectionPoint = InjectionPoint.MID_STEP,
        seconds: float = 0.0,
    ) -> FaultPlan:
        """Add a fault; returns ``self`` so calls chain."""
        self.specs.append(FaultSpec(fault=fault, rank=rank, step=step, epoch=epoch, point=point, seconds=seconds))
        return self

    def to_env(self) -> str:
        """The plan as the value of ``ENV_FAULTS``."""
        return _SPECS.dump_json(self.specs).decode()

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> FaultPlan:
        """The plan in ``ENV_FAULTS`` (empty when unset); a malformed value raises ValueError."""
        raw = (environ if environ is not None else os.environ).get(ENV_FAULTS, "").strip()
        if not raw:
            return cls()
        try:
            return cls(_SPECS.validate_json(raw))
        except ValueError as err:
            raise ValueError(f"{ENV_FAULTS} is not a JSON list of faults: {err}") from err

    def due(
        self, epoch: int, rank: int, step: int, point: InjectionPoint = InjectionPoint.MID_STEP
    ) -> FaultSpec | None:
        """The fault planned for this point, if any."""
        return next((s for s in self.specs if (s.epoch, s.rank, s.step, s.point) == (epoch, rank, step, point)), None)

    def maybe_fire(self, epoch: int, rank: int, step: int, point: InjectionPoint = InjectionPoint.MID_STEP) -> None:
        """Fire the fault planned for this point; returns only when none is due (or after SIGCONT, or
        after a DELAY's sleep)."""
        spec = self.due(epoch, rank, step, point)
        if spec is None:
            return
        log_path = os.environ.get(ENV_FAULT_LOG)
        if log_path:
            record = {**spec.model_dump(mode="json"), "pid": os.getpid(), "time": time.time()}
            with open(log_path, "a", encoding="utf-8") as log:
                log.write(json.dumps(record) + "\n")
        if spec.fault is Fault.SIGKILL:
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.fault is Fault.SIGSTOP:
            os.kill(os.getpid(), signal.SIGSTOP)
        elif spec.fault is Fault.DELAY:
            time.sleep(spec.seconds)
        else:
            raise InjectedFault(f"injected fault at epoch {epoch} rank {rank} step {step}")


def inject_into(pid: int, fault: Fault) -> float:
    """Fire a signal fault into another process (a benchmark's random-time fault); returns the
    unix time just before the signal was sent."""
    signals = {Fault.SIGKILL: signal.SIGKILL, Fault.SIGSTOP: signal.SIGSTOP}
    if fault not in signals:
        raise ValueError(f"{fault.value} cannot be sent to another process; use fail_at")
    at = time.time()
    os.kill(pid, signals[fault])
    return at
