"""Real worker processes (gloo, TP 2, Megatron's distributed optimizer with buddy copies) restoring
the optimizer's shards in memory (worker/shard_restore.py) after a failure, exactly.

The test process plays agent and operator, and the plans come from the operator's own planner
(``megatron_operator.optimizer_sources``) with in-memory restore on, fed with the complete copies
each pod's workers reported (``ReplicaSteps``). Two pods of two workers (DP 2, TP 2; rank r's buddy
is the same TP rank of the other pod), every loss compared bit for bit with a reference run:

- SIGKILL of a worker of pod a with a spare pod: the spare takes pod a's ranks, their shards from
  the copies pod b keeps for them (the refresh in flight when the kill landed had delivered them:
  no step redone), and every loss equals a failure-free run;
- SIGSTOP instead (a hang): the survivors' watchdog reports it, the harness kills the stopped pod,
  then as above;
- a refresh interval of 2 and a kill in a step whose predecessor was not copied: the plan goes back
  to the newest complete copies (every rank restores from a host copy, its own or its buddy's) and
  redoes the step since, with the same losses;
- SIGKILL with no spare, then a pod returning: DP shrinks to 1 (pod b reshards its own shards and
  the copies it kept of pod a's into DP 1's layout, in memory), then grows back to 2 at a step
  boundary (pod b sends the returning pod the ranges it now owns). The reference does the same
  shrink and growth at the same steps through a synchronous checkpoint of each step, which the
  operator's planner uses when in-memory restore is off: the losses are equal bit for bit.

And one replica over two pods of one worker (PP 2, DP 1; each stage's buddy is the other stage):
the spare replacing pod b (stage 1) takes stage 1's shard from the copy pod a (stage 0) keeps,
relayed whole since pod a trains another stage; the losses equal a failure-free run.

Under a cost budget (``replicaCostPercent``), its calibrating refreshes made costly by DELAY faults
so that the ranks agree on refreshing every several steps, a kill after the agreement: the spare
takes pod a's shards from the newest complete copies, the steps since are redone, and every loss
equals the failure-free run.

Plans at step boundaries that keep every shard where it is (the same pods, twice): the survivors
adopt their own state, every loss equals the failure-free run; in particular each data-parallel
rank's parameters keep following the optimizer's all-gather (they once pointed at the previous
build's buffer, and the ranks drifted apart, each updating only its own shard).

Every step's samples are consumed exactly once (the sample log; a redone step counts in its final
epoch only).
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from worker_harness import (
    MakeCluster,
    WorkerCluster,
    failure_free_losses,
    fault_env,
    in_memory_plan,
    make_plan,
    make_spec,
)

from localcluster.chaos import check_history, read_samples
from megatron_contract.job import CheckpointSpec, MegatronJobSpec
from megatron_contract.mesh import MeshPlan, OptimizerSourceKind, PlanReason, StateSource, StateSourceKind
from megatron_trainer.channel import CollectiveFailed, Progress
from megatron_trainer.faults import Fault, FaultPlan, InjectionPoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TRAIN_ITERS = 10
FAULT_STEP = 3  # steps 0..2 are complete when the fault fires
FAULT_RANK = 1  # TP rank 1 of replica 0, on pod a


def shard_spec(
    checkpoint: Path, interval: int = 1, iters: int = TRAIN_ITERS, save_every: int = 1000
) -> MegatronJobSpec:
    spec = make_spec(replicas=2, spares=1, min_replicas=1, train_iters=iters, collective_timeout=8.0)
    wire = spec.to_wire()
    wire["training"]["optimizer"].update({"distributed": True, "replicaIntervalSteps": interval})
    wire["checkpoint"] = CheckpointSpec(path=str(checkpoint), interval_steps=save_every, async_save=False).to_wire()
    return MegatronJobSpec.model_validate(wire)


def faults(tmp_path: Path, fault: Fault) -> dict[str, str]:
    """``fault`` on FAULT_RANK in FAULT_STEP, after a second in its data read: gloo moves a message
    once both ends posted it, and these tiny steps could otherwise end before the buddy posted the
    receive of the refresh in flight (a real step is far longer)."""
    plan = (
        FaultPlan()
        .fail_at(rank=FAULT_RANK, step=FAULT_STEP, fault=Fault.DELAY, seconds=1.0, point=InjectionPoint.DATA_READ)
        .fail_at(rank=FAULT_RANK, step=FAULT_STEP, fault=fault)
    )
    return fault_env(tmp_path, plan)


def restored(cluster: WorkerCluster, pods: list[str], epoch: int) -> dict[str, tuple[int, str, int]]:
    """By worker: (step, source, steps redone) of its in-memory restore in ``epoch``."""
    out = {}
    for w in cluster.workers(pods):
        found = re.search(
            rf"epoch {epoch} rank \d+: optimizer shards of step (\d+) restored in memory \((\w+), (\d+) steps redone\)",
            w.log_path.read_text(),
        )
        assert found, f"{w.name} did not restore its shards in memory in epoch {epoch}:\n{w.log_tail()}"
        out[w.name] = (int(found[1]), found[2], int(found[3]))
    return out


def kill_pod_a_with_a_spare(cluster: WorkerCluster) -> tuple[MeshPlan, int]:
    """Pods a and b train with spare s ready until the injected SIGKILL of FAULT_RANK on pod a; the
    first plan and the step the survivors hold."""
    cluster.boot(["a", "b", "s"])
    first = cluster.plan(["a", "b"], buddies=True)
    cluster.assign(first, ["a", "b", "s"])
    cluster.fail_pod_on_injected_kill("a", FAULT_RANK, 120, survivors=["b"])
    return first, max(w.last_step() for w in cluster.workers(["b"]))


def check_samples(cluster: WorkerCluster, victims: set[str]) -> tuple[dict[int, int], list[int]]:
    problems, history, redone = check_history(
        read_samples(cluster.sample_dir),
        cluster.spec.training.train_iters,
        cluster.spec.training.global_batch_size,
        victims=victims,
    )
    assert problems == [], problems
    return history, redone


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Every step's loss in a failure-free run of the job on pods a and b."""
    work = tmp_path_factory.mktemp("reference")
    return failure_free_losses(shard_spec(work / "ckpt"), work)


