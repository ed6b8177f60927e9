"""Upgrades and rollbacks of the operator under a running job, against the real local control plane.

How version skew is modelled with one code base: the operator process under test plays one
version, and the other version is represented by what it leaves behind in the API server.

- *Rollback* (this code is the older operator): a newer CRD stays installed, as Helm leaves it
  (the test installs the generated CRD plus a spec field ``futureKnob``, a status field
  ``migration`` and a plan reason ``rebalance``, and puts the generated one back afterwards); the
  newer operator wrote fields and values this code does not know into the status, and a newer
  client set ``spec.futureKnob``. Both are written while no operator runs, as during a rollout.
- *Upgrade* (this code is the newer operator): the status an older operator wrote lacks fields this
  code writes (``goodput`` and ``recoveryEpoch`` are removed before it starts).

The trainer agents are the harness's recording stand-ins (they answer 409 with the epoch they
hold, like real agents), so the test sees every plan they are sent.

Scenarios:
- upgrade, then rollback, under a training job: after each restart the job keeps its epoch, no
  plan is made and no agent takes a plan again, no pod is replaced; the fields the other version
  wrote survive this version's status writes; the unknown spec field is named in a
  ``SpecFieldsIgnored`` event and the job does not fail; a failure after the rollback is handled
  with the next epoch;
- a status this version cannot read: the operator refuses it loudly (``StatusUnreadable`` event,
  ``ReconcilePaused=True``) and leaves the pods alone, even when a member fails; once the status is
  readable again it resumes from the stored epoch and handles that failure with the next one;
- a status behind the agents (the epoch-1 status put back while the agents train in epoch 2, as a
  restore from a backup would): ``StatusBehindAgents``, no plan (a second, different epoch 2 would
  be taken for the one they hold), no pod touched; once the status records epoch 2 again the
  operator resumes without a new plan.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from operator_factories import make_job
from operator_harness import JOBS, Harness, harness_for_test, wait_for
from test_operator_cluster import JOB, T, _start

from megatron_contract import wire
from megatron_contract.crd import CRD_NAME

pytestmark = pytest.mark.cluster
CRD_PATH = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}"
MERGE = "application/merge-patch+json"


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    return schema


def _newer(crd: dict[str, Any]) -> dict[str, Any]:
    """The CRD as a newer version of the operator would ship it."""
    newer = copy.deepcopy(crd)
    schema = _schema(newer)
    schema["spec"]["properties"]["futureKnob"] = {"type": "integer", "description": "A newer version's knob."}
    status = schema["status"]["properties"]
    status["migration"] = {"type": "object", "properties": {"state": {"type": "string"}}}
    status["plan"]["properties"]["reason"]["enum"].append("rebalance")
    return newer


@pytest.fixture(scope="module")
def newer_crd(local_cluster: Any) -> Iterator[None]:
    """The newer CRD in place for this module's tests; the generated one put back afterwards."""
    code, original = local_cluster.request("GET", CRD_PATH)
    assert code == 200, original
    code, body = local_cluster.request("PUT", CRD_PATH, _newer(original))
    assert code == 200, body
    # The API server serves a changed schema shortly after the write: wait until it keeps the field.
    probe = make_job("probe", "default", replicas=2)
    probe["metadata"] = {"name": "probe"}
    probe["spec"]["futureKnob"] = 1
    wait_for(
        lambda: (
            local_cluster.request("POST", f"{JOBS}/namespaces/default/{wire.PLURAL}?dryRun=All", probe)[1]
            .get("spec", {})
            .get("futureKnob")
        ),
        T,
        "the newer CRD to be served",
    )
    try:
        yield
    finally:
        code, current = local_cluster.request("GET", CRD_PATH)
        restored = {**current, "spec": original["spec"]}
        code, body = local_cluster.request("PUT", CRD_PATH, restored)
        assert code == 200, body


@pytest.fixture
def h(
    newer_crd: None, local_cluster: Any, namespace: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Harness]:
    yield from harness_for_test(local_cluster, namespace, tmp_path, request, JOB)


def _job_path(h: Harness) -> str:
    return f"{JOBS}/namespaces/{h.ns}/{wire.PLURAL}/{JOB}"


def _patch_status(h: Harness, status: dict[str, Any]) -> None:
    code, body = h.cluster.request("PATCH", f"{_job_path(h)}/status", {"status": status}, content_type=MERGE)
    assert code == 200, body


def _restart_operator(h: Harness, before: Callable[[], None]) -> None:
    """Stop the running operator, change what the other version would have, start this one."""
    h.operators[-1].stop()
    before()
    h.start_operator()


def _pods(h: Harness) -> dict[str, str]:
    """Name -> UID of the job's pods that are not being deleted."""
    return {
        p["metadata"]["name"]: p["metadata"]["uid"]
        for p in h.api.pods(JOB)
        if not p["metadata"].get("deletionTimestamp")
    }


def _events(h: Harness, reason: str) -> list[str]:
    return [e.get("message", "") for e in h.api.events() if e.get("reason") == reason]


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def _taken(h: Harness) -> list[tuple[str | None, int]]:
    """Every plan an agent took (answered 200)."""
    return sorted((r.pod, r.epoch) for r in h.agents.received if r.status == 200)


