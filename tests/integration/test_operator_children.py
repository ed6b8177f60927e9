"""A job's children against the real local control plane: restored when deleted, never created in a loop.

Scenarios:
- the token in the job's Secret is the HMAC of the job's UID under the operator's key; a deleted
  Service is recreated at once (the operator watches Services) and a deleted Secret before the
  next pod is created (the operator may not watch Secrets), both with the same token, with the
  periodic check set far away so that neither is its doing; plans after that still reach the
  agents with the job's token; a pod that waits with CreateContainerConfigError (kubelet's word
  for a missing Secret) has the Secret recreated at once;
- a deleted Secret comes back from the periodic check alone; Secret and Service deleted while no
  operator runs come back when one starts, with a token identical to the first one, which the
  new operator accepts on heartbeats;
- a pod create the API server refuses (requests above limits: it passes the CRD, not pod
  validation) is retried with backoff; after a bounded number of attempts the job has the
  CreateFailed condition and an event with the API server's reason; the attempts (pod serials
  reserved on the job) grow with doubling delays, not in a loop; a restarted operator keeps the
  condition True until it has tried again; a fixed spec clears the condition;
- spares that keep failing at start are replaced with doubling delays (pods counted), and the
  CreateFailed condition says why.
The operator's log and the namespace's objects are printed when a test fails.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from operator_harness import Harness, harness_for_test

from localcluster.operator_run import token_key_file
from localcluster.waiting import wait_for
from megatron_contract import wire
from megatron_operator.builders import ANNOTATION_NEXT_SERIAL
from megatron_operator.children import BASE_DELAY_SECONDS, REPORT_AFTER
from megatron_operator.token import derive_token, read_key

pytestmark = pytest.mark.cluster
JOB = "kids"
T = 30.0
FAR = "600"  # a periodic check of the Secret that never comes within a test


@pytest.fixture
def h(local_cluster: Any, namespace: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from harness_for_test(local_cluster, namespace, tmp_path, request, JOB)


def _secret_path(h: Harness) -> str:
    return f"/api/v1/namespaces/{h.ns}/secrets/{JOB}-token"


def _service_path(h: Harness) -> str:
    return f"/api/v1/namespaces/{h.ns}/services/{JOB}"


def _delete(h: Harness, path: str) -> str:
    """Delete an object; returns its uid (a recreated one has another)."""
    uid: str = h.api.get(path)["metadata"]["uid"]
    code, body = h.cluster.request("DELETE", path)
    assert code == 200, body
    return uid


def _recreated(h: Harness, path: str, old_uid: str) -> dict[str, Any] | None:
    body = h.api.get(path)
    return body if body and body["metadata"]["uid"] != old_uid else None


def _condition(h: Harness, type_: str = "CreateFailed") -> dict[str, Any] | None:
    return next((c for c in h.api.status(JOB).get("conditions", []) if c["type"] == type_), None)


def _events(h: Harness, reason: str) -> list[dict[str, Any]]:
    return [e for e in h.api.events() if e["involvedObject"].get("name") == JOB and e.get("reason") == reason]


def _serials(h: Harness) -> int:
    return int((h.api.job(JOB)["metadata"].get("annotations") or {}).get(ANNOTATION_NEXT_SERIAL, "0"))


def test_deleted_service_and_secret_come_back_promptly_with_the_same_token(h: Harness) -> None:
    h.add_nodes(1)
    h.start_operator(MEGATRON_OPERATOR_CHILDREN_CHECK_SECONDS=FAR)
    job = h.submit(replicas=2, spares=1, min_replicas=1)
    status = h.wait_running(1)
    token = h.token()
    key = read_key(token_key_file(h.cluster.workdir))
    assert token == derive_token(key, job["metadata"]["uid"])

    old = _delete(h, _service_path(h))
    service = wait_for(lambda: _recreated(h, _service_path(h), old), 10, "the Service recreated from its watch")
    assert service["spec"]["clusterIP"] == "None"
    assert service["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]

    old = _delete(h, _secret_path(h))
    spare = next(n for n in h.pod_names() if n not in h.members(status))
    h.api.delete_pod(spare)
    # The replacement spare needs the Secret: it is applied before the pod is created.
    (new_spare,) = wait_for(
        lambda: (new := h.pod_names() - set(h.members(status)) - {spare}) and len(new) == 1 and new, T, "a new spare"
    )
    assert _recreated(h, _secret_path(h), old), "the Secret was not recreated before the new pod"
    assert h.api.token(JOB) == token

    h.api.delete_pod(h.members(status)[0])
    # The recording agents accept only the job's first token: a plan that made the new spare a
    # member reaching them proves it (at epoch 2, or 3 when the spare was not warm yet and the job
    # shrank first, then grew).
    h.wait_status(
        lambda s: s.get("phase") == "Running" and s.get("epoch", 0) >= 2 and new_spare in h.members(s),
        "the new spare training in a later epoch",
        T,
    )


def test_a_pod_waiting_for_the_deleted_secret_has_it_recreated(h: Harness) -> None:
    h.add_nodes(1)
    h.start_operator(MEGATRON_OPERATOR_CHILDREN_CHECK_SECONDS=FAR)
    h.submit(replicas=1, spares=1, min_replicas=1)
    status = h.wait_running(1)
    token = h.token()
    old = _delete(h, _secret_path(h))
    spare = next(n for n in h.pod_names() if n not in h.members(status))
    # What kubelet reports for a pod whose env names a Secret that is gone.
    code, body = h.api.patch_pod_status(
        spare,
        {
            "phase": "Pending",
            "containerStatuses": [
                {
                    "name": "trainer",
                    "ready": False,
                    "restartCount": 0,
                    "image": "trainer:test",
                    "imageID": "",
                    "state": {
                        "waiting": {
                            "reason": "CreateContainerConfigError",
                            "message": f'secret "{JOB}-token" not found',
                        }
                    },
                }
            ],
        },
    )
    assert code == 200, body
    wait_for(lambda: _recreated(h, _secret_path(h), old), 10, "the Secret recreated for the waiting pod")
    assert h.api.token(JOB) == token


def test_secret_and_service_deleted_with_no_operator_running_come_back_with_the_same_token(h: Harness) -> None:
    h.add_nodes(1)
    operator = h.start_operator(MEGATRON_OPERATOR_CHILDREN_CHECK_SECONDS="1")
    job = h.submit(replicas=1, spares=0, min_replicas=1)
    status = h.wait_running(1)
    token = h.token()
    assert token is not None
    old = _delete(h, _secret_path(h))
    wait_for(lambda: _recreated(h, _secret_path(h), old), 10, "the Secret recreated by the periodic check")
    assert h.api.token(JOB) == token

    operator.stop()
    old_secret, old_service = _delete(h, _secret_path(h)), _delete(h, _service_path(h))
    operator = h.start_operator(MEGATRON_OPERATOR_CHILDREN_CHECK_SECONDS=FAR)
    wait_for(lambda: _recreated(h, _secret_path(h), old_secret), T, "the Secret recreated after the restart")
    wait_for(lambda: _recreated(h, _service_path(h), old_service), T, "the Service recreated after the restart")
    assert h.api.token(JOB) == token
    # The running pods' token still works: the new operator takes their heartbeats.
    member = h.members(status)[0]

    def heartbeat() -> tuple[int, Any] | None:
        try:
            answer = h.agents.report(operator.url, token, job["metadata"]["uid"], member, 1)
        except Exception:  # the new operator's endpoint is not up yet
            return None
        return answer if answer[0] != 404 else None  # 404: it does not know the job yet

    code, body = wait_for(heartbeat, T, "the new operator to answer a heartbeat")
    assert code == 200, body


def test_refused_pod_creates_back_off_then_set_a_condition_and_event_naming_why(h: Harness) -> None:
    h.add_nodes(1)
    h.start_operator()
    # Requests above limits: valid quantities (the CRD takes them), but no pod can be made of them.
    h.submit(replicas=2, spares=1, min_replicas=1, resources={"requests": {"cpu": "2"}, "limits": {"cpu": "1"}})
    cond = wait_for(lambda: (c := _condition(h)) and c["status"] == "True" and c, T, "the CreateFailed condition")
    assert cond["reason"] == "FailedCreatePod", cond
    assert "must be less than or equal to cpu limit" in cond["message"], cond
    assert f"{REPORT_AFTER} failures in a row" in cond["message"], cond  # reported after a bounded retry
    assert h.api.status(JOB).get("phase") in (None, "Pending", "Starting")
    wait_for(lambda: _events(h, "FailedCreatePod"), T, "a FailedCreatePod event")
    assert "must be less than or equal to cpu limit" in _events(h, "FailedCreatePod")[0]["message"]

    # Doubling delays: attempts 3 to 6 are at least 2 + 4 + 8 s apart, each attempt one reservation
    # of the job's three pod names (nothing else creates or reserves).
    started = time.monotonic()
    wait_for(lambda: "6 failures in a row" in ((_condition(h) or {}).get("message") or ""), 60, "attempt 6")
    elapsed = time.monotonic() - started
    assert elapsed >= 14 * BASE_DELAY_SECONDS - 1.5, f"attempts 3..6 took {elapsed:.1f} s: no backoff"
    assert _serials(h) in (18, 21), _serials(h)  # 6 attempts (a 7th may have just gone)
    assert not h.api.pods(JOB)

    # A restarted operator starts counting again; the condition stays True meanwhile (a fresh
    # process's empty backoffs are no success), and says so again after the bounded retry.
    h.operators[0].stop()
    h.start_operator()
    seen: list[dict[str, Any]] = []

    def reported_again() -> bool:
        cond = _condition(h) or {}
        seen.append(cond)
        return f"{REPORT_AFTER} failures in a row" in (cond.get("message") or "")

    wait_for(reported_again, T, "the restarted operator to report the refusal")
    assert all(c.get("status") == "True" for c in seen), [c.get("status") for c in seen]

    # A fixed spec is retried at once, and the condition clears when the pods are created.
    code, body = h.cluster.request(
        "PATCH",
        f"/apis/{wire.GROUP}/{wire.VERSION}/namespaces/{h.ns}/{wire.PLURAL}/{JOB}",
        {"spec": {"resources": {"limits": {"cpu": "2"}}}},
        content_type="application/merge-patch+json",
    )
    assert code == 200, body
    h.wait_running(1)
    cond = wait_for(lambda: (c := _condition(h)) and c["status"] == "False" and c, T, "the condition cleared")
    assert cond["reason"] == "ChildrenCreated"


def _longest_gaps(times: list[float]) -> list[float]:
    return sorted(b - a for a, b in itertools.pairwise(list(times)))[-3:]


def test_spares_failing_at_start_are_replaced_with_backoff(h: Harness) -> None:
    h.add_nodes(1)
    h.start_operator()
    h.submit(replicas=1, spares=1, min_replicas=1)
    status = h.wait_running(1)
    first = h.pod_names()
    stop = threading.Event()
    crashed: list[str] = []
    crashed_at: list[float] = []

    def crash_new_spares() -> None:  # every new spare's trainer "exits 1" as soon as it runs
        while not stop.wait(0.05):
            for pod in h.api.running_pods(JOB):
                name = pod["metadata"]["name"]
                if name not in first and name not in crashed:
                    h.api.patch_pod_status(name, {"phase": "Failed", "reason": "Error"})
                    crashed.append(name)
                    crashed_at.append(time.monotonic())

    crasher = threading.Thread(target=crash_new_spares, daemon=True)
    crasher.start()
    try:
        spare = next(n for n in first if n not in h.members(status))
        h.api.patch_pod_status(spare, {"phase": "Failed", "reason": "Error"})
        cond = wait_for(lambda: (c := _condition(h)) and c["status"] == "True" and c, 60, "the CreateFailed condition")
        assert cond["reason"] == "PodsFailingAtStart", cond
        # Each crash follows its pod's creation within one poll. Without a backoff they come a
        # fraction of a second apart; with it, once pods count as failing at start (a pod whose
        # agent reported first does not: how many do depends on the machine's speed), the creates
        # wait 1, 2, 4, ... s. Load only lengthens the gaps; the 1, 2 and 4 s waits must show.
        wait_for(lambda: sum(_longest_gaps(crashed_at)) >= 7 * BASE_DELAY_SECONDS - 1.0, 90, "the 1, 2 and 4 s waits")
    finally:
        stop.set()
        crasher.join(5)
    # Every pod created is the initial two or a crashed replacement, or the one now waiting.
    assert _serials(h) <= len(first) + len(crashed) + 1, (_serials(h), crashed)
    assert "exited" in cond["message"] or "failed" in cond["message"], cond
