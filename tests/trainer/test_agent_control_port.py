"""The agent's control port, against a real agent process (stand-in workers that speak the real
channel protocol).

Scenarios:
- before any plan: /healthz is 200, /v1/state says spare with epoch 0 and its worker's pid,
  /metrics is Prometheus text with the state series;
- refused plans change nothing: no token or a bad token (401), garbage, an invalid mesh, another
  job's plan (400), a declared, chunked or decompressed body over the limit (413), a stale or
  equal epoch (409);
  after each the epoch, state, membership and workers' phases are as before, and the worker keeps
  doing what it did (training continues, a spare stays spare);
- a good plan naming the pod (gzipped, as the operator sends it) is forwarded: the worker trains,
  /v1/state and /metrics show the epoch and steps; a newer plan that leaves the pod out turns it back into a spare;
- the rendezvous TCPStore is served on the pod address and the standard port.
"""

from __future__ import annotations

import gzip
import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from agent_harness import TOKEN, AgentProcess, PodAddress, make_plan, make_spec

from megatron_contract import wire

SPEC = make_spec(replicas=2)
GZIP = {"Content-Encoding": "gzip"}
OTHER = PodAddress("pod-other", "127.0.0.9")


class FreshAgents:
    """Hands each test an agent that no other test touched (spare, epoch 0), so no test depends on
    what another left behind. The next agent starts while a test runs and a used one shuts down in
    the background, so a fresh agent per test costs little time."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._started: list[AgentProcess] = []
        self._next = self._start()

    def _start(self) -> AgentProcess:
        process = AgentProcess("pod-a", SPEC, self._tmp.mktemp("agent"))
        self._started.append(process)
        return process

    def take(self) -> AgentProcess:
        """A ready agent of its own; the one after it starts now."""
        process, self._next = self._next, self._start()
        try:
            process.wait_ready()
        except AssertionError:
            print(f"===== log of {process.pod.name} ({process.pod.address}) =====\n{process.log()[-20000:]}")
            raise
        return process

    def close(self) -> None:
        """Stop every agent started (used ones are already shutting down)."""
        for process in self._started:
            process.terminate()
        for process in self._started:
            process.stop()


@pytest.fixture(scope="module")
def fresh_agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FreshAgents]:
    agents = FreshAgents(tmp_path_factory)
    yield agents
    agents.close()


@pytest.fixture
def agent(fresh_agents: FreshAgents) -> Iterator[AgentProcess]:
    """A fresh agent for each test: the test drives it to the state it needs."""
    process = fresh_agents.take()
    yield process
    process.terminate()


def start_training(agent: AgentProcess, epoch: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Push a plan of ``epoch`` naming the pod, gzipped as the operator sends it; (the agent's
    answer, its state once steps show)."""
    body = gzip.compress(json.dumps(make_plan(SPEC, [agent.pod, OTHER], epoch=epoch).to_wire()).encode())
    status, answer = agent.post_plan(body, headers=GZIP)
    assert status == 200, answer
    state = agent.wait_state(lambda s: s["state"] == "training" and s.get("step", 0) >= 3, 15, "training steps")
    return answer, state


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """What a refused plan must not change."""
    return {
        "epoch": state["epoch"],
        "state": state["state"],
        "member": state["member"],
        "ranks": state["ranks"],
        "phases": [w["phase"] for w in state["workers"]],
        "pids": [w["pid"] for w in state["workers"]],
    }