def _holds_for(check: Callable[[], bool], seconds: float, what: str) -> None:
    """Fail as soon as ``check`` is false within ``seconds`` (the opposite of wait_for)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert check(), what
        time.sleep(0.1)


def test_upgrade_then_rollback_under_a_running_job_keeps_its_epoch(h: Harness) -> None:
    status = _start(h, replicas=2, spares=1, min_replicas=1)
    pods, taken = _pods(h), _taken(h)
    assert status["epoch"] == 1 and "goodput" in status and len(taken) == 2

    # Upgrade: this version starts under a status an older one wrote (without the fields it adds).
    _restart_operator(h, lambda: _patch_status(h, {"goodput": None, "recoveryEpoch": None}))
    wait_for(lambda: "heard from every running pod" in h.operators[-1].log_text(), T, "the upgraded operator to settle")
    status = h.wait_status(lambda s: "goodput" in s and "recoveryEpoch" in s, "this version's fields written")
    assert (status["phase"], status["epoch"]) == ("Running", 1)

    # Rollback: this version starts under what a newer one and a newer client wrote.
    def newer_writes() -> None:
        _patch_status(h, {"migration": {"state": "idle"}, "plan": {"placementHint": "rack-a"}})
        code, body = h.cluster.request("PATCH", _job_path(h), {"spec": {"futureKnob": 3}}, content_type=MERGE)
        assert code == 200 and body["spec"]["futureKnob"] == 3, body

    _restart_operator(h, newer_writes)
    generation = h.api.job(JOB)["metadata"]["generation"]
    wait_for(lambda: _events(h, "SpecFieldsIgnored"), T, "the unknown spec field named in an event")
    assert "spec.futureKnob" in _events(h, "SpecFieldsIgnored")[0]
    status = h.wait_status(lambda s: s.get("observedGeneration") == generation, "a status written by this version")
    assert (status["phase"], status["epoch"]) == ("Running", 1)
    assert status["migration"] == {"state": "idle"} and status["plan"]["placementHint"] == "rack-a"
    assert _pods(h) == pods, "a pod was replaced"
    assert _taken(h) == taken, "an agent took a plan again"
    assert not _events(h, "InvalidSpec")
    assert " stored (" not in h.operators[-1].log_text(), "the rolled-back operator made a plan"

    # The rolled-back operator still handles a failure, with the next epoch.
    members = h.members(status)
    h.api.delete_pod(members[0])
    status = h.wait_running(2)
    assert members[0] not in h.members(status) and status["recoveries"] == 1
    assert status["migration"] == {"state": "idle"} and "placementHint" not in status["plan"]
    assert max(epoch for _, epoch in _taken(h)) == 2


def test_an_unreadable_status_is_refused_and_the_pods_left_alone(h: Harness) -> None:
    status = _start(h, replicas=2, spares=1, min_replicas=1)
    members, taken = h.members(status), _taken(h)

    _restart_operator(h, lambda: _patch_status(h, {"plan": {"reason": "rebalance"}}))
    wait_for(lambda: _events(h, "StatusUnreadable"), T, "the refusal as an event")
    assert "status.plan.reason" in _events(h, "StatusUnreadable")[0]
    status = h.wait_status(lambda s: _condition(s, "ReconcilePaused").get("status") == "True", "ReconcilePaused=True")
    assert _condition(status, "ReconcilePaused")["reason"] == "StatusUnreadable"
    assert status["plan"]["reason"] == "rebalance" and status["epoch"] == 1  # the rest as it was
    assert "not acting on the job" in h.operators[-1].log_text()

    # A member fails while the status cannot be read: no plan, no pod deleted or created.
    h.api.delete_pod(members[0])
    pods = wait_for(lambda: members[0] not in (p := _pods(h)) and p, T, "the member gone")
    _holds_for(
        lambda: _pods(h) == pods and _taken(h) == taken and h.api.status(JOB)["epoch"] == 1,
        5.0,  # an operator that acts replaces a deleted member within a second or two (test_operator_cluster)
        "the operator touched a job whose status it cannot read",
    )
    assert len(_events(h, "StatusUnreadable")) == 1  # once, not per pass

    # The newer version wrote it again in a form this one reads (or a person fixed it): resume.
    _patch_status(h, {"plan": {"reason": "initial"}})
    status = h.wait_status(lambda s: _condition(s, "ReconcilePaused").get("status") == "False", "resumed")
    assert _condition(status, "ReconcilePaused")["reason"] == "ReconcileResumed"
    status = h.wait_running(2)
    assert members[0] not in h.members(status) and status["recoveries"] == 1
    assert [epoch for _, epoch in _taken(h) if epoch == 1] == [1, 1]  # epoch 1 never taken again


def test_a_status_behind_the_agents_is_not_fought(h: Harness) -> None:
    status = _start(h, replicas=2, spares=1, min_replicas=1)
    old = h.api.status(JOB)
    h.api.delete_pod(h.members(status)[0])
    current = h.wait_running(2)
    h.wait_status(lambda s: s.get("sparesReady") == 1, "the spare pool refilled")
    pods, taken = _pods(h), _taken(h)

    # The status is put back as it was at epoch 1 (a restore from a backup) while no operator runs.
    def restore(status: dict[str, Any]) -> None:
        code, body = h.cluster.request(
            "PATCH",
            f"{_job_path(h)}/status",
            [{"op": "replace", "path": "/status", "value": status}],
            content_type="application/json-patch+json",
        )
        assert code == 200, body

    _restart_operator(h, lambda: restore(old))
    wait_for(lambda: _events(h, "StatusBehindAgents"), T, "the refusal as an event")
    h.wait_status(lambda s: _condition(s, "ReconcilePaused").get("reason") == "StatusBehindAgents", "paused")
    _holds_for(
        lambda: _pods(h) == pods and _taken(h) == taken and h.api.status(JOB)["epoch"] == 1,
        5.0,
        "the operator acted on a status behind its agents",
    )
    restore({**current, "conditions": h.api.status(JOB)["conditions"]})
    status = h.wait_status(lambda s: _condition(s, "ReconcilePaused").get("status") == "False", "resumed")
    assert status["epoch"] == 2 and _pods(h) == pods and _taken(h) == taken
