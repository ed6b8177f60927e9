"""Creating children without loops, and job tokens without reading Secrets (pure parts, no API server).

Scenarios:
- a job's token is derived from its UID under the operator's key: the same for the same UID and key
  (a restart, a standby), different for another UID or key; keys shorter than 32 bytes, missing
  key files and empty UIDs are refused;
- the backoff: one failure costs nothing, then the delay doubles up to the cap; success resets it;
  three failures in a row are reportable;
- the start tracker: a created pod that fails (phase Failed, declared failed, deleted) within the
  grace counts as a failed start; one that stays ready past the grace, or succeeds, has started; a
  pod retired on purpose counts as neither; a pod not in the index yet waits, and is forgotten if
  it never shows up;
- label patches: labels asked of a pod are not asked again while the index has not caught up
  (for LABEL_RESEND_SECONDS: a failed patch is sent again then), but at once when they change or
  were seen and changed back;
- the verdict: no condition while nothing is reportable; the first reportable child's reason and
  every reportable child's last error otherwise;
- PodFacts keeps the reason a container waits for (CreateContainerConfigError: Secret missing);
- a refused call is told in the API server's words (status, reason, its message);
- the operator does not start without a usable key file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException
from operator_factories import make_pod

from megatron_operator import kube
from megatron_operator.children import (
    BASE_DELAY_SECONDS,
    FORGET_UNSEEN_SECONDS,
    LABEL_RESEND_SECONDS,
    MAX_DELAY_SECONDS,
    REPORT_AFTER,
    START_GRACE_SECONDS,
    Backoff,
    Child,
    LabelRequests,
    StartOutcome,
    StartTracker,
    delay_after,
    verdict,
)
from megatron_operator.failures import Failure, FailureReason, PodFacts
from megatron_operator.token import MIN_KEY_BYTES, TokenKeyError, derive_token, read_key

KEY = b"k" * MIN_KEY_BYTES
UID = "2f4c1d9e-0000-4000-8000-000000000001"


def test_token_is_derived_from_uid_and_key_only() -> None:
    token = derive_token(KEY, UID)
    assert token == derive_token(KEY, UID)
    assert len(token) == 43 and "=" not in token
    assert token != derive_token(KEY, UID[:-1] + "2")
    assert token != derive_token(b"j" * MIN_KEY_BYTES, UID)
    with pytest.raises(ValueError):
        derive_token(KEY, "")


def test_key_file(tmp_path: Path) -> None:
    path = tmp_path / "key"
    with pytest.raises(TokenKeyError, match="cannot read"):
        read_key(path)
    path.write_bytes(b"short\n")
    with pytest.raises(TokenKeyError, match="at least 32"):
        read_key(path)
    path.write_bytes(KEY + b"\n")
    assert read_key(path) == KEY  # a trailing newline (an editor's, or `echo`'s) is not part of the key


def test_backoff_doubles_to_the_cap_and_resets() -> None:
    assert [delay_after(n) for n in range(4)] == [0.0, 0.0, BASE_DELAY_SECONDS, 2 * BASE_DELAY_SECONDS]
    assert delay_after(50) == MAX_DELAY_SECONDS
    b = Backoff()
    assert b.ready(0.0)
    b.failed(10.0, "FailedCreatePod", "422")
    assert b.ready(10.0) and not b.reportable
    b.failed(10.0, "FailedCreatePod", "422")
    assert not b.ready(10.0) and b.ready(10.0 + BASE_DELAY_SECONDS)
    for _ in range(REPORT_AFTER - 2):
        b.failed(20.0, "FailedCreatePod", "422 again")
    assert b.reportable and b.error == "422 again"
    b.succeeded()
    assert b.failures == 0 and b.ready(0.0) and not b.reportable


def _facts(name: str, **kw: object) -> PodFacts:
    return PodFacts.of(make_pod(name, **kw))  # type: ignore[arg-type]


def test_start_tracker_settles_failed_and_started_pods() -> None:
    t = StartTracker()
    t.created(["a", "b", "c", "d", "e", "f", "g"], now=0.0)
    pods = [
        _facts("a", phase="Failed", reason="Error"),  # failed at start
        _facts("b"),  # running, but the grace has not passed
        _facts("c", phase="Succeeded"),  # finished: it started
        _facts("d"),  # declared failed by the controller (heartbeats)
        _facts("e"),  # retired by the operator: neither
        _facts("f"),  # seen now, deleted by the next look
    ]
    heartbeat = Failure("d", FailureReason.HEARTBEAT_MISSING, "no heartbeat from d")
    out = t.observe(pods, {"d": heartbeat}, {"e"}, {}, now=5.0)
    assert set(out.failed) == {"a", "d"} and out.started == ("c",)
    assert any("no heartbeat from d" in m for m in out.messages)
    assert len(t) == 3  # b, f and g (g not in the index yet: it waits)
    out = t.observe([_facts("b")], {}, set(), {}, now=START_GRACE_SECONDS)
    assert out.started == ("b",) and out.failed == ("f",) and "deleted" in out.messages[0]
    assert len(t) == 1  # g still waits for its first sighting
    out = t.observe([_facts("g", node="gpu-9")], {}, set(), {"gpu-9": "False"}, now=40.0)
    assert out.failed == ("g",)  # its node went NotReady before it started
    t.created(["h"], now=50.0)
    assert t.observe([], {}, set(), {}, now=50.0 + FORGET_UNSEEN_SECONDS + 1) == StartOutcome()
    assert len(t) == 0  # never seen: forgotten, neither started nor failed
    # A pod whose agent reported started, before the grace: failing later is no failed start.
    t.created(["i"], now=60.0)
    assert t.observe([_facts("i")], {}, set(), {}, now=61.0, reported={"i"}).started == ("i",)


def test_verdict_names_the_first_reportable_child() -> None:
    backoffs = {kind: Backoff() for kind in Child}
    assert not verdict(backoffs, "ChildrenCreated").failing
    for _ in range(REPORT_AFTER - 1):
        backoffs[Child.SECRET].failed(0.0, "FailedCreateSecret", "403 Forbidden")
    assert not verdict(backoffs, "ChildrenCreated").failing  # not yet: a bounded retry first
    for _ in range(REPORT_AFTER):
        backoffs[Child.POD].failed(0.0, "FailedCreatePod", 'creating pod p-3: 422 Invalid: "lots"')
    v = verdict(backoffs, "ChildrenCreated")
    assert v.failing and v.reason == "FailedCreatePod" and '"lots"' in v.message
    backoffs[Child.SECRET].failed(0.0, "FailedCreateSecret", "403 Forbidden")
    v = verdict(backoffs, "ChildrenCreated")
    assert v.reason == "FailedCreateSecret" and "403 Forbidden" in v.message and "422" in v.message


def test_pod_facts_keep_the_waiting_reason() -> None:
    body = make_pod("w", phase="Pending", ip=None)
    body["status"]["containerStatuses"][0]["state"] = {
        "waiting": {"reason": "CreateContainerConfigError", "message": 'secret "job-token" not found'}
    }
    assert PodFacts.of(body).waiting == "CreateContainerConfigError"
    assert PodFacts.of(make_pod("r")).waiting is None


def test_api_errors_are_told_in_the_api_servers_words() -> None:
    exc = ApiException(status=422, reason="Unprocessable Entity")
    exc.body = json.dumps({"kind": "Status", "message": 'Pod "p-3" is invalid: spec.containers[0].resources'})
    assert kube.error_message(exc) == '422 Unprocessable Entity: Pod "p-3" is invalid: spec.containers[0].resources'
    bare = ApiException(status=403, reason="Forbidden")
    assert kube.error_message(bare) == "403 Forbidden"
    assert kube.error_message(TimeoutError("read timed out")) == "TimeoutError: read timed out"


def test_the_operator_refuses_to_start_without_a_usable_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from megatron_operator.__main__ import main

    monkeypatch.delenv("MEGATRON_OPERATOR_TOKEN_KEY_FILE", raising=False)
    assert main([]) == 2
    assert "MEGATRON_OPERATOR_TOKEN_KEY_FILE is not set" in caplog.text
    monkeypatch.setenv("MEGATRON_OPERATOR_TOKEN_KEY_FILE", str(tmp_path / "absent"))
    assert main([]) == 2
    assert "cannot read the token key file" in caplog.text


def test_labels_asked_for_are_not_asked_again_until_seen_or_stale() -> None:
    requests = LabelRequests()
    worker = {"role": "worker", "replica": "3"}
    assert requests.due("a", worker, shown=False, now=0.0)
    # The pod index has not caught up: the next passes do not send the same patch again.
    assert not requests.due("a", worker, shown=False, now=1.0)
    assert not requests.due("a", dict(worker), shown=False, now=LABEL_RESEND_SECONDS - 0.1)
    # Other labels (a new plan) are sent at once; so is the same one once it is stale.
    spare = {"role": "spare", "replica": None}
    assert requests.due("a", spare, shown=False, now=2.0)
    assert not requests.due("a", spare, shown=False, now=3.0)
    assert requests.due("a", spare, shown=False, now=2.0 + LABEL_RESEND_SECONDS)
    # Seen on the pod: forgotten, so a later change (a person's edit) is patched back at once.
    assert not requests.due("a", spare, shown=True, now=40.0)
    assert requests.pending() == 0
    assert requests.due("a", spare, shown=False, now=41.0)
    # Deleted pods are forgotten.
    assert requests.due("b", worker, shown=False, now=42.0)
    requests.keep_only({"b"})
    assert requests.pending() == 1
    assert not requests.due("b", worker, shown=False, now=43.0)
