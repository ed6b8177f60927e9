"""When the operator keeps its hands off a job: a status it cannot trust.

The status is the operator's memory: the plan in force and its epoch (the commit point, see
controller.py). Two things make it untrustworthy, and both come from version skew or from a status
put back by hand (a restore from a backup):

- it cannot be read by this version: a newer operator wrote a value this one does not know (an
  enum value, a changed type; unknown fields are kept, see ``OpenWireModel``). Reading it as empty
  would plan epoch 1 for a running job;
- agents hold a newer epoch than it records. The commit point makes that impossible for a status
  this operator wrote (a plan is stored before any agent hears of it), so the status is behind the
  job. Agents refuse a plan that is not newer than theirs, so any plan made from it would never be
  taken, and failures would go unanswered while the operator believes them handled.

In both cases the operator plans nothing, pushes nothing, and neither deletes nor creates pods:
the job trains on by itself (agents need no operator between plans). It says so loudly (an error
in its log, a Warning event, ``ReconcilePaused=True``) and looks again every resync: it resumes
once the status is readable and not behind (the version that wrote it runs again, or a person
fixed it; deleting the job's pods also ends the second case, as their replacements hold no epoch).
Outbidding the agents with a higher epoch is not done: a plan made from a status that is behind
the job would name the wrong members and resume from the wrong step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from megatron_contract.job import Condition, ConditionType, MegatronJobStatus
from megatron_operator.status import Reason


@dataclasses.dataclass(frozen=True)
class Hold:
    """Why the operator does not act on a job: a condition reason and a message."""

    reason: str
    message: str


def read_status(raw: Any) -> tuple[MegatronJobStatus, Hold | None]:
    """The job's status; an empty one for a new job. A status that exists and cannot be read
    gives an empty one that must never be written, and a hold."""
    if not raw:
        return MegatronJobStatus(), None
    try:
        return MegatronJobStatus.model_validate(dict(raw) if isinstance(raw, Mapping) else raw), None
    except ValidationError as exc:
        details = "; ".join(
            f"status.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors(include_input=False)[:5]
        )
        message = (
            f"this operator version cannot read the job's status ({details}); it was likely written by a newer "
            "version. Nothing is planned, pushed, deleted or created until the status can be read: run the "
            "operator version that wrote it"
        )
        return MegatronJobStatus(), Hold(Reason.STATUS_UNREADABLE, message[:4000])


def behind_agents(epochs: Mapping[str, int], status_epoch: int) -> Hold | None:
    """A hold when some agent holds a newer epoch than the status records (``epochs``: by pod,
    from fresh reports and from refused pushes)."""
    ahead = {pod: epoch for pod, epoch in epochs.items() if epoch > status_epoch}
    if not ahead:
        return None
    named = ", ".join(f"{pod} (epoch {epoch})" for pod, epoch in sorted(ahead.items())[:5])
    message = (
        f"the job's status records epoch {status_epoch} but {len(ahead)} agents hold a newer one: {named}. The "
        "status is behind the job (restored from a backup, or written by another operator version); a plan made "
        "from it would be refused. Nothing is planned, pushed, deleted or created until the status records "
        "their epoch or those pods are gone"
    )
    return Hold(Reason.STATUS_BEHIND_AGENTS, message)


def paused_conditions(
    raw_status: Any, hold: Hold, now: datetime, generation: int | None
) -> list[dict[str, Any]] | None:
    """The status's conditions as stored, with ``ReconcilePaused=True`` saying why; None when they
    already say so, or when they are not a list of objects (then they are left alone)."""
    conditions = raw_status.get("conditions", []) if isinstance(raw_status, Mapping) else None
    if not isinstance(conditions, list) or not all(isinstance(c, Mapping) for c in conditions):
        return None
    kind = ConditionType.RECONCILE_PAUSED.value
    old = next((c for c in conditions if c.get("type") == kind), None)
    held = old is not None and old.get("status") == "True"
    if held and old is not None and (old.get("reason"), old.get("message")) == (hold.reason, hold.message):
        return None
    new = Condition(
        type=kind,
        status="True",
        reason=hold.reason,
        message=hold.message,
        last_transition_time=(old.get("lastTransitionTime") if held and old is not None else None) or now,
        observed_generation=generation,
    ).to_wire()
    if old is None:
        return [*conditions, new]
    return [new if c is old else dict(c) for c in conditions]
