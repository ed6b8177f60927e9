"""Buddy copies of the distributed optimizer's shards kept by the training loop of real worker
processes on CPU/gloo (worker/training_loop.py, worker/buddy_copies.py).

Scenario, on three meshes: three pods of one worker each (DP 3, TP 1: the buddies form a ring,
rank r's buddy is r+1 and its ward r-1, so a copy sent the wrong way round lands on the wrong
rank); two pods of two workers (DP 2, TP 2: each rank's buddy is the same tensor-parallel rank of
the other pod); two pods of one worker (DP 1, PP 2: one replica over both pods, each rank's buddy
the other pipeline stage, whose shards have other sizes). With ``replicaIntervalSteps`` 1, every
step's refresh is logged by every rank (``MEGATRON_WORKER_COPY_LOG``): its optimizer shards read
anew at the step, and, once the refresh finished, its own snapshot and its ward's copy. Each ward
copy equals, element for element, the shards its ward had after that step; every loss equals a run
of the same job without copies, bit for bit; each worker tells its agent the complete copies it
holds after every refresh, two generations at most, newest first. The epoch's log line names
buddy, ward and interval, and the host memory of the rank's own snapshots.

Second scenario (three pods of one worker): ``replicaIntervalSteps`` 2, and a plan of the same pods
that takes over at a step boundary (epoch 2). The refresh in flight at the boundary completes
before the epoch is left; epoch 2 starts with no copies and refreshes at its own even steps, each
ward copy again its ward's shards.

Third scenario (three pods of one worker, interval 1): the worker of pod c is SIGKILLed in step 3,
after the refreshes of steps 1 and 2 completed and while that of step 3 is in flight. It first
dwells a second in the step's data read: gloo moves a message once both ends have posted it, and
the tiny steps on shared cores may otherwise end it before its buddy posted the receive (a real
step is far longer than that). The survivors leave the epoch and report the failed collective
(nothing hangs on the copies); before that each says it holds the copies of step 3 too, the
ward's copy having arrived: no completed step is lost.

Fourth scenario (three pods of one worker, interval 1, ``replicaCostPercent`` 50): the epoch
calibrates first (refreshes after step 1, before the calibration, then after steps 4, 8, 12 and 16
only), a DELAY fault on one rank making each
step beside such a refresh 0.6 s longer, then every rank proposes an interval and all adopt the
largest: each logs the same agreed interval, at least 2 (0.6 s a refresh cannot fit in half of any
step of this tiny model), which is the fewest steps its own measurements allow; the copies held
after the agreement are of its multiples only; the losses equal a run without copies.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from worker_harness import MakeCluster, WorkerCluster, fault_env, make_spec, wait_for

from megatron_contract.job import CheckpointSpec, MegatronJobSpec
from megatron_contract.mesh import MeshPlan, PlanReason
from megatron_trainer.channel import CollectiveFailed, CopyInterval, ReplicaSteps
from megatron_trainer.faults import Fault, FaultPlan, InjectionPoint
from megatron_trainer.worker.buddy_copies import buddy_and_ward
from megatron_trainer.worker.refresh_times import logged
from megatron_trainer.worker.settings import ENV_COPY_LOG

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PODS = ["a", "b", "c"]
TRAIN_ITERS = 4

# (pods, GPUs per pod, tp, pp)
MESHES = {"ring-dp3": (3, 1, 1, 1), "tp2-dp2": (2, 2, 2, 1), "pp2-dp1": (2, 1, 1, 2)}


def buddy_spec(
    checkpoint: Path,
    interval: int = 1,
    train_iters: int = TRAIN_ITERS,
    mesh: tuple[int, int, int, int] = (3, 1, 1, 1),
    cost_percent: float | None = None,
) -> MegatronJobSpec:
    """The mesh's replicas, the distributed optimizer (it needs a checkpoint path; saves are rarer
    than the job is long)."""
    pods, gpus, tp, pp = mesh
    replicas = pods * gpus // (tp * pp)
    spec = make_spec(replicas=replicas, min_replicas=replicas, tp=tp, gpus_per_pod=gpus, train_iters=train_iters)
    wire = spec.to_wire()
    wire["pp"] = pp
    wire["model"]["numLayers"] = 2 * pp
    wire["training"]["globalBatchSize"] = 6
    wire["training"]["optimizer"].update({"distributed": True, "replicaIntervalSteps": interval})
    if cost_percent is not None:
        wire["training"]["optimizer"]["replicaCostPercent"] = cost_percent
    wire["checkpoint"] = CheckpointSpec(path=str(checkpoint), interval_steps=1000).to_wire()
    return MegatronJobSpec.model_validate(wire)


def train(cluster: WorkerCluster, pods: list[str], buddies: bool) -> MeshPlan:
    cluster.boot(pods)
    plan = cluster.plan(pods, buddies=buddies)
    assert (plan.optimizer_state is not None) == buddies
    cluster.assign(plan)
    cluster.wait_succeeded(pods)
    return plan


def load(path: Path) -> dict[str, object]:
    assert path.exists(), f"{path.name} was not logged"
    return torch.load(path)


def tensors(logged: object) -> list[torch.Tensor]:
    assert isinstance(logged, list) and logged and all(isinstance(t, torch.Tensor) for t in logged)
    return logged


def same(a: object, b: object) -> bool:
    x, y = tensors(a), tensors(b)
    return len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y, strict=True))


def check_copies(logs: Path, plan: MeshPlan, steps: list[int]) -> None:
    """Every rank's copies of each of ``steps``: its own shards and its ward's."""
    for rank in range(plan.sizes.world):
        pair = buddy_and_ward(plan, rank)
        assert pair is not None
        ward = pair[1]
        for step in steps:
            copies = load(logs / f"copies-{rank}-{step}.pt")
            assert copies["ward_rank"] == ward
            assert same(copies["own"], load(logs / f"state-{rank}-{step}.pt")["shards"]), (rank, step)
            assert same(copies["ward"], load(logs / f"state-{ward}-{step}.pt")["shards"]), (rank, step)
        # The shards change every step: the comparisons above could not pass with a stale copy.
        first, second = steps[:2]
        assert not same(
            load(logs / f"state-{rank}-{first}.pt")["shards"], load(logs / f"state-{rank}-{second}.pt")["shards"]
        )


@pytest.mark.parametrize("mesh", list(MESHES.values()), ids=list(MESHES))
def test_every_step_each_ward_copy_is_its_wards_shard_and_losses_are_unchanged(
    tmp_path: Path, make_cluster: MakeCluster, mesh: tuple[int, int, int, int]
) -> None:
    pods = PODS[: mesh[0]]
    logs = tmp_path / "copies"
    logs.mkdir()
    with_copies = make_cluster(
        buddy_spec(tmp_path / "ckpt", mesh=mesh), tmp_path / "buddies", {ENV_COPY_LOG: str(logs)}
    )
    plan = train(with_copies, pods, buddies=True)
    without = make_cluster(buddy_spec(tmp_path / "ref-ckpt", mesh=mesh), tmp_path / "reference")
    train(without, pods, buddies=False)
    losses = with_copies.losses(pods)
    assert sorted(losses) == list(range(1, TRAIN_ITERS + 1))
    assert losses == without.losses(pods), "the copies changed training"

    check_copies(logs, plan, list(range(1, TRAIN_ITERS + 1)))
    if plan.sizes.pp > 1:  # the stages' shards differ in size: the ward's shapes were learnt, not assumed
        own = [tensors(load(logs / f"copies-{r}-1.pt")["own"]) for r in range(plan.sizes.world)]
        assert len({tuple(t.shape for t in shards) for shards in own}) > 1
    for worker in with_copies.workers():
        held = [(m.epoch, m.steps) for m in worker.of_type(ReplicaSteps)]
        # Started after step 1 (nothing complete yet), each finished after the next step (the
        # start then drops the older of two generations), the last one once training ended.
        assert held == [(1, []), (1, [1]), (1, [2]), (1, [3]), (1, [4, 3])], worker.name
    assert not any(w.of_type(ReplicaSteps) for w in without.workers()), "no copies when the plan asks for none"
    for rank, worker in enumerate(with_copies.workers()):
        # The epoch's log line gives the host memory of its own snapshots, both generations.
        snapshot = sum(t.numel() * t.element_size() for t in tensors(load(logs / f"copies-{rank}-1.pt")["own"]))
        buddy, ward = buddy_and_ward(plan, rank) or (-1, -1)
        line = f"buddy copies every 1 steps, sent to rank {buddy}, kept for rank {ward}: host memory"
        text = worker.log_path.read_text()
        assert line in text and f"({2 * snapshot} bytes) for 2 generations" in text, worker.name
        # As the epoch ends, where its refreshes spent their time: own snapshot and ward's copy, each
        # the snapshot's size here (the ward sits at the same model-parallel position in these meshes
        # with one pipeline stage).
        [times] = [line for line in logged(text) if line.epoch == 1]
        assert times.refreshes == TRAIN_ITERS and times.first_step == 1, times
        fields = times.first
        assert fields["host_s"] > 0 and fields["exchange_s"] > 0 and times.others, times
        if plan.sizes.pp == 1:
            assert fields["bytes_to_host"] == 2 * snapshot, fields


def test_a_new_epoch_at_a_step_boundary_starts_fresh_copies_every_interval(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    iters = 12
    logs = tmp_path / "copies"
    logs.mkdir()
    spec = buddy_spec(tmp_path / "ckpt", interval=2, train_iters=iters)
    cluster = make_cluster(spec, tmp_path / "run", {ENV_COPY_LOG: str(logs)})
    cluster.boot(PODS)
    plan = cluster.plan(PODS, buddies=True)
    cluster.assign(plan)
    cluster.wait_steps(PODS, 2)
    boundary = max(w.last_step() for w in cluster.workers()) + 2
    assert boundary < iters - 2, "too fast for the test: epoch 2 would not refresh twice"
    cluster.assign(cluster.plan(PODS, resume_step=boundary, reason=PlanReason.MIGRATE, buddies=True))
    cluster.wait_succeeded(PODS)

    last_even = boundary - boundary % 2
    for worker in cluster.workers():
        held = [(m.epoch, m.steps) for m in worker.of_type(ReplicaSteps)]
        first = [steps for epoch, steps in held if epoch == 1]
        second = [steps for epoch, steps in held if epoch == 2]
        assert held == [(1, s) for s in first] + [(2, s) for s in second], worker.name
        # Epoch 1 refreshed at its even steps; the last one was finished before it was left.
        assert first[-1] == [last_even, last_even - 2] if last_even >= 4 else [2], (worker.name, first)
        # Epoch 2 began with nothing: its first refresh is its first even step past the boundary.
        assert second[0] == [], (worker.name, second)
        assert all(s > boundary for steps in second for s in steps), (worker.name, second)
        assert second[-1] == [iters, iters - 2], (worker.name, second)
    check_copies(logs, plan, list(range(2, iters + 1, 2)))
    assert not list(logs.glob("copies-*-3.pt")), "a refresh at an odd step"


def test_a_pod_lost_during_a_refresh_loses_no_copy_it_sent_and_nothing_hangs(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    faults = (
        FaultPlan()  # in step 3: steps 0-2 are done
        .fail_at(rank=2, step=3, fault=Fault.DELAY, seconds=1.0, point=InjectionPoint.DATA_READ)
        .fail_at(rank=2, step=3, fault=Fault.SIGKILL)
    )
    cluster = make_cluster(buddy_spec(tmp_path / "ckpt", train_iters=8), tmp_path, fault_env(tmp_path, faults))
    cluster.boot(PODS)
    cluster.assign(cluster.plan(PODS, buddies=True))
    cluster.fail_pod_on_injected_kill("c", 0, timeout=120, survivors=["a", "b"])
    for worker in cluster.workers(["a", "b"]):
        assert [m.epoch for m in worker.of_type(CollectiveFailed)] == [1], worker.name
        held = [(m.epoch, m.steps) for m in worker.of_type(ReplicaSteps)]
        assert held == [(1, []), (1, [1]), (1, [2]), (1, [3, 2])], worker.name
        # Then it waits for the next plan (its status follows the report).
        wait_for(lambda w=worker: w.states()[-1] == "reconfiguring", 30, f"{worker.name} waiting for a plan")


AGREED = re.compile(
    r"epoch 1 rank (\d+): buddy copies every (\d+) steps from step 20 \(agreed; this rank proposed (\d+): a "
    r"refresh cost ([\d.]+) s beside a ([\d.]+) s step, 4 refreshes measured, the longest ended after (\d+) steps; "
    r"budget 50 %\)"
)


def test_with_a_cost_budget_the_ranks_calibrate_and_agree_on_one_interval(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    iters = 40
    faults = FaultPlan()
    for step in (4, 8, 12, 16):  # the steps that make counts 5, 9, 13 and 17: each beside a refresh
        faults.fail_at(rank=1, step=step, fault=Fault.DELAY, seconds=0.6, point=InjectionPoint.DATA_READ)
    spec = buddy_spec(tmp_path / "ckpt", train_iters=iters, cost_percent=50)
    cluster = make_cluster(spec, tmp_path / "budget", fault_env(tmp_path, faults))
    plan = train(cluster, PODS, buddies=True)
    assert plan.optimizer_state is not None and plan.optimizer_state.replica_cost_percent == 50
    without = make_cluster(buddy_spec(tmp_path / "ref-ckpt", train_iters=iters), tmp_path / "reference")
    train(without, PODS, buddies=False)
    assert cluster.losses(PODS) == without.losses(PODS), "the copies changed training"

    found = {}
    for worker in cluster.workers():
        [match] = AGREED.findall(worker.log_path.read_text())
        rank, agreed, proposed, cost, step, took = match
        found[int(rank)] = (int(agreed), int(proposed))
        # Its proposal is the fewest steps within budget by what it measured (logged rounded).
        assert float(cost) >= 0.3, (worker.name, match)
        by_cost = math.ceil(float(cost) / (0.5 * float(step)) - 1e-3)
        assert int(proposed) in range(max(by_cost, int(took), 1), max(by_cost + 1, int(took), 1) + 1), match
    agreed = {a for a, _ in found.values()}
    assert len(agreed) == 1, found
    [n] = agreed
    assert n == max(p for _, p in found.values()) and n >= 2, found
    for rank, worker in enumerate(cluster.workers()):
        # Its agent hears of it too (for its metrics).
        [told] = worker.of_type(CopyInterval)
        assert (told.epoch, told.interval, told.from_step, told.proposed) == (1, n, 20, found[rank][1]), told
        steps = {s for m in worker.of_type(ReplicaSteps) for s in m.steps}
        assert {s for s in steps if s < 20} <= {1, 4, 8, 12, 16}, (worker.name, sorted(steps))
        assert all(s % n == 0 for s in steps if s >= 20), (worker.name, n, sorted(steps))
        if 20 + n <= iters:
            assert any(s > 20 for s in steps), (worker.name, n, sorted(steps))
