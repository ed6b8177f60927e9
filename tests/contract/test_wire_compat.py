"""Version skew in the contract: what one version does with what another version wrote.

Scenarios: a status carrying fields this version does not know (at its top, in its plan, a plan
member, a condition, goodput) parses and writes them back unchanged; so does a plan on its own (an
agent older than the operator) and an agent report (an agent newer than the operator), while
their invariants are still checked; the spec stays strict (a typo is refused), and the lenient
read of the operator and the agents drops the unknown spec fields, names them, and still refuses a
spec that is invalid for another reason; the CRD keeps unknown status fields (an older CRD left
in place under a newer operator) and still prunes unknown spec fields.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from test_mesh_plan import make_plan

from megatron_contract import AgentReport, MegatronJobSpec, MegatronJobStatus, MeshPlan
from megatron_contract.compat import validate_ignoring_unknown
from megatron_contract.crd import build_crd

SPEC: dict[str, Any] = {"image": "trainer:1", "replicas": 2, "checkpoint": {"path": "/ckpt"}}


def _status_from_a_newer_operator() -> dict[str, Any]:
    plan = make_plan(placementHint={"rack": "r1"})
    plan["members"][0]["weight"] = 3  # type: ignore[index]
    return {
        "phase": "Running",
        "epoch": 2,
        "plan": plan,
        "migration": {"state": "idle"},
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Training",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
                "severity": "Info",
            },
        ],
        "goodput": {"ratio": 0.5, "wallSeconds": 10, "productiveSeconds": 5, "lostSeconds": {"preemption": 1.0}},
    }


def test_status_keeps_what_a_newer_operator_wrote_and_writes_it_back() -> None:
    raw = _status_from_a_newer_operator()
    status = MegatronJobStatus.model_validate(raw)
    assert status.epoch == 2 and status.plan is not None and status.plan.epoch == 2
    assert status.model_extra == {"migration": {"state": "idle"}}
    wire = status.to_wire()
    assert wire["migration"] == {"state": "idle"}
    assert wire["plan"]["placementHint"] == {"rack": "r1"} and wire["plan"]["members"][0]["weight"] == 3
    assert wire["conditions"][0]["severity"] == "Info"
    assert wire["goodput"]["lostSeconds"]["preemption"] == 1.0
    assert MegatronJobStatus.model_validate(wire) == status


def test_plan_and_report_keep_unknown_fields_and_are_still_checked() -> None:
    plan = MeshPlan.model_validate(make_plan(placementHint="r1"))
    assert plan.to_wire()["placementHint"] == "r1"
    with pytest.raises(ValidationError, match="spans pods"):
        MeshPlan.model_validate(
            make_plan(
                placementHint="r1",
                members=[{"pod": "a", "address": "x", "ranks": [0, 2]}, {"pod": "b", "address": "y", "ranks": [1, 3]}],
            )
        )
    report = AgentReport.model_validate(
        {
            "jobUid": "u",
            "pod": "p0",
            "epoch": 3,
            "state": "training",
            "gpuTemperature": 71,
            "workers": [{"localRank": 0, "memoryBytes": 5}],
        }
    )
    assert report.epoch == 3 and report.to_wire()["gpuTemperature"] == 71
    assert report.to_wire()["workers"][0]["memoryBytes"] == 5
    with pytest.raises(ValidationError):
        AgentReport.model_validate({"jobUid": "u", "pod": "p0", "epoch": -1, "state": "training", "x": 1})


def test_the_spec_stays_strict_and_the_lenient_read_names_what_it_drops() -> None:
    newer = {
        **SPEC,
        "futureKnob": 3,
        "model": {"numLayers": 4, "expertParallel": 2},
        "checkpoint": {"path": "/ckpt", "format": "v2"},
        "tolerations": [{"key": "gpu", "operator": "Exists"}],
        "env": [{"name": "A", "value": "1", "secretHint": True}],
    }
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        MegatronJobSpec.model_validate(newer)
    spec, ignored = validate_ignoring_unknown(MegatronJobSpec, newer)
    assert ignored == [
        "spec.checkpoint.format",
        "spec.env.0.secretHint",
        "spec.futureKnob",
        "spec.model.expertParallel",
    ]
    assert spec.model.num_layers == 4 and spec.checkpoint is not None and spec.checkpoint.path == "/ckpt"
    assert spec == MegatronJobSpec.model_validate(
        {**SPEC, "model": {"numLayers": 4}, "tolerations": newer["tolerations"], "env": [{"name": "A", "value": "1"}]}
    )
    assert "futureKnob" in newer  # the caller's data is left as it was
    assert validate_ignoring_unknown(MegatronJobSpec, SPEC)[1] == []


def test_the_lenient_read_still_refuses_an_invalid_spec() -> None:
    with pytest.raises(ValidationError) as info:
        validate_ignoring_unknown(MegatronJobSpec, {**SPEC, "futureKnob": 1, "replicas": 0})
    assert "replicas" in str(info.value) and "futureKnob" not in str(info.value)


def test_the_crd_keeps_unknown_status_fields_and_prunes_unknown_spec_fields() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    status, spec = schema["status"], schema["spec"]

    def objects(node: dict[str, Any]) -> list[dict[str, Any]]:
        found = [node] if node.get("type") == "object" and "properties" in node else []
        for sub in node.get("properties", {}).values():
            found += objects(sub)
        if "items" in node:
            found += objects(node["items"])
        return found

    assert all(o.get("x-kubernetes-preserve-unknown-fields") for o in objects(status))
    assert len(objects(status)) >= 10  # status, plan and its parts, conditions, lastFailure, goodput
    for name in ("model", "training", "checkpoint", "failureDetection"):
        assert not spec["properties"][name].get("x-kubernetes-preserve-unknown-fields"), name
    assert not spec.get("x-kubernetes-preserve-unknown-fields")
