"""The committed CRD (crds/ and the chart's copy) is exactly what the models generate, and the
generated schema is structural: no $ref, no anyOf, a status subresource, printer columns, and the
CEL rules of SPEC_RULES."""

from __future__ import annotations

import json

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
