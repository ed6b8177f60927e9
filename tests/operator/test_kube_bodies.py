"""Request bodies (``megatron_operator.kube``): a body of JSON types only (:class:`JsonBody`, a job's
status as written) is sent as it is, not walked value by value; any other body still is (a datetime
becomes its ISO form). Writes against a real API server: tests/integration/test_kube_writes.py."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from megatron_operator import kube


def test_a_json_body_goes_unwalked_and_other_bodies_are_still_made_json() -> None:
    api = kube._ApiClient()
    status = kube.JsonBody({"plan": {"members": [{"pod": "p0", "ranks": [0]}]}, "epoch": 3})
    patch = api.sanitize_for_serialization([{"op": "add", "path": "/status", "value": status}])
    assert patch[0]["value"] is status
    when = datetime(2026, 1, 1, tzinfo=UTC)
    assert api.sanitize_for_serialization({"at": [when]}) == {"at": ["2026-01-01T00:00:00+00:00"]}
    assert json.loads(json.dumps(patch))[0]["value"] == {"plan": {"members": [{"pod": "p0", "ranks": [0]}]}, "epoch": 3}
