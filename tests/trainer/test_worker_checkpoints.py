"""Asynchronous, atomic, verified checkpoints, with real worker processes (gloo, Megatron-Core GPT, TP=2).

The test process plays agent and operator (see ``worker_harness``). A gate directory
(``MEGATRON_CHECKPOINT_WRITER_GATE``) holds a save's writer until the test lets it write: slow
storage, made deterministic. Scenarios:

- an asynchronous save overlaps training: while the writer of step 2 is held, the workers train
  on past step 4, the save due at step 4 is skipped and reported (never stacked), no directory
  of step 2 is complete and nothing is reported saved; once released, step 2 is published and
  reported; at the end only the ``keep`` newest checkpoints are left, nothing partial, and every
  file matches its size and sha256 in the manifest, which names step, mesh and config hash;
- a pod SIGKILLed while its writer is writing: no process of its process groups survives (the
  forked writers and the results manager included), the partial checkpoint is never complete,
  and a spare restores the previous checkpoint and recomputes every later step's loss bit for bit;
- damaged checkpoints on restore: a truncated file is rejected (reported) and the next older
  checkpoint restored, training then matches the undamaged run bit for bit; a checkpoint with no
  manifest and one with a flipped bit are both rejected, and after these two failures the worker
  stops (fails, naming both) instead of trying further;
- a re-mesh during a save (a DP peer SIGKILLed while the writers are held): the survivors abandon
  the save (never reported, its partial directory deleted later) and the saves of the new epoch
  complete, with the new mesh in their manifests;
- resharded restore: a checkpoint written at TP2xDP2 restored at TP2xDP1 and at TP1xDP1, one
  written at TP2xDP1 restored at TP2xDP2 (fully parallel load); the next step's loss equals the
  uninterrupted run's bit for bit, the one after to rounding (its gradients were summed over
  another layout);
- a write that fails (injected through the gate) is reported as failed, never as saved, and
  training goes on; the next save completes and the failed one's partial directory is deleted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from worker_harness import MakeCluster, WorkerCluster, make_spec, wait_for

from megatron_contract.job import CheckpointSpec, MegatronJobSpec
from megatron_contract.mesh import PlanReason, StateSource, StateSourceKind
from megatron_trainer.channel import CheckpointProblem, CheckpointSaved, Progress, WorkerStatus
from megatron_trainer.worker.checkpoint import ENV_WRITER_GATE
from megatron_trainer.worker.checkpoint_files import (
    MANIFEST,
    PARTIAL_PREFIX,
    checkpoint_dir,
    complete_steps,
    partial_dir,
    verify_files,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def checkpointed_spec(root: Path, iters: int, interval: int, keep: int) -> MegatronJobSpec:
    spec = make_spec(spares=1, replicas=1, min_replicas=1, train_iters=iters)
    return spec.model_copy(update={"checkpoint": CheckpointSpec(path=str(root), interval_steps=interval, keep=keep)})


def open_gate(gate: Path, *steps: int) -> None:
    for step in steps:
        (gate / str(step)).touch()


def saved_steps(cluster: WorkerCluster, pod: str) -> list[int]:
    """Steps reported saved by every worker of ``pod`` (each rank reports each checkpoint)."""
    per_worker = [[m.step for m in w.of_type(CheckpointSaved)] for w in cluster.workers([pod])]
    assert all(s == per_worker[0] for s in per_worker), per_worker
    return per_worker[0]


def group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            members.append(int(entry.name))
    return members


def checkpoint_sources(spec: MegatronJobSpec, step: int) -> dict[int, StateSource]:
    return {
        r: StateSource(rank=r, kind=StateSourceKind.CHECKPOINT, checkpoint_step=step) for r in range(spec.gpus_per_pod)
    }


def test_async_save_overlaps_training_skips_instead_of_stacking_and_keeps_the_newest(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    root, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    iters, interval, keep = 10, 2, 2
    spec = checkpointed_spec(root, iters, interval, keep)
    cluster = make_cluster(spec, tmp_path / "run", {ENV_WRITER_GATE: str(gate)})
    cluster.boot(["a"])
    cluster.assign(cluster.plan(["a"]))

    cluster.wait_steps(["a"], 5)  # training went on while the writer of step 2 waits
    assert partial_dir(root, 2).is_dir() and not checkpoint_dir(root, 2).exists()
    assert saved_steps(cluster, "a") == []
    for w in cluster.workers(["a"]):
        wait_for(lambda w=w: w.of_type(CheckpointProblem), 30, f"{w.name} to report the skipped save")
        skipped = w.of_type(CheckpointProblem)[0]
        assert (skipped.kind, skipped.step) == ("skipped", 4) and "step 2" in skipped.detail

    open_gate(gate, *range(interval, iters + 1, interval))
    cluster.wait_succeeded(["a"])
    saved = saved_steps(cluster, "a")
    assert saved[0] == 2 and saved[-1] == iters and saved == sorted(set(saved))
    # Reported only once complete: every reported step was a complete checkpoint at some point,
    # and the newest `keep` of them are what is left.
    assert complete_steps(root) == sorted(saved, reverse=True)[:keep]
    assert not [p.name for p in root.iterdir() if p.name.startswith((PARTIAL_PREFIX, ".retired"))]
    for step in complete_steps(root):
        manifest = json.loads((checkpoint_dir(root, step) / MANIFEST).read_text())
        assert manifest["step"] == step
        assert manifest["mesh"] == {"world": 2, "tp": 2, "pp": 1, "cp": 1, "dp": 1, "ep": 1}
        assert len(manifest["config_hash"]) == 16
        assert any(name.endswith(".distcp") for name in manifest["files"])
        on_disk = {p.name for p in checkpoint_dir(root, step).iterdir()} - {MANIFEST}
        assert on_disk == set(manifest["files"])
        verify_files(checkpoint_dir(root, step), manifest, manifest["files"])
    blocking = [m.blocking_seconds for m in cluster.pods["a"][0].of_type(CheckpointSaved)]
    assert all(b is not None and b >= 0 for b in blocking)


def test_pod_killed_during_a_save_leaves_no_process_and_the_previous_checkpoint_usable(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    root, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    open_gate(gate, 2)  # the save of step 2 completes; the save of step 4 is held mid-way
    iters = 12
    spec = checkpointed_spec(root, iters=iters, interval=2, keep=2)
    cluster = make_cluster(spec, tmp_path / "run", {ENV_WRITER_GATE: str(gate)})
    cluster.boot(["a", "s"])
    cluster.assign(cluster.plan(["a"]), ["a"])
    for w in cluster.workers(["a"]):
        wait_for(lambda w=w: w.of_type(CheckpointSaved), 120, f"{w.name} to report the checkpoint of step 2")
    held = wait_for(lambda: sorted(root.glob(f"{PARTIAL_PREFIX}*")), 120, "a save after step 2 to start")
    assert complete_steps(root) == [2] and len(held) == 1

    leaders = [w.process.pid for w in cluster.workers(["a"])]
    helpers = [m for pid in leaders for m in group_members(pid) if m != pid]
    assert helpers, "each worker's group holds its writer and the writers' manager while a save runs"
    cluster.kill_pod("a")
    for pid in leaders:
        wait_for(lambda pid=pid: not group_members(pid), 10, f"every process of worker group {pid} to end")
    open_gate(gate, *range(4, iters + 1, 2))  # nothing is left to write the partial checkpoint
    assert complete_steps(root) == [2] and held[0].is_dir()

    plan = cluster.plan(["s"], resume_step=2, reason=PlanReason.REPLACE, sources=checkpoint_sources(spec, 2))
    cluster.assign(plan, ["s"])
    cluster.wait_succeeded(["s"])
    # Steps 3.. were computed by "a" before the kill and again by "s": losses() requires equality.
    losses = cluster.losses(["a", "s"])
    assert sorted(losses) == list(range(1, iters + 1))
    redone = sorted({p.step for w in cluster.workers(["s"]) for p in w.of_type(Progress)})
    assert redone[0] == 3


def test_damaged_checkpoints_are_rejected_the_older_one_restored_and_two_failures_stop(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    root = tmp_path / "ckpt"
    iters = 8
    # Synchronous saves, so that every due checkpoint exists (none skipped).
    checkpoints = CheckpointSpec(path=str(root), interval_steps=2, keep=4, async_save=False)
    spec = make_spec(spares=1, replicas=1, min_replicas=1, train_iters=iters).model_copy(
        update={"checkpoint": checkpoints}
    )
    cluster = make_cluster(spec, tmp_path / "run")
    cluster.boot(["a", "r1", "r2"])
    cluster.assign(cluster.plan(["a"]), ["a"])
    cluster.wait_succeeded(["a"])
    assert complete_steps(root) == [8, 6, 4, 2]
    expected = cluster.losses(["a"])

    (checkpoint_dir(root, 8) / MANIFEST).unlink()  # missing manifest
    flipped = sorted(checkpoint_dir(root, 6).glob("*.distcp"))[0]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x10  # one flipped bit, size unchanged
    flipped.write_bytes(bytes(data))
    truncated = sorted(checkpoint_dir(root, 4).glob("*.distcp"))[0]
    os.truncate(truncated, truncated.stat().st_size - 100)

    # r1: the plan names step 8 (no manifest), then step 6 (flipped bit): two failures, it stops.
    plan = cluster.plan(["r1"], resume_step=8, reason=PlanReason.REPLACE, sources=checkpoint_sources(spec, 8))
    cluster.assign(plan, ["r1"])
    for w in cluster.workers(["r1"]):
        wait_for(lambda w=w: "failed" in w.states() or w.eof.is_set(), 120, f"{w.name} to stop")
        kinds = [(m.kind, m.step) for m in w.of_type(CheckpointProblem)]
        assert kinds == [("rejected", 8), ("rejected", 6), ("unusable", 8)]
        problems = [m.detail for m in w.of_type(CheckpointProblem)]
        assert MANIFEST in problems[0] and "sha256" in problems[1]
        [detail] = [m.detail for m in w.of_type(WorkerStatus) if m.state == "failed"]
        assert "CheckpointUnusable" in detail and "step 8" in detail and "step 6" in detail
        assert not w.of_type(Progress)
        assert w.process.wait(30) == 1

    # r2 (after r1, which saves nothing): the plan names step 4 (truncated): rejected, step 2
    # restored, and the rest trained exactly as before.
    plan = cluster.plan(["r2"], resume_step=4, reason=PlanReason.REPLACE, sources=checkpoint_sources(spec, 4))
    cluster.assign(plan, ["r2"])
    cluster.wait_succeeded(["r2"])
    for w in cluster.workers(["r2"]):
        [rejected] = w.of_type(CheckpointProblem)
        assert (rejected.kind, rejected.step) == ("rejected", 4) and "truncated" in rejected.detail
    assert cluster.losses(["a", "r2"]) == expected
    assert min(p.step for w in cluster.workers(["r2"]) for p in w.of_type(Progress)) == 3


def test_a_re_mesh_during_a_save_abandons_it_and_later_saves_complete(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    root, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    iters = 10
    spec = make_spec(spares=0, replicas=2, min_replicas=1, train_iters=iters)
    spec = spec.model_copy(update={"checkpoint": CheckpointSpec(path=str(root), interval_steps=2, keep=2)})
    cluster = make_cluster(spec, tmp_path / "run", {ENV_WRITER_GATE: str(gate)})
    cluster.boot(["a", "b"])
    cluster.assign(cluster.plan(["a", "b"]))
    cluster.wait_steps(["a", "b"], 3)
    assert partial_dir(root, 2).is_dir()  # its writers wait at the gate

    # A DP peer dies while the save is in flight; the survivors re-mesh without it.
    cluster.kill_pod("b")
    cluster.wait_failed_reports(["a"], epoch=1)
    resume = max(w.last_step() for w in cluster.workers(["a"]))
    cluster.assign(cluster.plan(["a"], resume_step=resume, reason=PlanReason.SHRINK), ["a"])
    cluster.wait_steps(["a"], resume + 1)
    open_gate(gate, *range(2, iters + 1, 2))
    cluster.wait_succeeded(["a"])

    saved = saved_steps(cluster, "a")
    assert 2 not in saved and saved[-1] == iters, "the abandoned save is never reported"
    assert complete_steps(root) == sorted(saved, reverse=True)[:2]
    assert not [p.name for p in root.iterdir() if p.name.startswith(PARTIAL_PREFIX)]
    for step in complete_steps(root):
        manifest = json.loads((checkpoint_dir(root, step) / MANIFEST).read_text())
        assert manifest["mesh"]["dp"] == 1 and manifest["epoch"] == 2
        verify_files(checkpoint_dir(root, step), manifest, manifest["files"])
    logs = "\n".join(w.log_path.read_text() for w in cluster.workers(["a"]))
    assert "checkpoint of step 2 abandoned" in logs


def test_a_checkpoint_reshards_to_other_data_and_tensor_parallel_sizes(
    tmp_path: Path, make_cluster: MakeCluster
) -> None:
    root = tmp_path / "ckpt"
    iters = 6
    checkpoints = CheckpointSpec(path=str(root), interval_steps=2, keep=4, async_save=False)
    spec = make_spec(spares=1, replicas=2, min_replicas=1, train_iters=iters).model_copy(
        update={"checkpoint": checkpoints}
    )  # TP2 x DP2 over pods a and b
    cluster = make_cluster(spec, tmp_path / "run")
    # TP1 x DP1: the same model and checkpoints, one worker.
    tp1_spec = make_spec(spares=0, replicas=1, min_replicas=1, tp=1, gpus_per_pod=1, train_iters=iters)
    tp1 = make_cluster(tp1_spec.model_copy(update={"checkpoint": checkpoints}), tmp_path / "tp1")
    for pod in ("a", "b", "r"):
        cluster.start_pod(pod)
    tp1.start_pod("t")
    cluster.wait_ready(["a", "b", "r"])
    tp1.wait_ready(["t"])
    cluster.assign(cluster.plan(["a", "b"]), ["a", "b"])
    cluster.wait_succeeded(["a", "b"])
    expected = cluster.losses(["a", "b"])
    assert 4 in complete_steps(root)

    # DP 2 -> 1 (TP 2): pod r alone restores step 4.
    cluster.assign(
        cluster.plan(["r"], resume_step=4, reason=PlanReason.REPLACE, sources=checkpoint_sources(spec, 4)), ["r"]
    )
    # TP 2 -> 1: worker t restores step 4 too.
    tp1.assign(tp1.plan(["t"], resume_step=4, reason=PlanReason.REPLACE, sources=checkpoint_sources(tp1.spec, 4)))
    cluster.wait_succeeded(["r"])
    tp1.wait_succeeded(["t"])
    for name, got in (("DP 2->1", cluster.losses(["r"])), ("TP 2->1", tp1.losses(["t"]))):
        assert sorted(got) == [5, 6]
        print(f"{name}: losses {got}, uninterrupted {expected}")
        # The next loss comes from the restored weights: bit for bit the uninterrupted run's.
        assert got[5] == expected[5], f"{name}: next loss {got[5]!r}, uninterrupted {expected[5]!r}"
        # The step after sums gradients over another DP/TP layout: equal to rounding.
        assert got[6] == pytest.approx(expected[6], rel=1e-5, abs=0)


def test_a_failed_write_is_reported_and_the_next_save_completes(tmp_path: Path, make_cluster: MakeCluster) -> None:
    root, gate = tmp_path / "ckpt", tmp_path / "gate"
    gate.mkdir()
    (gate / "2").write_text("fail")  # storage fails the save of step 2
    open_gate(gate, 4, 6)
    spec = checkpointed_spec(root, iters=6, interval=2, keep=2)
    cluster = make_cluster(spec, tmp_path / "run", {ENV_WRITER_GATE: str(gate)})
    cluster.boot(["a"])
    cluster.assign(cluster.plan(["a"]))
    cluster.wait_succeeded(["a"])
    for w in cluster.workers(["a"]):
        failed = [m for m in w.of_type(CheckpointProblem) if m.kind == "failed"]
        assert [m.step for m in failed] == [2] and "checkpoint of step 2 failed" in failed[0].detail
    saved = saved_steps(cluster, "a")
    assert 2 not in saved and saved[-1] == 6
    assert complete_steps(root) == sorted(saved, reverse=True)[:2]
    assert not [p.name for p in root.iterdir() if p.name.startswith(PARTIAL_PREFIX)]


def test_a_checkpoint_reshards_to_a_larger_data_parallel_size(tmp_path: Path, make_cluster: MakeCluster) -> None:
    root = tmp_path / "ckpt"
    iters = 6
    checkpoints = CheckpointSpec(path=str(root), interval_steps=2, keep=4, async_save=False)
    spec = make_spec(spares=1, replicas=2, min_replicas=1, train_iters=iters).model_copy(
        update={"checkpoint": checkpoints}
    )
    cluster = make_cluster(spec, tmp_path / "run")
    cluster.boot(["a", "b", "c"])
    cluster.assign(cluster.plan(["a"]), ["a"])  # TP2 x DP1
    cluster.wait_succeeded(["a"])
    expected = cluster.losses(["a"])
    # DP 1 -> 2: pods b and c restore step 4 together.
    sources = {
        r: StateSource(rank=r, kind=StateSourceKind.CHECKPOINT, checkpoint_step=4) for r in range(2 * spec.gpus_per_pod)
    }
    cluster.assign(cluster.plan(["b", "c"], resume_step=4, reason=PlanReason.GROW, sources=sources), ["b", "c"])
    cluster.wait_succeeded(["b", "c"])
    got = cluster.losses(["b", "c"])
    assert sorted(got) == [5, 6]
    assert got[5] == expected[5], f"next loss {got[5]!r}, uninterrupted {expected[5]!r}"
    assert got[6] == pytest.approx(expected[6], rel=1e-5, abs=0)