def post_chunked(agent: AgentProcess, size: int) -> int:
    """POST a body of ``size`` bytes without a Content-Length (chunked transfer)."""
    connection = http.client.HTTPConnection(agent.pod.address, wire.AGENT_PORT, timeout=30)
    chunk = b" " * (1024 * 1024)
    chunks = [chunk] * (size // len(chunk)) + [b" " * (size % len(chunk))]
    try:
        connection.request(
            "POST",
            wire.AGENT_PLAN_PATH,
            body=iter(chunks),
            headers={wire.AUTH_HEADER: f"Bearer {TOKEN}", "Content-Type": "application/json"},
            encode_chunked=True,
        )
        return connection.getresponse().status
    finally:
        connection.close()


def refusals(agent: AgentProcess, held_epoch: int) -> list[tuple[str, int, Any]]:
    """Every kind of bad push, as (name, expected status, callable returning the status)."""
    newer = make_plan(SPEC, [agent.pod, OTHER], epoch=held_epoch + 1)
    elsewhere = [OTHER, PodAddress("pod-x", "127.0.0.10")]  # plans that would take the pod out
    newer_without_pod = make_plan(SPEC, elsewhere, epoch=held_epoch + 1)
    doc = newer.to_wire()
    bad_mesh = json.dumps({**doc, "sizes": {**doc["sizes"], "dp": 3}}).encode()
    other_job = json.dumps({**doc, "jobUid": "another-job"}).encode()
    big = json.dumps({**doc, "padding": "x" * (wire.MAX_BODY_BYTES + 10)}).encode()
    cases: list[tuple[str, int, Any]] = [
        ("no token", 401, lambda: agent.post_plan(newer_without_pod, token=None)[0]),
        ("bad token", 401, lambda: agent.post_plan(newer_without_pod, token="not-the-token")[0]),
        ("garbage", 400, lambda: agent.post_plan(b"{this is not json")[0]),
        ("invalid mesh", 400, lambda: agent.post_plan(bad_mesh)[0]),
        ("other job", 400, lambda: agent.post_plan(other_job)[0]),
        ("oversized", 413, lambda: agent.post_plan(big)[0]),
        # Small on the wire, over the limit once decompressed.
        ("oversized gzipped", 413, lambda: agent.post_plan(gzip.compress(big), headers=GZIP)[0]),
        ("bad gzip", 400, lambda: agent.post_plan(b"not gzip", headers=GZIP)[0]),
        ("oversized chunked", 413, lambda: post_chunked(agent, wire.MAX_BODY_BYTES + 10)),
    ]
    for stale in range(max(1, held_epoch - 1), held_epoch + 1):
        plan = make_plan(SPEC, elsewhere, epoch=stale)
        cases.append((f"epoch {stale} (held {held_epoch})", 409, lambda plan=plan: agent.post_plan(plan)[0]))
    return cases


def test_health_state_and_metrics_before_any_plan(agent: AgentProcess) -> None:
    status, _ = agent.post_plan(b"", token="wrong")  # a refusal, so the metric below exists
    assert status == 401
    health = json.loads(agent_get(agent, wire.AGENT_HEALTH_PATH))
    assert health == {"ok": True, "state": "spare", "epoch": 0}
    state = agent.state()
    assert (state["pod"], state["epoch"], state["state"], state["member"]) == ("pod-a", 0, "spare", False)
    assert state["workers"][0]["pid"] > 0 and state["workers"][0]["alive"]
    metrics = agent.metrics()
    assert 'megatron_agent_state{state="spare"} 1.0' in metrics
    assert "megatron_agent_epoch 0.0" in metrics
    assert 'megatron_agent_plans_total{code="401"}' in metrics


def agent_get(agent: AgentProcess, path: str) -> str:
    connection = http.client.HTTPConnection(agent.pod.address, wire.AGENT_PORT, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        assert response.status == 200, f"GET {path}: {response.status}"
        return response.read().decode()
    finally:
        connection.close()


def check_refusals_change_nothing(agent: AgentProcess) -> None:
    before = snapshot(agent.state())
    for name, expected, push in refusals(agent, before["epoch"]):
        assert push() == expected, f"{name}: expected {expected}"
        assert snapshot(agent.state()) == before, f"{name}: state changed"


def test_refused_plans_change_nothing_while_spare(agent: AgentProcess) -> None:
    check_refusals_change_nothing(agent)


def test_good_plan_is_forwarded_and_training_shows(agent: AgentProcess) -> None:
    epoch = 2  # epochs may skip (the pod missed one); only "newer" matters
    answer, state = start_training(agent, epoch)
    assert answer["epoch"] == epoch and answer["member"] is True
    assert (state["epoch"], state["ranks"], state["workers"][0]["rank"]) == (epoch, [0], 0)
    assert state["consumedSamples"] == state["step"] * SPEC.training.global_batch_size
    metrics = agent.metrics()
    assert f"megatron_agent_epoch {float(epoch)}" in metrics
    assert 'megatron_agent_state{state="training"} 1.0' in metrics
    assert "megatron_agent_step_time_seconds_count" in metrics


def test_refused_plans_change_nothing_while_training(agent: AgentProcess) -> None:
    _, before = start_training(agent, epoch=2)  # refusals of stale epochs 1 and 2 then
    check_refusals_change_nothing(agent)
    # Had any refused plan reached the worker, it would have left training (they leave the pod out).
    after = agent.wait_state(lambda s: s.get("step", 0) > before["step"] + 3, 15, "steps after the refusals")
    assert snapshot(after) == snapshot(before)


def test_newer_plan_without_the_pod_makes_it_a_spare(agent: AgentProcess) -> None:
    start_training(agent, epoch=1)
    epoch = 2
    plan = make_plan(SPEC, [OTHER, PodAddress("pod-x", "127.0.0.10")], epoch=epoch)
    status, answer = agent.post_plan(plan)
    assert (status, answer["member"]) == (200, False)
    state = agent.wait_state(lambda s: s["state"] == "spare", 15, "back to spare")
    assert (state["epoch"], state["member"], state["workers"][0]["phase"]) == (epoch, False, "spare")


def test_rendezvous_store_is_served_on_the_pod_address(agent: AgentProcess) -> None:
    import datetime

    import torch.distributed as dist

    agent.wait_state(lambda s: s["rendezvous"]["running"], 60, "the store to be up")
    client = dist.TCPStore(
        agent.pod.address, wire.RENDEZVOUS_PORT, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    epoch_store = dist.PrefixStore("job/epoch-1", client)
    epoch_store.set("rank0", "ready")
    assert client.get("job/epoch-1/rank0") == b"ready"
