"""Prometheus metrics of the operator (served when MEGATRON_OPERATOR_METRICS_PORT is set)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

JOB_LABELS = ("namespace", "job")

FAILURES = Counter("megatron_operator_pod_failures_total", "Pods declared failed, by reason.", [*JOB_LABELS, "reason"])
PLANS = Counter("megatron_operator_plans_total", "Plans made, by reason.", [*JOB_LABELS, "reason"])
RECOVERY_SECONDS = Histogram(
    "megatron_operator_recovery_seconds",
    "Failure detected to the first training step committed by every member of the new plan.",
    JOB_LABELS,
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
PUSH_SECONDS = Histogram(
    "megatron_operator_plan_push_seconds",
    "Time to push one plan to all members that were due.",
    JOB_LABELS,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5),
)
EPOCH = Gauge("megatron_operator_plan_epoch", "Epoch of the plan in force.", JOB_LABELS)
DP = Gauge("megatron_operator_mesh_dp", "Data-parallel size of the plan in force.", JOB_LABELS)
SPARES_READY = Gauge("megatron_operator_spares_ready", "Hot spares running whose workers are warm.", JOB_LABELS)
READY_WORKERS = Gauge("megatron_operator_ready_workers", "Members of the plan running.", JOB_LABELS)
PHASE = Gauge("megatron_operator_job_phase", "1 for the job's current phase.", [*JOB_LABELS, "phase"])
REPORTS = Counter("megatron_operator_agent_reports_total", "Agent reports received.", JOB_LABELS)
ACCUSATIONS_IGNORED = Counter(
    "megatron_operator_peer_reports_ignored_total",
    "Failed-peer reports not acted on: implausible or not corroborated.",
    JOB_LABELS,
)
