"""docs/api.md is exactly what the models generate (``make docs``), ``--check`` reports drift, every
field of the spec and status (nested objects included) has its row, and a field added to a nested
model shows up with its alias, type, default, constraints and description without touching the
generator."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from megatron_contract import docs
from megatron_contract.base import WireModel
from megatron_contract.job import MegatronJobSpec


def test_committed_api_docs_match_models() -> None:
    assert docs.OUTPUT.exists(), f"{docs.OUTPUT} missing: run `make docs`"
    assert docs.OUTPUT.read_text() == docs.render(), "docs/api.md drifted from the models: run `make docs` and commit"


def test_check_mode_reports_drift(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(docs, "OUTPUT", tmp_path / "docs" / "api.md")
    monkeypatch.setattr(docs, "REPO_ROOT", tmp_path)
    assert docs.main(["--check"]) == 1
    assert docs.main(["--write"]) == 0
    assert docs.main(["--check"]) == 0
    docs.OUTPUT.write_text(docs.OUTPUT.read_text().replace("Trainer image.", "Old words."))
    assert docs.main(["--check"]) == 1


def _field_paths(model: type[BaseModel], path: str) -> set[str]:
    """Every field's path, found by a walk of our own (only the shapes the contract uses)."""
    found: set[str] = set()
    for name, field in model.model_fields.items():
        key = field.alias or name
        found.add(f"{path}.{key}")
        inner = field.annotation
        for arg in (*getattr(inner, "__args__", ()), inner):
            for sub in (*getattr(arg, "__args__", ()), arg):
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    suffix = "[]" if "list" in str(inner) else ""
                    found |= _field_paths(sub, f"{path}.{key}{suffix}")
    return found


def test_every_field_has_a_row() -> None:
    documented = {f"{s.path}.{row[0].strip('`')}" for s in docs.sections() for row in s.rows}
    from megatron_contract.job import MegatronJobStatus

    expected = _field_paths(MegatronJobSpec, "spec") | _field_paths(MegatronJobStatus, "status")
    assert expected == documented
    assert "spec.failureDetection.collectiveTimeoutSeconds" in documented
    assert "status.plan.members[].ranks" in documented


class _Extra(WireModel):
    """A setting added by someone else."""

    retry_budget_seconds: float = Field(default=3.5, gt=0, le=60, description="How long to retry.")


class _Spec(MegatronJobSpec):
    extras: list[_Extra] = Field(default_factory=list, max_length=4, description="Extra settings.")


def test_a_new_nested_field_is_documented_without_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(docs, "MegatronJobSpec", _Spec)
    text = docs.render()
    assert "| `extras` | [][object](#spec-extras) | `[]` | items <= 4 | Extra settings. |" in text
    assert "## `spec.extras[]`" in text
    assert "A setting added by someone else." in text
    assert "| `retryBudgetSeconds` | number | `3.5` | > 0; <= 60 | How long to retry. |" in text
