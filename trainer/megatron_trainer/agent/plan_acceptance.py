"""The checks a pushed ``MeshPlan`` must pass before the agent acts on it.

Pure functions of the request (headers, body) and what the agent holds, so each refusal is a
unit-testable value. Order matters: the token is checked before the body is even parsed, so an
unauthenticated client learns nothing about plan validation.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Mapping

from pydantic import ValidationError

from megatron_contract import wire
from megatron_contract.mesh import MeshPlan


@dataclasses.dataclass(frozen=True)
class PlanRejected(Exception):
    """Why a plan was refused, with the HTTP status that says so."""

    status: int
    reason: str

    def __str__(self) -> str:
        return f"{self.status}: {self.reason}"


def check_token(headers: Mapping[str, str], token: str) -> None:
    """Accept only ``Authorization: Bearer <the job's token>`` (constant-time compare).

    Raises:
        PlanRejected: 401 when the header is missing, malformed or carries another token.
    """
    header = headers.get(wire.AUTH_HEADER, "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != wire.AUTH_SCHEME.lower() or not presented:
        raise PlanRejected(401, f"missing {wire.AUTH_SCHEME} token")
    if not hmac.compare_digest(presented.strip().encode(), token.encode()):
        raise PlanRejected(401, "bad token")


def check_declared_size(content_length: int | None) -> None:
    """Refuse a body whose declared length is over the limit before reading it.

    Raises:
        PlanRejected: 413 over ``wire.MAX_BODY_BYTES``.
    """
    if content_length is not None and content_length > wire.MAX_BODY_BYTES:
        raise PlanRejected(413, f"body of {content_length} bytes exceeds {wire.MAX_BODY_BYTES}")


def parse_plan(body: bytes, *, job_uid: str, gpus_per_pod: int) -> MeshPlan:
    """Parse and validate a plan for this agent's job.

    Raises:
        PlanRejected: 413 when the body is over the limit, 400 when it is not a valid plan of this
            job with this pod's number of workers.
    """
    if len(body) > wire.MAX_BODY_BYTES:
        raise PlanRejected(413, f"body exceeds {wire.MAX_BODY_BYTES} bytes")
    if not body.strip():
        raise PlanRejected(400, "empty body: expected a MeshPlan as JSON")
    try:
        plan = MeshPlan.model_validate_json(body)
    except ValidationError as err:
        # One line per error, without echoing the (possibly huge) input back.
        details = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in err.errors(include_input=False)[:10]
        )
        raise PlanRejected(400, f"not a valid MeshPlan: {details}") from None
    if plan.job_uid != job_uid:
        raise PlanRejected(400, f"plan is for job {plan.job_uid}, this agent belongs to job {job_uid}")
    if plan.gpus_per_pod != gpus_per_pod:
        raise PlanRejected(400, f"plan has gpusPerPod {plan.gpus_per_pod}, this pod runs {gpus_per_pod} workers")
    return plan


def check_epoch(plan: MeshPlan, held_epoch: int) -> None:
    """Only a strictly newer epoch replaces the held plan.

    Raises:
        PlanRejected: 409 when ``plan.epoch <= held_epoch``.
    """
    if plan.epoch <= held_epoch:
        raise PlanRejected(409, f"plan epoch {plan.epoch} is not newer than the held epoch {held_epoch}")
