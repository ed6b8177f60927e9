"""The operator's own faults, against the real local control plane.

Scenarios:
- the operator is SIGKILLed in the middle of a recovery (right after the plan is stored, after it
  is pushed, or after the replacement spare is created); a new operator process completes that
  recovery from status: the same epoch is pushed, no second plan is made, no pod is created twice;
- two operator replicas: only the Lease holder acts (the standby answers its liveness probe
  meanwhile); when it is killed the standby takes over after the Lease expires and handles the
  next failure;
- status writes keep converging while another client keeps changing the job (write conflicts).
The operators' logs and the namespace's objects are printed when a test fails.
"""

from __future__ import annotations

import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from operator_harness import Harness, free_port, harness_for_test
from test_operator_cluster import JOB, T, _start

from localcluster.waiting import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture
def h(local_cluster: Any, namespace: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from harness_for_test(local_cluster, namespace, tmp_path, request, JOB)


def _lease_holder(h: Harness) -> str | None:
    lease = h.api.get(f"/apis/coordination.k8s.io/v1/namespaces/{h.ns}/leases/megatron-operator")
    return (lease or {}).get("spec", {}).get("holderIdentity")


@pytest.mark.parametrize("crash_at", ["plan-stored", "plan-pushed", "pods-created"])
def test_operator_killed_mid_recovery_completes_it_after_restart(h: Harness, crash_at: str) -> None:
    status = _start(h, replicas=2, spares=1, min_replicas=1)
    members = h.members(status)
    h.operators[0].stop()
    crashing = h.start_operator(MEGATRON_OPERATOR_CRASH_AT=crash_at, MEGATRON_OPERATOR_IDENTITY="crashing")
    wait_for(lambda: _lease_holder(h) == "crashing", T, "the second operator to lead")
    # A restarted operator plans only once it heard from the running pods (or a few heartbeat
    # intervals passed); the failure must land after that for the crash points to be in order.
    wait_for(lambda: "heard from every running pod" in crashing.log_text(), T, "the operator to hear the agents")
    names_before = h.pod_names()
    victim = members[0]
    h.api.delete_pod(victim)
    wait_for(lambda: not crashing.alive(), T, f"the operator to die at {crash_at}")
    stored = h.api.status(JOB)
    # The crash happened before the status said the recovery was over.
    assert stored["epoch"] == 2 and stored["phase"] == "Recovering" and stored["recoveries"] == 1
    if crash_at == "plan-stored":
        assert all(2 not in h.agents.plans_for(p, status=None) for p in h.members(stored)), "pushed before crash"
    created = h.pod_names() - names_before
    assert len(created) == (1 if crash_at == "pods-created" else 0)

    h.start_operator(MEGATRON_OPERATOR_IDENTITY="successor")
    status = h.wait_running(2, timeout=60)
    assert status["recoveries"] == 1 and status["plan"] == stored["plan"]
    h.wait_status(lambda s: s.get("sparesReady") == 1, "the spare pool refilled")
    # One new pod in all (the spare that replaces the one promoted), and no epoch beyond 2; each
    # member took epoch 2 once (a second push after the restart is answered 409).
    assert len(h.pod_names() - names_before) == 1, h.pod_names()
    assert len(h.pod_names()) == 3
    assert max(r.epoch for r in h.agents.received) == 2
    for pod in h.members(status):
        assert h.agents.plans_for(pod).count(2) == 1


def test_only_the_lease_holder_acts_and_standby_takes_over(h: Harness) -> None:
    h.add_nodes(1)
    leader = h.start_operator(MEGATRON_OPERATOR_IDENTITY="leader")
    wait_for(lambda: _lease_holder(h) == "leader", T, "leader elected")
    health_port = free_port()
    standby = h.start_operator(MEGATRON_OPERATOR_IDENTITY="standby", MEGATRON_OPERATOR_HEALTH_PORT=str(health_port))
    wait_for(lambda: "waiting for leadership" in standby.log_text(), T, "standby waiting")
    with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/healthz", timeout=10) as alive:
        assert alive.status == 200  # a standby is alive: its liveness probe must not restart it
    h.submit(replicas=2, spares=1, min_replicas=1)
    status = h.wait_running(1)
    assert _lease_holder(h) == "leader"
    assert "plan epoch" not in standby.log_text()
    assert "starting the operator" not in standby.log_text()
    leader.kill()
    h.api.delete_pod(h.members(status)[0])
    status = h.wait_running(2, timeout=60)
    assert _lease_holder(h) == "standby"
    # The leader made the first plan and died; the standby made the second, once.
    assert "plan epoch 1 stored" in leader.log_text()
    assert standby.log_text().count("plan epoch 2 stored") == 1


def test_status_converges_while_another_client_keeps_writing_the_job(h: Harness) -> None:
    status = _start(h, replicas=2, spares=1, min_replicas=1)
    stop = threading.Event()

    def churn() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            h.cluster.request(
                "PATCH",
                f"/apis/megatron.dev/v1alpha1/namespaces/{h.ns}/megatronjobs/{JOB}",
                {"metadata": {"annotations": {"test/churn": str(n)}}},
                content_type="application/merge-patch+json",
            )

    writer = threading.Thread(target=churn, daemon=True)
    writer.start()
    try:
        h.api.delete_pod(h.members(status)[0])
        status = h.wait_running(2)
        h.wait_status(lambda s: s.get("sparesReady") == 1, "spare pool refilled under write churn")
    finally:
        stop.set()
        writer.join(10)
    assert status["recoveries"] == 1