@pytest.mark.parametrize("fault", [Fault.SIGKILL, Fault.SIGSTOP])
def test_spare_takes_the_lost_pods_shards_from_their_buddy_copies(
    tmp_path: Path, make_cluster: MakeCluster, reference_losses: dict[int, float], fault: Fault
) -> None:
    cluster = make_cluster(shard_spec(tmp_path / "ckpt"), tmp_path, faults(tmp_path, fault))
    cluster.boot(["a", "b", "s"])
    first = cluster.plan(["a", "b"], buddies=True)
    cluster.assign(first, ["a", "b", "s"])
    if fault is Fault.SIGKILL:
        cluster.fail_pod_on_injected_kill("a", FAULT_RANK, 120, survivors=["b"])
    else:
        cluster.wait_failed_reports(["b"], epoch=1)
        hung = cluster.pods["a"][FAULT_RANK]
        assert hung.process.poll() is None, "a stopped worker is alive but silent"
        cluster.kill_pod("a")  # the supervisor kills the hung worker
        assert hung.process.returncode == -signal.SIGKILL
    resume = max(w.last_step() for w in cluster.workers(["b"]))
    assert resume == FAULT_STEP
    plan = in_memory_plan(cluster, ["s", "b"], first, resume, PlanReason.REPLACE)
    state = plan.optimizer_state
    assert state is not None and state.source is OptimizerSourceKind.SELF
    # The spare's two ranks take pod a's shards from pod b's host copies, of the survivors' step.
    assert {(c.previous_rank, c.holder_rank, c.buddy, c.step) for c in state.copies} == {
        (0, 2, True, FAULT_STEP),
        (1, 3, True, FAULT_STEP),
    }
    cluster.assign(plan, ["s", "b"])
    cluster.wait_succeeded(["s", "b"])

    assert restored(cluster, ["s", "b"], 2) == {w.name: (FAULT_STEP, "self", 0) for w in cluster.workers(["s", "b"])}
    assert cluster.losses(["a", "b", "s"]) == reference_losses
    history, redone = check_samples(cluster, victims={"a"})
    assert redone == [], "no completed step is trained again"
    assert all(epoch == (1 if step < FAULT_STEP else 2) for step, epoch in history.items()), history


