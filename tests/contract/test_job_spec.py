"""MegatronJobSpec in Python: the committed examples parse (the Llama one through its preset, the
production one with its pod template kept as given), a template that clashes with nothing parses,
a mixture-of-experts job with expert parallelism (and its example) parses (the default ep 1 for every other job),
every bad job of ``BAD_JOBS`` is refused naming its field (bad names by the whole MegatronJob),
quantities and GPUs equal to gpusPerPod parse (the same list the API-server test applies),
derived sizes are right, and the status model round-trips through its wire form."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from megatron_contract import MegatronJob, MegatronJobSpec, MegatronJobStatus
from megatron_contract.job import Condition, JobPhase
from megatronjob_builders import (
    BAD_JOBS,
    GOOD_RESOURCES,
    GOOD_TEMPLATE,
    LLAMA_EXAMPLE,
    LONGEST_NAME,
    MOE_EXAMPLE,
    MOE_TP2,
    PRODUCTION_EXAMPLE,
    BadJob,
    example_job,
    with_spec,
)


def test_example_parses_with_defaults_filled() -> None:
    job = MegatronJob.model_validate(example_job())
    assert job.spec.tp == 2 and job.spec.replicas == 4 and job.spec.spares == 1
    assert job.spec.cp == 1  # defaulted
    assert job.spec.worker_pods == 4
    assert job.spec.failure_detection.heartbeat_timeout_seconds == 10


def test_expert_parallel_job_parses() -> None:
    spec = MegatronJob.model_validate(with_spec(example_job(), ep=2, **MOE_TP2)).spec
    assert (spec.ep, spec.model.num_experts, spec.model.moe_router_topk) == (2, 8, 2)
    assert spec.model.moe_token_dispatcher_type == "alltoall" and spec.model.moe_aux_loss_coeff == 0.0
    assert MegatronJob.model_validate(example_job()).spec.ep == 1
    moe = MegatronJob.model_validate(example_job("moe", MOE_EXAMPLE)).spec
    assert (moe.ep, moe.model.num_experts, moe.model.moe_router_topk, moe.replicas_per_pod) == (8, 64, 8, 8)


def test_llama_example_resolves_its_preset_with_overrides() -> None:
    spec = MegatronJob.model_validate(example_job("llama", LLAMA_EXAMPLE)).spec
    m = spec.model
    assert (m.num_layers, m.hidden_size, m.query_groups, m.ffn_size, m.vocab_size) == (32, 4096, 8, 14336, 128256)
    assert m.seq_length == 4096 and m.sequence_parallel  # given next to the preset
    assert spec.training.lr_schedule.decay_style == "cosine" and spec.training.optimizer.weight_decay == 0.1


def test_production_example_keeps_its_pod_template_as_given() -> None:
    job = example_job("llama3-8b", PRODUCTION_EXAMPLE)
    spec = MegatronJob.model_validate(job).spec
    assert spec.template is not None and spec.to_wire()["template"] == job["spec"]["template"]
    trainer = spec.template.trainer()
    assert (
        trainer is not None
        and trainer.resources is not None
        and trainer.resources.limits == {"memory": "1600Gi", "rdma/ib": 1}
    )
    assert spec.failure_domain.topology_key == "example.com/rack" and spec.shm_size == "64Gi"


@pytest.mark.parametrize("bad", BAD_JOBS, ids=lambda b: b.name)
def test_bad_spec_is_refused_naming_the_field(bad: BadJob) -> None:
    job = bad.job()
    with pytest.raises(ValidationError) as info:
        if bad.job_name is not None:  # the name is checked on the whole job
            MegatronJob.model_validate(job)
        else:
            MegatronJobSpec.model_validate(job["spec"])
    locs = {".".join(str(p) for p in e["loc"]) for e in info.value.errors()}
    field = bad.expect.removeprefix("spec.")
    # A union (int or quantity string) names its member after the field: resources.requests.cpu.int.
    named = field in locs or any(loc.startswith(field + ".") for loc in locs)
    assert bad.expect in str(info.value) or named, f"{bad.name}: {info.value}"


def test_a_template_that_clashes_with_nothing_parses() -> None:
    spec = MegatronJob.model_validate(with_spec(example_job(), **GOOD_TEMPLATE)).spec
    assert spec.template is not None and spec.template.spec is not None
    assert spec.to_wire()["template"]["spec"]["priorityClassName"] == "training-high"


def test_quantities_and_matching_gpus_parse() -> None:
    job = MegatronJob.model_validate(with_spec(example_job(LONGEST_NAME), resources=GOOD_RESOURCES))
    assert job.spec.resources.requests["cpu"] == "500m" and job.spec.resources.limits["cpu"] == 4


@pytest.mark.parametrize(
    ("tp", "pp", "cp", "gpus", "replicas", "pods", "pods_per_replica", "replicas_per_pod"),
    [
        (2, 1, 1, 2, 4, 4, 1, 1),  # a replica per pod
        (2, 2, 1, 2, 3, 6, 2, 1),  # a replica over two pods
        (1, 1, 1, 4, 8, 2, 1, 4),  # four replicas in a pod
        (4, 2, 2, 8, 2, 4, 2, 1),  # cp too
    ],
)
def test_pod_geometry(
    tp: int, pp: int, cp: int, gpus: int, replicas: int, pods: int, pods_per_replica: int, replicas_per_pod: int
) -> None:
    spec = MegatronJobSpec(
        image="i",
        tp=tp,
        pp=pp,
        cp=cp,
        gpus_per_pod=gpus,
        replicas=replicas,
        min_replicas=replicas,
        model={"num_layers": 4, "num_attention_heads": 4, "hidden_size": 64},
    )
    assert (spec.worker_pods, spec.pods_per_replica, spec.replicas_per_pod) == (
        pods,
        pods_per_replica,
        replicas_per_pod,
    )


def test_status_round_trips_through_wire_form() -> None:
    now = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)
    status = MegatronJobStatus(
        phase=JobPhase.RECOVERING,
        epoch=3,
        recoveries=2,
        ready="7/8",
        mesh="4x2x1",
        conditions=[Condition(type="Recovering", status="True", reason="PodFailed", last_transition_time=now)],
    )
    wire = status.to_wire()
    assert wire["conditions"][0]["lastTransitionTime"].startswith("2026-11-21T12:00:00")
    assert MegatronJobStatus.model_validate(wire) == status


def test_condition_reason_must_be_a_camel_case_word() -> None:
    with pytest.raises(ValidationError):
        Condition(type="Ready", status="True", reason="not a reason", last_transition_time=datetime.now(UTC))
