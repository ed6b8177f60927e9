"""The base model: camelCase on the wire, snake_case in Python, unknown fields refused."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class WireModel(BaseModel):
    """Base of every contract model.

    Field names are camelCase in JSON/YAML (Kubernetes convention) and snake_case in Python;
    unknown fields are an error so a typo never passes silently.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready dict with camelCase keys and unset optionals left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
