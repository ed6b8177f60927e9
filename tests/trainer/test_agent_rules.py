"""Pure rules of the agent, without processes.

Scenarios:
- plan acceptance: a missing, malformed or wrong bearer token is 401; a declared or actual body
  over ``wire.MAX_BODY_BYTES`` is 413; garbage, an invalid mesh, another job's plan or another
  gpusPerPod is 400 with a message naming the problem; an epoch not newer than the held one is
  409; a good plan parses, and so does one with fields a newer operator added (kept, not refused);
- worker lifecycle: allowed transitions pass, forbidden ones raise; the pod state derived from
  workers' phases (failure dominates, slowest worker wins, mixed is reconfiguring);
- hang deadline: a worker that just reported a checkpoint step gets the save's grace; a worker
  whose watchdog last gave a progress limit (in a step or between two) counts as stopped after
  twice that limit (at least 2 s); in a data read, a save, or with no limit, the hang timeout decides;
- phase times: instants (``*_at``, ``*_unix``) and invalid values stay out of the durations;
- buddy copies: the pod holds the steps every one of its workers holds in the held epoch, newest
  first, at most four; none while a worker said nothing, or spoke of another epoch; a worker's
  message must list distinct steps, newest first, at most four;
- settings: read from an environment mapping with defaults from the spec; each missing or
  malformed variable is named in the error; spec fields a newer operator sends are ignored;
- worker environment: the agent's own plus the spec and pod name, one CPU thread for torch unless
  the pod's environment sets ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import json

import pytest
from agent_harness import JOB_UID, TOKEN, PodAddress, make_plan, make_spec

from megatron_contract import wire
from megatron_contract.agent import AgentState
from megatron_trainer.agent.lifecycle import LifecycleError, WorkerPhase, check_transition, pod_state
from megatron_trainer.agent.metrics import split_phase_times
from megatron_trainer.agent.plan_acceptance import (
    PlanRejected,
    check_declared_size,
    check_epoch,
    check_token,
    parse_plan,
)
from megatron_trainer.agent.reports import common_replica_steps
from megatron_trainer.agent.settings import DEFAULT_WORKER_COMMAND, AgentSettings, SettingsError, hang_timeout_for
from megatron_trainer.agent.supervisor import silence_allowed, stopped_silence, worker_environment
from megatron_trainer.channel import Alive, ReplicaSteps

PODS = [PodAddress("p0", "127.0.0.1"), PodAddress("p1", "127.0.0.2")]


def plan_bytes(**changes: object) -> bytes:
    doc = make_plan(make_spec(), PODS).to_wire()
    doc.update(changes)
    return json.dumps(doc).encode()


def rejected(call: object, *args: object, **kwargs: object) -> PlanRejected:
    with pytest.raises(PlanRejected) as info:
        call(*args, **kwargs)  # type: ignore[operator]
    return info.value


# -- token ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {wire.AUTH_HEADER: ""},
        {wire.AUTH_HEADER: TOKEN},
        {wire.AUTH_HEADER: f"Basic {TOKEN}"},
        {wire.AUTH_HEADER: "Bearer "},
        {wire.AUTH_HEADER: "Bearer wrong-token"},
        {wire.AUTH_HEADER: f"Bearer {TOKEN}x"},
    ],
    ids=["absent", "empty", "no-scheme", "basic", "bearer-empty", "wrong", "longer"],
)
def test_bad_token_is_401(headers: dict[str, str]) -> None:
    assert rejected(check_token, headers, TOKEN).status == 401


def test_good_token_passes_any_scheme_case() -> None:
    check_token({wire.AUTH_HEADER: f"Bearer {TOKEN}"}, TOKEN)
    check_token({wire.AUTH_HEADER: f"bearer {TOKEN}"}, TOKEN)


# -- size and shape -------------------------------------------------------------------------------


def test_oversized_body_is_413_declared_or_actual() -> None:
    assert rejected(check_declared_size, wire.MAX_BODY_BYTES + 1).status == 413
    check_declared_size(wire.MAX_BODY_BYTES)
    check_declared_size(None)
    big = b" " * (wire.MAX_BODY_BYTES + 1)
    assert rejected(parse_plan, big, job_uid=JOB_UID, gpus_per_pod=1).status == 413


@pytest.mark.parametrize(
    ("body", "expect"),
    [
        (b"", "empty body"),
        (b"{not json", "not a valid MeshPlan"),
        (b"[]", "not a valid MeshPlan"),
        (plan_bytes(epoch=0), "epoch"),
        (plan_bytes(surprise=1, epoch=0), "epoch"),
        (plan_bytes(sizes={"world": 3, "tp": 1, "pp": 1, "cp": 1, "dp": 2}), "world 3"),
        (plan_bytes(jobUid="someone-else"), "plan is for job someone-else"),
        (plan_bytes(gpusPerPod=2), "not a valid MeshPlan"),
    ],
    ids=["empty", "garbage", "array", "epoch0", "epoch0-unknown-field", "bad-world", "other-job", "bad-gpus"],
)
def test_malformed_plan_is_400(body: bytes, expect: str) -> None:
    refusal = rejected(parse_plan, body, job_uid=JOB_UID, gpus_per_pod=1)
    assert refusal.status == 400
    assert expect in refusal.reason


def test_a_plan_from_a_newer_operator_is_taken_with_its_unknown_fields() -> None:
    doc = json.loads(plan_bytes())
    doc["surprise"] = {"mode": "new"}
    doc["members"][0]["weight"] = 2
    plan = parse_plan(json.dumps(doc).encode(), job_uid=JOB_UID, gpus_per_pod=1)
    assert plan.model_extra == {"surprise": {"mode": "new"}} and plan.members[0].model_extra == {"weight": 2}
    assert plan.to_wire()["members"][0]["weight"] == 2  # forwarded to the workers as received


def test_plan_for_another_pod_size_is_400() -> None:
    refusal = rejected(parse_plan, plan_bytes(), job_uid=JOB_UID, gpus_per_pod=2)
    assert (refusal.status, "gpusPerPod 1" in refusal.reason) == (400, True)


def test_stale_epoch_is_409_and_newer_passes() -> None:
    plan = parse_plan(plan_bytes(epoch=3), job_uid=JOB_UID, gpus_per_pod=1)
    assert plan.epoch == 3
    assert rejected(check_epoch, plan, 3).status == 409
    assert rejected(check_epoch, plan, 7).status == 409
    check_epoch(plan, 2)


# -- lifecycle ------------------------------------------------------------------------------------


def test_transitions_follow_the_table() -> None:
    assert check_transition(WorkerPhase.STARTING, WorkerPhase.SPARE) is WorkerPhase.SPARE
    assert check_transition(WorkerPhase.TRAINING, WorkerPhase.RECONFIGURING) is WorkerPhase.RECONFIGURING
    for current, new in [
        (WorkerPhase.STARTING, WorkerPhase.TRAINING),  # no Hello yet
        (WorkerPhase.FAILED, WorkerPhase.TRAINING),  # a dead worker stays dead
        (WorkerPhase.SUCCEEDED, WorkerPhase.TRAINING),
    ]:
        with pytest.raises(LifecycleError, match=f"from {current.value} to {new.value}"):
            check_transition(current, new)


@pytest.mark.parametrize(
    ("phases", "state"),
    [
        ([], AgentState.STARTING),
        ([WorkerPhase.STARTING, WorkerPhase.SPARE], AgentState.STARTING),
        ([WorkerPhase.SPARE, WorkerPhase.SPARE], AgentState.SPARE),
        ([WorkerPhase.TRAINING, WorkerPhase.TRAINING], AgentState.TRAINING),
        ([WorkerPhase.TRAINING, WorkerPhase.RECONFIGURING], AgentState.RECONFIGURING),
        ([WorkerPhase.TRAINING, WorkerPhase.SPARE], AgentState.RECONFIGURING),
        ([WorkerPhase.TRAINING, WorkerPhase.SUCCEEDED], AgentState.TRAINING),
        ([WorkerPhase.SUCCEEDED, WorkerPhase.SUCCEEDED], AgentState.SUCCEEDED),
        ([WorkerPhase.SUCCEEDED, WorkerPhase.FAILED], AgentState.FAILED),
        ([WorkerPhase.TRAINING, WorkerPhase.FAILED], AgentState.FAILED),
    ],
)
def test_pod_state_from_worker_phases(phases: list[WorkerPhase], state: AgentState) -> None:
    assert pod_state(phases) is state


def test_a_checkpoint_step_allows_a_longer_silence() -> None:
    assert silence_allowed(13, last_step=7, checkpoint_interval_steps=10, checkpoint_grace_seconds=600) == 13
    assert silence_allowed(13, last_step=10, checkpoint_interval_steps=10, checkpoint_grace_seconds=600) == 613
    assert silence_allowed(13, last_step=0, checkpoint_interval_steps=10, checkpoint_grace_seconds=600) == 13
    assert silence_allowed(13, last_step=10, checkpoint_interval_steps=None, checkpoint_grace_seconds=600) == 13
    assert silence_allowed(13, last_step=None, checkpoint_interval_steps=10, checkpoint_grace_seconds=600) == 13


def test_an_asynchronous_save_gets_no_grace_but_the_final_save_does() -> None:
    """An asynchronous save holds the step only for its device-to-host copy: a worker silent past
    the hang timeout in one is stopped. The final save waits for the write whatever the setting."""
    kw = {"checkpoint_interval_steps": 10, "checkpoint_grace_seconds": 600, "final_step": 30}
    assert silence_allowed(13, last_step=10, synchronous_saves=False, **kw) == 13
    assert silence_allowed(13, last_step=30, synchronous_saves=False, **kw) == 613
    assert silence_allowed(13, last_step=10, synchronous_saves=True, **kw) == 613


def test_a_worker_silent_in_a_step_is_stopped_after_twice_its_progress_limit() -> None:
    assert stopped_silence(None) is None
    assert stopped_silence(Alive(epoch=1, phase="step", step_limit_seconds=3.0)) == 6.0
    assert stopped_silence(Alive(epoch=1, phase="step", step_limit_seconds=0.5)) == 2.0  # the minimum
    assert stopped_silence(Alive(epoch=1, phase="step")) is None  # first step: the collective timeout
    assert stopped_silence(Alive(epoch=1, phase="data", step_limit_seconds=1.0)) is None
    assert stopped_silence(Alive(epoch=1, phase="checkpoint", step_limit_seconds=1.0)) is None
    assert stopped_silence(Alive(epoch=1, step_limit_seconds=1.0)) == 2.0  # between two steps
    assert stopped_silence(Alive(epoch=1)) is None  # an aborted step unwinding


# -- metrics --------------------------------------------------------------------------------------


def test_phase_times_keep_instants_out_of_the_durations() -> None:
    durations, instants = split_phase_times(
        {"abort": 0.9, "rendezvous": 0.05, "detected_at_unix": 1795292183.9, "bogus": -1.0, "nan": float("nan")}
    )
    assert durations == {"abort": 0.9, "rendezvous": 0.05}
    assert instants == {"detected_at_unix": 1795292183.9}


# -- buddy copies ---------------------------------------------------------------------------------


def test_the_pod_holds_the_copies_every_worker_holds_in_the_epoch() -> None:
    def held(epoch: int, *steps: int) -> ReplicaSteps:
        return ReplicaSteps(epoch=epoch, steps=list(steps))

    assert common_replica_steps(3, [held(3, 8, 7), held(3, 7, 6)], 2) == [7]
    assert common_replica_steps(3, [held(3, 8, 7), held(3, 8, 7)], 2) == [8, 7]
    assert common_replica_steps(3, [held(3, 9, 7, 5, 3), held(3, 9, 8, 7, 5)], 2) == [9, 7, 5]
    assert common_replica_steps(3, [held(3, 8, 7), held(2, 8, 7)], 2) == [], "a copy of another epoch"
    assert common_replica_steps(3, [held(3, 8, 7), None], 2) == [], "a worker that said nothing yet"
    assert common_replica_steps(3, [held(3, 8, 7)], 2) == [], "a worker missing"
    assert common_replica_steps(3, [held(3, 8), held(3, 7)], 2) == []
    assert common_replica_steps(3, [held(3, 8, 7)], 1) == [8, 7]


@pytest.mark.parametrize(
    "steps", [[7, 8], [8, 8], [-1], [9, 8, 7, 6, 5]], ids=["oldest-first", "twice", "negative", "five"]
)
def test_a_workers_copies_must_be_distinct_steps_newest_first(steps: list[int]) -> None:
    with pytest.raises(ValueError):
        ReplicaSteps(epoch=1, steps=steps)


# -- settings -------------------------------------------------------------------------------------


def make_env(**changes: str | None) -> dict[str, str]:
    env = {
        wire.ENV_JOB_UID: JOB_UID,
        wire.ENV_JOB_TOKEN: TOKEN,
        wire.ENV_POD_NAME: "p0",
        wire.ENV_POD_IP: "127.0.0.5",
        wire.ENV_JOB_SPEC: json.dumps(make_spec(gpus_per_pod=2, tp=2, collective_timeout=12).to_wire()),
    }
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def test_hang_timeout_leaves_a_grace_after_the_collective_timeout() -> None:
    assert hang_timeout_for(make_spec(collective_timeout=8)) == 13
    assert hang_timeout_for(make_spec(collective_timeout=60)) == 75


def test_settings_defaults_come_from_the_spec() -> None:
    settings = AgentSettings.from_env(make_env())
    assert settings.gpus_per_pod == 2
    assert settings.hang_timeout_seconds == 12 + 5  # collective timeout plus a grace to abort and report
    assert AgentSettings.from_env(make_env(**{"MEGATRON_WORKER_HANG_TIMEOUT_SECONDS": "3"})).hang_timeout_seconds == 3
    assert settings.heartbeat_interval_seconds == 0.2
    assert (settings.agent_port, settings.rendezvous_port) == (wire.AGENT_PORT, wire.RENDEZVOUS_PORT)
    assert settings.worker_command == DEFAULT_WORKER_COMMAND
    assert settings.report_url is None
    assert TOKEN not in repr(settings)
    with_operator = AgentSettings.from_env(make_env(**{wire.ENV_OPERATOR_URL: "http://op:29500/"}))
    assert with_operator.report_url == "http://op:29500" + wire.OPERATOR_REPORT_PATH


def test_spec_fields_of_a_newer_operator_are_ignored(caplog: pytest.LogCaptureFixture) -> None:
    spec = json.loads(make_env()[wire.ENV_JOB_SPEC])
    spec["futureKnob"] = 3
    spec["training"]["futureSchedule"] = "x"
    settings = AgentSettings.from_env(make_env(**{wire.ENV_JOB_SPEC: json.dumps(spec)}))
    assert settings.gpus_per_pod == 2
    assert "spec.futureKnob, spec.training.futureSchedule" in caplog.text


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({wire.ENV_JOB_TOKEN: None}, wire.ENV_JOB_TOKEN),
        ({wire.ENV_JOB_UID: ""}, wire.ENV_JOB_UID),
        ({wire.ENV_POD_NAME: None}, wire.ENV_POD_NAME),
        ({wire.ENV_JOB_SPEC: None}, wire.ENV_JOB_SPEC),
        ({wire.ENV_JOB_SPEC: '{"replicas": 0}'}, wire.ENV_JOB_SPEC),
        ({wire.ENV_GPUS_PER_POD: "two"}, wire.ENV_GPUS_PER_POD),
        ({"MEGATRON_WORKER_COMMAND": '"python"'}, "MEGATRON_WORKER_COMMAND"),
        ({wire.ENV_HEARTBEAT_INTERVAL: "-1"}, "heartbeat_interval_seconds"),
    ],
)
def test_settings_errors_name_the_variable(changes: dict[str, str | None], named: str) -> None:
    with pytest.raises(SettingsError, match=named):
        AgentSettings.from_env(make_env(**changes))


def test_workers_get_one_cpu_thread_unless_the_pod_says_otherwise() -> None:
    env = worker_environment({"PATH": "/bin"}, '{"x": 1}', "pod-a")
    assert env == {
        "PATH": "/bin",
        wire.ENV_JOB_SPEC: '{"x": 1}',
        wire.ENV_POD_NAME: "pod-a",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    assert worker_environment({"OMP_NUM_THREADS": "8"}, "{}", "pod-a")["OMP_NUM_THREADS"] == "8"
