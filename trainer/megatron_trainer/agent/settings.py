"""The agent's configuration, read from the environment in exactly one place.

The operator sets the ``wire.ENV_*`` variables on every trainer pod. The few variables below that
are not part of the operator contract are the agent's own knobs (ports for tests, the worker
command, the restart budget); each has a safe default.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from megatron_contract import wire
from megatron_contract.compat import validate_ignoring_unknown
from megatron_contract.job import MegatronJobSpec

log = logging.getLogger(__name__)

# Agent-local knobs (not set by the operator).
ENV_AGENT_PORT = "MEGATRON_AGENT_PORT"
ENV_RENDEZVOUS_PORT = "MEGATRON_RENDEZVOUS_PORT"
ENV_WORKER_COMMAND = "MEGATRON_WORKER_COMMAND"  # JSON list; the worker's argv before --channel-fd
ENV_WORKER_MAX_RESTARTS = "MEGATRON_WORKER_MAX_RESTARTS"
ENV_WORKER_HANG_TIMEOUT = "MEGATRON_WORKER_HANG_TIMEOUT_SECONDS"
ENV_SHUTDOWN_GRACE = "MEGATRON_SHUTDOWN_GRACE_SECONDS"
ENV_CHECKPOINT_SAVE_GRACE = "MEGATRON_CHECKPOINT_SAVE_GRACE_SECONDS"  # extra silence allowed for a save
ENV_HOST_RENDEZVOUS = "MEGATRON_HOST_RENDEZVOUS"  # "0" disables the store server (tests of one handler)

DEFAULT_WORKER_COMMAND = (sys.executable, "-m", "megatron_trainer.worker")
HANG_GRACE_MIN_SECONDS = 5.0
HANG_GRACE_FRACTION = 0.25


def hang_timeout_for(spec: MegatronJobSpec) -> float:
    """How long a training worker may stay silent before the agent kills it as hung.

    Past the collective timeout, plus a grace: a worker whose *peer* hangs times out at the
    collective timeout too, and then needs a moment to abort its groups and report; killing it
    at the same instant would turn one hung worker into several dead ones (seen on 2 CPU cores:
    the abort and report took over 0.5 s).
    """
    timeout = spec.failure_detection.collective_timeout_seconds
    return timeout + max(HANG_GRACE_MIN_SECONDS, HANG_GRACE_FRACTION * timeout)


class SettingsError(ValueError):
    """A missing or malformed environment variable; the message names it."""


class AgentSettings(BaseModel):
    """Everything the agent needs to know about its pod and job."""

    model_config = ConfigDict(frozen=True)

    job_name: str = ""
    namespace: str = ""
    job_uid: str = Field(min_length=1)
    token: str = Field(min_length=1, repr=False)
    pod_name: str = Field(min_length=1)
    pod_ip: str = Field(min_length=1, description="Address both the control port and the store bind to.")
    pod_role: str = wire.ROLE_WORKER
    operator_url: str | None = None
    spec: MegatronJobSpec
    spec_json: str = Field(repr=False, description="The spec exactly as received, passed on to workers.")
    gpus_per_pod: int = Field(ge=1, le=64)
    heartbeat_interval_seconds: float = Field(gt=0)
    agent_port: int = Field(ge=0, le=65535)
    rendezvous_port: int = Field(ge=0, le=65535)
    host_rendezvous: bool = True
    worker_command: tuple[str, ...] = Field(min_length=1)
    worker_max_restarts: int = Field(ge=0)
    hang_timeout_seconds: float = Field(gt=0)
    shutdown_grace_seconds: float = Field(gt=0)
    checkpoint_save_grace_seconds: float = Field(ge=0)

    @property
    def report_url(self) -> str | None:
        """Where heartbeats go, or None when no operator URL is configured."""
        if not self.operator_url:
            return None
        return self.operator_url.rstrip("/") + wire.OPERATOR_REPORT_PATH

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AgentSettings:
        """Read the settings from an environment mapping (``os.environ`` in production).

        Raises:
            SettingsError: naming the variable that is missing or malformed.
        """

        def required(name: str) -> str:
            value = env.get(name, "").strip()
            if not value:
                raise SettingsError(f"environment variable {name} is required")
            return value

        def number(name: str, default: float, kind: type[int] | type[float]) -> float:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                return kind(raw)
            except ValueError:
                raise SettingsError(f"{name}={raw!r} is not a valid {kind.__name__}") from None

        spec_json = required(wire.ENV_JOB_SPEC)
        try:
            # An operator newer than this image may send fields it does not know: not fatal.
            spec, ignored = validate_ignoring_unknown(MegatronJobSpec, json.loads(spec_json))
        except (ValidationError, ValueError) as err:
            raise SettingsError(f"{wire.ENV_JOB_SPEC} is not a valid MegatronJobSpec: {err}") from None
        if ignored:
            log.warning("this trainer version does not know %s (set by a newer operator): ignored", ", ".join(ignored))

        command: tuple[str, ...] = DEFAULT_WORKER_COMMAND
        raw_command = env.get(ENV_WORKER_COMMAND, "").strip()
        if raw_command:
            try:
                parsed = json.loads(raw_command)
            except json.JSONDecodeError:
                parsed = None
            if not (isinstance(parsed, list) and parsed and all(isinstance(a, str) for a in parsed)):
                raise SettingsError(f"{ENV_WORKER_COMMAND} must be a JSON list of strings, got {raw_command!r}")
            command = tuple(parsed)

        try:
            return cls(
                job_name=env.get(wire.ENV_JOB_NAME, ""),
                namespace=env.get(wire.ENV_JOB_NAMESPACE, ""),
                job_uid=required(wire.ENV_JOB_UID),
                token=required(wire.ENV_JOB_TOKEN),
                pod_name=required(wire.ENV_POD_NAME),
                pod_ip=env.get(wire.ENV_POD_IP, "").strip() or "0.0.0.0",
                pod_role=env.get(wire.ENV_POD_ROLE, "").strip() or wire.ROLE_WORKER,
                operator_url=env.get(wire.ENV_OPERATOR_URL, "").strip() or None,
                spec=spec,
                spec_json=spec_json,
                gpus_per_pod=int(number(wire.ENV_GPUS_PER_POD, spec.gpus_per_pod, int)),
                heartbeat_interval_seconds=number(
                    wire.ENV_HEARTBEAT_INTERVAL, spec.failure_detection.heartbeat_interval_seconds, float
                ),
                agent_port=int(number(ENV_AGENT_PORT, wire.AGENT_PORT, int)),
                rendezvous_port=int(number(ENV_RENDEZVOUS_PORT, wire.RENDEZVOUS_PORT, int)),
                host_rendezvous=env.get(ENV_HOST_RENDEZVOUS, "1").strip() != "0",
                worker_command=command,
                worker_max_restarts=int(number(ENV_WORKER_MAX_RESTARTS, 0, int)),
                hang_timeout_seconds=number(ENV_WORKER_HANG_TIMEOUT, hang_timeout_for(spec), float),
                shutdown_grace_seconds=number(ENV_SHUTDOWN_GRACE, 10.0, float),
                checkpoint_save_grace_seconds=number(ENV_CHECKPOINT_SAVE_GRACE, 600.0, float),
            )
        except ValidationError as err:
            raise SettingsError(f"invalid agent settings: {err}") from None
