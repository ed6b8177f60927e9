"""The base models: camelCase on the wire, snake_case in Python; unknown fields refused in what a
person writes (:class:`WireModel`), kept in what one version writes for another (:class:`OpenWireModel`)."""

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


class OpenWireModel(WireModel):
    """Base of what one version of the software writes and another may read: the job's status, the
    plans pushed to the agents, the agents' reports.

    During an upgrade or a rollback the operator, the CRD and the trainer images are of different
    versions (Helm never upgrades or rolls back a chart's CRD, and running pods keep their image).
    A field this version does not know is therefore kept (in ``model_extra``) and written back as
    read, not refused: Kubernetes asks the same of every client that reads, changes and writes an
    object. A newer version may only add fields that an older reader can safely ignore.
    """

    model_config = ConfigDict(extra="allow")