def test_a_kill_before_the_victims_update_tears_its_peers_update_and_their_shards_come_from_copies(
    tmp_path: Path, make_cluster: MakeCluster, reference_losses: dict[int, float]
) -> None:
    # Killed after every collective of its step but before its update: its data-parallel peer
    # (rank 3, pod b) passes its own commit check, writes its shard, and fails in the parameters'
    # all-gather the victim never joins. Its GPU state is then of no step.
    faulty = (
        FaultPlan()
        .fail_at(rank=FAULT_RANK, step=FAULT_STEP, fault=Fault.DELAY, seconds=1.0, point=InjectionPoint.DATA_READ)
        .fail_at(rank=FAULT_RANK, step=FAULT_STEP, fault=Fault.SIGKILL, point=InjectionPoint.BEFORE_UPDATE)
    )
    cluster = make_cluster(shard_spec(tmp_path / "ckpt"), tmp_path, fault_env(tmp_path, faulty))
    first, resume = kill_pod_a_with_a_spare(cluster)
    plan = in_memory_plan(cluster, ["s", "b"], first, resume, PlanReason.REPLACE)
    cluster.assign(plan, ["s", "b"])
    cluster.wait_succeeded(["s", "b"])

    [peer] = [w for w in cluster.workers(["b"]) if "its state is of no step" in w.log_path.read_text()]
    assert peer.name.endswith(f"/{FAULT_RANK}"), peer.name  # the victim's DP peer: same TP rank on pod b
    steps = {step for step, _source, _redone in restored(cluster, ["s", "b"], 2).values()}
    assert len(steps) == 1 and steps <= {resume, resume - 1}, steps
    assert cluster.losses(["a", "b", "s"]) == reference_losses
    check_samples(cluster, victims={"a"})


def test_a_kill_between_refreshes_goes_back_to_the_newest_complete_copies(
    tmp_path: Path, make_cluster: MakeCluster, reference_losses: dict[int, float]
) -> None:
    # Refreshes every 2 steps: the copies of step 2 are complete when the fault hits step 3.
    cluster = make_cluster(shard_spec(tmp_path / "ckpt", interval=2), tmp_path, faults(tmp_path, Fault.SIGKILL))
    first, resume = kill_pod_a_with_a_spare(cluster)
    assert resume == FAULT_STEP
    plan = in_memory_plan(cluster, ["s", "b"], first, resume, PlanReason.REPLACE)
    state = plan.optimizer_state
    assert state is not None and state.steps_redone == 1 and plan.resume_step == FAULT_STEP - 1
    # Every shard from a host copy of step 2: pod a's from b's buddy copies, b's from its own.
    assert {(c.previous_rank, c.holder_rank, c.buddy) for c in state.copies} == {
        (0, 2, True),
        (1, 3, True),
        (2, 2, False),
        (3, 3, False),
    }
    cluster.assign(plan, ["s", "b"])
    cluster.wait_succeeded(["s", "b"])

    assert restored(cluster, ["s", "b"], 2) == {
        w.name: (FAULT_STEP - 1, "self", 1) for w in cluster.workers(["s", "b"])
    }
    assert cluster.losses(["a", "b", "s"]) == reference_losses  # the redone step too
    history, redone = check_samples(cluster, victims={"a"})
    assert redone == [FAULT_STEP - 1], "exactly the step after the newest copies is trained again"
    assert history[FAULT_STEP - 1] == 2


BUDGET_ITERS = 32
BUDGET_FAULT_STEP = 27  # past the agreement at step 20 (worker/copy_schedule.py), between refreshes mostly


