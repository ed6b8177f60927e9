"""Prometheus metrics of the operator (served when MEGATRON_OPERATOR_METRICS_PORT is set).

A job's series carry ``megatronjob_namespace`` and ``megatronjob``, not ``namespace`` and ``job``:
Prometheus sets those two on every series from the scrape target (the operator's own namespace and
scrape job), which would overwrite ours. The chart's PodMonitor gives the trainer agents' series
the same two labels, so one selector picks a job's series from both sources.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from megatron_contract.job import Goodput, JobPhase, LostTime
from megatron_contract.mesh import PlanReason
from megatron_operator.failures import FailureReason

JOB_LABELS = ("megatronjob_namespace", "megatronjob")


def job_labels(namespace: str, name: str) -> dict[str, str]:
    """The label values that identify a MegatronJob's series."""
    return dict(zip(JOB_LABELS, (namespace, name), strict=True))


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
RECONCILE_SECONDS = Histogram(
    "megatron_operator_reconcile_seconds",
    "One reconcile pass of a job: observe, decide, act, write the status.",
    JOB_LABELS,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10),
)
EPOCH = Gauge("megatron_operator_plan_epoch", "Epoch of the plan in force.", JOB_LABELS)
DP = Gauge("megatron_operator_mesh_dp", "Data-parallel size of the plan in force.", JOB_LABELS)
SPARES_READY = Gauge("megatron_operator_spares_ready", "Hot spares running whose workers are warm.", JOB_LABELS)
READY_WORKERS = Gauge("megatron_operator_ready_workers", "Members of the plan running.", JOB_LABELS)
BUDDY_COPY_LAG = Gauge(
    "megatron_operator_buddy_copy_lag_steps",
    "Steps completed since the job's buddyCopyStep: about how many steps losing one pod now would redo, at"
    " worst (jobs with buddy copies of the distributed optimizer's shards, while every member holds one).",
    JOB_LABELS,
)
PHASE = Gauge("megatron_operator_job_phase", "1 for the job's current phase.", [*JOB_LABELS, "phase"])
REPORTS = Counter("megatron_operator_agent_reports_total", "Agent reports received.", JOB_LABELS)
ACCUSATIONS_IGNORED = Counter(
    "megatron_operator_peer_reports_ignored_total",
    "Failed-peer reports not acted on: implausible or not corroborated.",
    JOB_LABELS,
)

GOODPUT = Gauge(
    "megatron_operator_goodput_ratio",
    "Durations of the training steps kept over wall time since the job was created (effective training time ratio).",
    JOB_LABELS,
)
PRODUCTIVE_SECONDS = Gauge(
    "megatron_operator_productive_seconds", "Durations of the training steps kept, in total.", JOB_LABELS
)
LOST_SECONDS = Gauge(
    "megatron_operator_lost_seconds",
    "Wall time not spent on kept training steps, by cause (see docs/operations.md, Goodput).",
    [*JOB_LABELS, "cause"],
)
#: The causes of lost time, as the ``cause`` label spells them (the fields of LostTime).
LOST_CAUSES = tuple(LostTime.model_fields)

#: Series labelled by the job alone, and all of a job's series.
_JOB_ONLY = (
    RECOVERY_SECONDS,
    PUSH_SECONDS,
    RECONCILE_SECONDS,
    EPOCH,
    DP,
    SPARES_READY,
    READY_WORKERS,
    REPORTS,
    ACCUSATIONS_IGNORED,
    GOODPUT,
    PRODUCTIVE_SECONDS,
)
# Not created at zero with the others: a job without buddy copies has no such series.
_PER_JOB = (*_JOB_ONLY, BUDDY_COPY_LAG, FAILURES, PLANS, PHASE, LOST_SECONDS)


def start_job(namespace: str, name: str) -> None:
    """Create a job's series at zero for every known label value, so rates, panels and alerts see
    them before the first event (a counter with labels has no series until its first increment)."""
    labels = job_labels(namespace, name)
    for reason in FailureReason:
        FAILURES.labels(**labels, reason=reason.value)
    for plan_reason in PlanReason:
        PLANS.labels(**labels, reason=plan_reason.value)
    for phase in JobPhase:
        PHASE.labels(**labels, phase=phase.value)
    for cause in LOST_CAUSES:
        LOST_SECONDS.labels(**labels, cause=cause)
    for metric in _JOB_ONLY:
        metric.labels(**labels)


def export_goodput(labels: dict[str, str], goodput: Goodput) -> None:
    """Set a job's goodput series from its ledger's figures."""
    GOODPUT.labels(**labels).set(goodput.ratio)
    PRODUCTIVE_SECONDS.labels(**labels).set(goodput.productive_seconds)
    for cause in LOST_CAUSES:
        LOST_SECONDS.labels(**labels, cause=cause).set(getattr(goodput.lost_seconds, cause))


def forget_job(namespace: str, name: str) -> None:
    """Drop every series of a job this replica no longer runs (deleted, or another replica leads)."""
    labels = job_labels(namespace, name)
    for metric in _PER_JOB:
        metric.remove_by_labels(labels)
