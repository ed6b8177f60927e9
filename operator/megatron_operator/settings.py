"""The operator's configuration: one pydantic-settings class, read from the environment.

Environment variable names are the constants below; the Helm chart's values map onto them.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from megatron_contract.wire import OPERATOR_REPORT_PORT

ENV_PREFIX = "MEGATRON_OPERATOR_"
ENV_NAMESPACES = f"{ENV_PREFIX}NAMESPACES"
ENV_OPERATOR_URL = f"{ENV_PREFIX}URL"
ENV_REPORT_HOST = f"{ENV_PREFIX}REPORT_HOST"
ENV_REPORT_PORT = f"{ENV_PREFIX}REPORT_PORT"
ENV_LEADER_ELECTION = f"{ENV_PREFIX}LEADER_ELECTION"
ENV_LEASE_NAME = f"{ENV_PREFIX}LEASE_NAME"
ENV_LEASE_NAMESPACE = f"{ENV_PREFIX}LEASE_NAMESPACE"
ENV_LEASE_SECONDS = f"{ENV_PREFIX}LEASE_SECONDS"
ENV_IDENTITY = f"{ENV_PREFIX}IDENTITY"
ENV_RESYNC_SECONDS = f"{ENV_PREFIX}RESYNC_SECONDS"
ENV_PUSH_TIMEOUT = f"{ENV_PREFIX}PUSH_TIMEOUT_SECONDS"
ENV_PUSH_PROCESSES = f"{ENV_PREFIX}PUSH_PROCESSES"
ENV_PUSH_PROCESS_MIN_MEMBERS = f"{ENV_PREFIX}PUSH_PROCESS_MIN_MEMBERS"
ENV_METRICS_PORT = f"{ENV_PREFIX}METRICS_PORT"
ENV_HEALTH_PORT = f"{ENV_PREFIX}HEALTH_PORT"
ENV_FULL_MESH_WAIT = f"{ENV_PREFIX}FULL_MESH_WAIT_SECONDS"
ENV_CRASH_AT = f"{ENV_PREFIX}CRASH_AT"
ENV_TOKEN_KEY_FILE = f"{ENV_PREFIX}TOKEN_KEY_FILE"
ENV_CHILDREN_CHECK_SECONDS = f"{ENV_PREFIX}CHILDREN_CHECK_SECONDS"
ENV_DISRUPTION_BUDGETS = f"{ENV_PREFIX}DISRUPTION_BUDGETS"
ENV_KUBECONFIG = "KUBECONFIG"


#: The cyclic garbage collector's thresholds (Python's: 700, 10, 10). The operator of a 4096-pod
#: job holds a large heap (pod bodies, plans), and every full collection walks all of it: at
#: Python's thresholds 36 % of its CPU went to collections, a full one every ~2 s taking up to
#: 0.78 s with the event loop stopped. Most objects die by reference count; a collection now comes
#: every 50,000 allocations net, a full one after 100 of the middle generation's (and, as ever,
#: only when the objects that survived since the last grew by a quarter).
GC_THRESHOLDS = (50_000, 20, 100)


class OperatorSettings(BaseSettings):
    """Everything the operator process can be told, with the defaults of a production install."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    namespaces: str = Field(default="", description="Comma-separated namespaces to watch; all when empty.")
    url: str = Field(
        default=f"http://megatron-operator.megatron-system.svc:{OPERATOR_REPORT_PORT}",
        description="URL at which trainer agents reach the operator's report endpoint.",
    )
    report_host: str = Field(default="0.0.0.0", description="Address the report and liveness endpoints bind.")
    report_port: int = Field(default=OPERATOR_REPORT_PORT, ge=0, le=65535, description="Report endpoint port.")
    leader_election: bool = Field(default=True, description="Act only while holding the Lease.")
    lease_name: str = Field(default="megatron-operator", description="Name of the leader-election Lease.")
    lease_namespace: str = Field(default="default", description="Namespace of the leader-election Lease.")
    lease_seconds: float = Field(default=15.0, gt=1, description="Lease duration; a standby takes over after it.")
    identity: str | None = Field(default=None, description="This replica's identity (hostname and pid if unset).")
    resync_seconds: float = Field(default=5.0, gt=0, description="Longest time a job goes without a reconcile.")
    push_timeout_seconds: float = Field(default=5.0, gt=0, description="Timeout of one plan push to one agent.")
    push_processes: int | None = Field(
        default=None,
        ge=0,
        description="Processes that push a plan of at least push_process_min_members members, a share of the "
        "agents each (a push costs ~70 us of CPU per member); 0: the operator's own process pushes every plan. "
        "Unset: a quarter of the CPUs the operator may run on, at most 4 (none below 4 CPUs, where they would "
        "only compete with the operator for the cores).",
    )
    push_process_min_members: int = Field(
        default=1024, ge=1, description="The fewest members of a plan pushed through the push processes."
    )
    metrics_port: int | None = Field(default=None, ge=0, le=65535, description="Prometheus port; off when unset.")
    health_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Port of the liveness endpoint (GET /healthz, answered by the event loop; served from "
        "before leader election, so standbys answer too); off when unset.",
    )
    full_mesh_wait_seconds: float = Field(
        default=600.0,
        ge=0,
        description="How long a new job waits for all its worker pods; then it starts with the pods that run "
        "(at least minReplicas) and grows as the rest arrive.",
    )
    token_key_file: Path | None = Field(
        default=None,
        description="File holding the key (at least 32 bytes) from which each job's token is derived "
        "(HMAC-SHA256 of the job's UID); the chart mounts it from a Secret in the operator's namespace. "
        "Required: the operator refuses to start without it.",
    )
    children_check_seconds: float = Field(
        default=15.0,
        gt=0,
        description="How often each job's token Secret is re-applied (recreated when deleted). The operator "
        "cannot watch Secrets (it may not read them); it also re-applies the Secret before creating pods and "
        "when a pod cannot start for want of it, and recreates the Service as soon as it sees it deleted.",
    )
    disruption_budgets: bool = Field(
        default=True,
        description="Give each job a PodDisruptionBudget over its worker pods, so that no voluntary eviction "
        "(a node drain) takes a worker behind the operator's back: the operator moves a worker's ranks off a "
        "cordoned node itself, at a step boundary, then deletes the pod, and the drain ends. Without budgets an "
        "evicted worker is lost like a failed one.",
    )
    crash_at: str | None = Field(
        default=None,
        description="Fault injection for tests: SIGKILL the operator itself at this recovery point "
        "(plan-stored, plan-pushed, pods-created).",
    )

    @property
    def namespace_list(self) -> list[str]:
        """The watched namespaces; empty means cluster-wide."""
        return [n.strip() for n in self.namespaces.split(",") if n.strip()]
