"""The committed CRD (crds/ and the chart's copy) is exactly what the models generate, and the
generated schema is structural: no $ref, no anyOf, a status subresource, printer columns, and the
CEL rules of SPEC_RULES."""

from __future__ import annotations

import json

import pytest

from megatron_contract import crd
from megatron_contract.job import SPEC_RULES


def test_committed_crd_matches_models() -> None:
    text = crd.render()
    for path in crd.OUTPUTS:
        assert path.exists(), f"{path} missing: run `make crds`"
        assert path.read_text() == text, f"{path} drifted from the models: run `make crds` and commit"


def test_check_mode_reports_drift(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    stale = tmp_path / "stale.yaml"
    stale.write_text("# old\n")
    monkeypatch.setattr(crd, "OUTPUTS", (stale,))
    monkeypatch.setattr(crd, "REPO_ROOT", tmp_path)
    assert crd.main(["--check"]) == 1
    assert crd.main(["--write"]) == 0
    assert crd.main(["--check"]) == 0


def test_schema_is_structural_and_complete() -> None:
    obj = crd.build_crd()
    version = obj["spec"]["versions"][0]
    dumped = json.dumps(version["schema"])
    assert "$ref" not in dumped and "anyOf" not in dumped and '"title"' not in dumped
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]][:5] == [
        "Phase",
        "Mesh",
        "Ready",
        "Spares",
        "Recoveries",
    ]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert rules == [r.cel for r in SPEC_RULES]
    assert spec["properties"]["tp"]["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    assert obj["spec"]["names"]["shortNames"] == ["mj", "mjob"]


def test_the_plans_members_are_kept_unchecked_and_the_rest_of_the_plan_checked() -> None:
    """Checking 4096 members against the schema was over half of each status write in the API
    server: they are kept as written (the plan keeps unknown fields); the plan's other fields stay typed."""
    status = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    plan = status["properties"]["plan"]
    assert plan["x-kubernetes-preserve-unknown-fields"] is True
    assert "members" not in plan["properties"] and "members" not in plan["required"]
    assert {"epoch", "sizes", "batch", "rendezvous", "resumeStep"} <= set(plan["properties"])


def test_a_field_whose_parent_prunes_cannot_be_left_unchecked() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    with pytest.raises(ValueError, match="prune"):
        crd._uncheck(schema, ("a", "b"))
