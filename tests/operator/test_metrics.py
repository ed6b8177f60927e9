"""The operator's per-job series: labelled by the MegatronJob (not `namespace`/`job`, which
Prometheus overwrites with the scrape target's), created at zero for every known label value when
a job's controller starts, and dropped when it stops."""

from __future__ import annotations

from prometheus_client import REGISTRY

from megatron_contract.job import JobPhase
from megatron_contract.mesh import PlanReason
from megatron_operator import metrics
from megatron_operator.failures import FailureReason


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"megatronjob_namespace": "team-a", "megatronjob": "llama", **labels})


def test_job_series_start_at_zero_and_are_forgotten() -> None:
    metrics.start_job("team-a", "llama")
    try:
        for reason in FailureReason:
            assert _value("megatron_operator_pod_failures_total", reason=reason.value) == 0
        for plan_reason in PlanReason:
            assert _value("megatron_operator_plans_total", reason=plan_reason.value) == 0
        for phase in JobPhase:
            assert _value("megatron_operator_job_phase", phase=phase.value) == 0
        assert _value("megatron_operator_recovery_seconds_count") == 0
        assert _value("megatron_operator_agent_reports_total") == 0
        metrics.PLANS.labels(**metrics.job_labels("team-a", "llama"), reason="replace").inc()
        assert _value("megatron_operator_plans_total", reason="replace") == 1
    finally:
        metrics.forget_job("team-a", "llama")
    assert _value("megatron_operator_plans_total", reason="replace") is None
    assert _value("megatron_operator_plan_epoch") is None


def test_forgetting_one_job_keeps_the_others() -> None:
    metrics.start_job("team-a", "llama")
    metrics.start_job("team-a", "gpt")
    try:
        metrics.forget_job("team-a", "llama")
        assert _value("megatron_operator_plan_epoch") is None
        other = {"megatronjob_namespace": "team-a", "megatronjob": "gpt"}
        assert REGISTRY.get_sample_value("megatron_operator_plan_epoch", other) == 0
    finally:
        metrics.forget_job("team-a", "gpt")