def test_under_a_cost_budget_a_kill_after_the_agreement_is_recovered_exactly(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    wire = shard_spec(tmp_path / "ckpt", iters=BUDGET_ITERS).to_wire()
    wire["training"]["optimizer"]["replicaCostPercent"] = 50
    spec = MegatronJobSpec.model_validate(wire)
    reference = failure_free_losses(shard_spec(tmp_path / "ref-ckpt", iters=BUDGET_ITERS), tmp_path / "reference")
    plan_faults = FaultPlan()
    for step in (4, 8, 12, 16):  # each step beside a calibrating refresh 0.6 s longer: an interval of several
        plan_faults.fail_at(rank=0, step=step, fault=Fault.DELAY, seconds=0.6, point=InjectionPoint.DATA_READ)
    plan_faults.fail_at(
        rank=FAULT_RANK, step=BUDGET_FAULT_STEP, fault=Fault.DELAY, seconds=1.0, point=InjectionPoint.DATA_READ
    ).fail_at(rank=FAULT_RANK, step=BUDGET_FAULT_STEP, fault=Fault.SIGKILL)
    cluster = make_cluster(spec, tmp_path / "run", fault_env(tmp_path, plan_faults))
    first, resume = kill_pod_a_with_a_spare(cluster)
    assert resume == BUDGET_FAULT_STEP
    agreed = {
        int(n)
        for w in cluster.workers(["b"])
        for n in re.findall(
            r"epoch 1 rank \d+: buddy copies every (\d+) steps "
            r"from step 20 \(agreed",
            w.log_path.read_text(),
        )
    }
    assert len(agreed) == 1, agreed
    [interval] = agreed
    plan = in_memory_plan(cluster, ["s", "b"], first, resume, PlanReason.REPLACE)
    state = plan.optimizer_state
    assert state is not None and state.source is OptimizerSourceKind.SELF
    # Back to the newest complete copies: at most an interval old, or two when the refresh after it
    # was in flight.
    assert 0 <= state.steps_redone < 2 * interval and plan.resume_step == resume - state.steps_redone
    cluster.assign(plan, ["s", "b"])
    cluster.wait_succeeded(["s", "b"])

    assert cluster.losses(["a", "b", "s"]) == reference  # the redone steps too
    _, redone = check_samples(cluster, victims={"a"})
    assert redone == list(range(plan.resume_step, resume)), (redone, interval)


GROW_AT = 7  # the step boundary at which the returning pod joins


def shrink_then_grow(cluster: WorkerCluster, in_memory: bool) -> None:
    """Pod a dies in FAULT_STEP, pod b trains alone from there, pod c joins at GROW_AT: with the
    shards moved in memory, or (the reference) through the checkpoints of those steps."""
    cluster.boot(["a", "b", "c"])
    first = cluster.plan(["a", "b"], buddies=True)
    cluster.assign(first, ["a", "b"])
    cluster.fail_pod_on_injected_kill("a", FAULT_RANK, 120, survivors=["b"])
    resume = max(w.last_step() for w in cluster.workers(["b"]))
    assert resume == FAULT_STEP
    if in_memory:
        shrink = in_memory_plan(cluster, ["b"], first, resume, PlanReason.SHRINK)
        state = shrink.optimizer_state
        assert state is not None and state.source is OptimizerSourceKind.RESHARD
        assert {(c.previous_rank, c.holder_rank) for c in state.copies} == {(0, 0), (1, 1)}
    else:
        shrink = from_checkpoint(cluster, ["b"], resume, PlanReason.SHRINK)
    assert shrink.sizes.dp == 1
    cluster.assign(shrink, ["b"])
    cluster.wait_steps(["b"], FAULT_STEP + 1)
    assert max(w.last_step() for w in cluster.workers(["b"])) < GROW_AT, "too fast for the test"
    if in_memory:
        grow = in_memory_plan(cluster, ["b", "c"], shrink, GROW_AT, PlanReason.GROW)
        state = grow.optimizer_state
        assert state is not None and state.source is OptimizerSourceKind.RESHARD and not state.copies
    else:
        # The boundary's checkpoint is written before the epoch is left (synchronous saves).
        grow = from_checkpoint(cluster, ["b", "c"], GROW_AT, PlanReason.GROW)
    cluster.assign(grow, ["b", "c"])
    cluster.wait_succeeded(["b", "c"])


def from_checkpoint(cluster: WorkerCluster, pods: list[str], step: int, reason: PlanReason) -> MeshPlan:
    """A plan whose ranks all load the checkpoint of ``step``."""
    world = len(pods) * cluster.spec.gpus_per_pod
    sources = {r: StateSource(rank=r, kind=StateSourceKind.CHECKPOINT, checkpoint_step=step) for r in range(world)}
    return make_plan(
        cluster.spec, cluster.epoch + 1, pods, cluster.store_port, resume_step=step, reason=reason, sources=sources
    )


def test_shrink_and_growth_reshard_in_memory_as_the_checkpoint_would(tmp_path: Path, make_cluster: MakeCluster) -> None:
    reference = make_cluster(
        shard_spec(tmp_path / "ref-ckpt", save_every=1),
        tmp_path / "reference",
        faults(tmp_path / "reference", Fault.SIGKILL),
    )
    shrink_then_grow(reference, in_memory=False)
    expected = reference.losses(["a", "b", "c"])
    assert sorted(expected) == list(range(1, TRAIN_ITERS + 1))

    cluster = make_cluster(shard_spec(tmp_path / "ckpt"), tmp_path / "run", faults(tmp_path / "run", Fault.SIGKILL))
    shrink_then_grow(cluster, in_memory=True)
    assert restored(cluster, ["b"], 2) == {w.name: (FAULT_STEP, "reshard", 0) for w in cluster.workers(["b"])}
    assert restored(cluster, ["b", "c"], 3) == {w.name: (GROW_AT, "reshard", 0) for w in cluster.workers(["b", "c"])}
    assert cluster.losses(["a", "b", "c"]) == expected
    history, redone = check_samples(cluster, victims={"a"})
    assert redone == []
    assert [history[s] for s in (FAULT_STEP - 1, FAULT_STEP, GROW_AT - 1, GROW_AT)] == [1, 2, 2, 3]
    # The newcomer received its shard's ranges; the reshard says what it held at its peak.
    for w in cluster.workers(["c"]):
        received = re.search(
            r"epoch 3 rank \d+: .* restored in memory .*: (\d+) bytes received", w.log_path.read_text()
        )
        assert received and int(received[1]) > 0, w.name
    assert not any(w.of_type(CollectiveFailed) for w in cluster.workers(["c"]))


def test_a_shard_held_by_another_pipeline_stage_is_relayed_to_the_replacement(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    def pp2(checkpoint: Path) -> MegatronJobSpec:
        wire = shard_spec(checkpoint).to_wire()
        wire.update({"tp": 1, "pp": 2, "gpusPerPod": 1, "replicas": 1, "minReplicas": 1})
        wire["model"]["numLayers"] = 4
        return MegatronJobSpec.model_validate(wire)

    expected = failure_free_losses(pp2(tmp_path / "ref-ckpt"), tmp_path / "reference")
    stage1 = 1  # pod b's only worker
    plan_faults = (
        FaultPlan()
        .fail_at(rank=stage1, step=FAULT_STEP, fault=Fault.DELAY, seconds=1.0, point=InjectionPoint.DATA_READ)
        .fail_at(rank=stage1, step=FAULT_STEP, fault=Fault.SIGKILL)
    )
    cluster = make_cluster(pp2(tmp_path / "ckpt"), tmp_path / "run", fault_env(tmp_path, plan_faults))
    cluster.boot(["a", "b", "s"])
    first = cluster.plan(["a", "b"], buddies=True)
    assert first.buddy_of(1) == 0
    cluster.assign(first, ["a", "b", "s"])
    cluster.fail_pod_on_injected_kill("b", 0, 120, survivors=["a"])
    resume = max(w.last_step() for w in cluster.workers(["a"]))
    assert resume == FAULT_STEP
    plan = in_memory_plan(cluster, ["a", "s"], first, resume, PlanReason.REPLACE)
    state = plan.optimizer_state
    assert state is not None
    assert [(c.previous_rank, c.holder_rank, c.buddy) for c in state.copies] == [(1, 0, True)]
    cluster.assign(plan, ["a", "s"])
    cluster.wait_succeeded(["a", "s"])

    assert restored(cluster, ["a", "s"], 2) == {w.name: (FAULT_STEP, "self", 0) for w in cluster.workers(["a", "s"])}
    assert cluster.losses(["a", "b", "s"]) == expected
    _, redone = check_samples(cluster, victims={"b"})
    assert redone == []


def test_plans_that_keep_every_shard_in_place_train_on_unchanged(
    tmp_path: Path, make_cluster: MakeCluster, reference_losses: dict[int, float]
) -> None:
    boundaries = (3, 6)
    hold = FaultPlan()  # every rank dwells in the step before each boundary while the plan arrives
    for boundary in boundaries:
        for rank in range(4):
            hold = hold.fail_at(rank=rank, step=boundary - 1, fault=Fault.DELAY, seconds=2.0, epoch=boundary // 3)
    cluster = make_cluster(shard_spec(tmp_path / "ckpt"), tmp_path, fault_env(tmp_path, hold))
    cluster.boot(["a", "b"])
    cluster.assign(cluster.plan(["a", "b"], buddies=True))
    for boundary in boundaries:
        cluster.wait_steps(["a", "b"], boundary - 1)
        assert max(w.last_step() for w in cluster.workers()) < boundary, "too fast for the test"
        cluster.assign(cluster.plan(["a", "b"], resume_step=boundary, reason=PlanReason.MIGRATE, buddies=True))
    cluster.wait_succeeded(["a", "b"])
    assert cluster.losses(["a", "b"]) == reference_losses
    epochs = {p.step: p.epoch for w in cluster.workers() for p in w.of_type(Progress)}
    assert [epochs[s] for s in (3, 4, 6, 7, TRAIN_ITERS)] == [1, 2, 2, 3, 3]
