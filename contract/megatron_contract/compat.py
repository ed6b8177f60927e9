"""Reading a spec written for a newer version: its unknown fields are dropped and named, not fatal.

The API server prunes fields its CRD does not know, and kubectl's strict field validation refuses
them, so a typo never reaches the operator. A field that does reach it, and that this version's
model does not know, was allowed by a newer CRD (Helm leaves the newer CRD in place when the
operator is rolled back) and written by a newer client: refusing the spec would fail a running
job for good. The readers that keep a job going (the operator, a trainer agent) parse the spec
with :func:`validate_ignoring_unknown` and say which fields they ignore; strict parsing
(``model_validate``) stays the rule everywhere else.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel, ValidationError

#: The pydantic error type of a field the model does not know.
UNKNOWN_FIELD = "extra_forbidden"


def validate_ignoring_unknown[M: BaseModel](model: type[M], data: Any, root: str = "spec") -> tuple[M, list[str]]:
    """``model`` validated from ``data`` without the fields it does not know, and their paths
    (``spec.model.fooBar``, sorted).

    Raises:
        ValidationError: when ``data`` is invalid for any other reason (with the unknown fields
            dropped, so the message names only what this version can judge).
    """
    data = copy.deepcopy(data)
    ignored: list[str] = []
    while True:
        try:
            return model.model_validate(data), sorted(ignored)
        except ValidationError as exc:
            unknown = [e["loc"] for e in exc.errors() if e["type"] == UNKNOWN_FIELD]
            if not unknown or not all(_drop(data, loc) for loc in unknown):
                raise
            ignored.extend(".".join([root, *(str(p) for p in loc)]) for loc in unknown)


def _drop(data: Any, loc: tuple[str | int, ...]) -> bool:
    """Remove the value at ``loc`` in ``data``; False when ``loc`` does not lead to one (a location
    inside a union names the union's member, not a key of the data)."""
    node = data
    for part in loc[:-1]:
        in_dict = isinstance(node, dict) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if not (in_dict or in_list):
            return False
        node = node[part]
    if isinstance(node, dict) and loc[-1] in node:
        del node[loc[-1]]
        return True
    return False
