"""Checkpoint save benchmark: what a save costs the training step, synchronous vs asynchronous.

``--gpus`` pods of one GPU each train a Megatron-Core GPT (TP=1, DP=gpus) with a checkpoint every
``--interval`` steps, once with ``asyncSave: false`` (the step waits for the write) and once with
``asyncSave: true`` (the step waits for the device-to-host copy; the write runs in a forked
writer). The script plays agent and operator, as the tests do (``tests/trainer/worker_harness.py``).
For each mode it prints the median step time (the steps' own compute; writes in the background
show there as contention), the training-thread time a save took from the step that started it
(``blocking``: with synchronous saves, the whole write), and start-to-complete time of each save (``total``,
reported in ``CheckpointSaved``), each save's throughput in GB/s; then fresh warm pods restore the
newest checkpoint (verified, fully parallel load) and train one step: load time, GB/s and plan → first
step. Writes JSON with ``--out``.

    python benchmarks/checkpoint_save.py --gpus 4 --iters 30 --interval 10 --out result.json

Model default as ``trainer_recovery.py`` (~1.1 B parameters, bf16, Adam). Checkpoints go to
``--dir`` (default: a temporary directory; give it the storage to measure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# trainer_recovery puts the source folders and the worker harness on sys.path.
from trainer_recovery import add_job_args, job_spec
from worker_harness import WorkerCluster

from megatron_contract.job import CheckpointSpec
from megatron_contract.mesh import StateSource, StateSourceKind
from megatron_trainer.channel import CheckpointProblem, CheckpointSaved, PhaseTimes, Progress
from megatron_trainer.worker.checkpoint_files import checkpoint_dir, complete_steps


def _start_pods(cluster: WorkerCluster, prefix: str, gpus: int) -> list[str]:
    """One warm pod per GPU, as Kubernetes gives each pod its own."""
    pods = [f"{prefix}{i}" for i in range(gpus)]
    for i, pod in enumerate(pods):
        cluster.start_pod(pod, env={"CUDA_VISIBLE_DEVICES": str(i)})
    cluster.wait_ready(pods, timeout=600)
    return pods


def run(args: argparse.Namespace, asynchronous: bool, root: Path) -> dict[str, object]:
    """Train once with checkpoints in the given mode; returns the figures of rank 0's worker."""
    spec = job_spec(args, dp=args.gpus, train_iters=args.iters)
    checkpoints = CheckpointSpec(path=str(root), interval_steps=args.interval, keep=2, async_save=asynchronous)
    spec = spec.model_copy(update={"checkpoint": checkpoints, "spares": 0})
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as work:
        cluster = WorkerCluster(spec, Path(work))
        try:
            pods = _start_pods(cluster, "p", args.gpus)
            cluster.assign(cluster.plan(pods))
            cluster.wait_succeeded(pods, timeout=3600)
            first = cluster.pods[pods[0]][0]
            saves = first.of_type(CheckpointSaved)
            steps = {p.step: p.step_time_seconds for p in first.of_type(Progress)}
            skipped = [m.step for m in first.of_type(CheckpointProblem) if m.kind == "skipped"]
        except BaseException:
            print(cluster.logs())
            raise
        finally:
            cluster.close()
    # A step's own time (Progress) excludes the save bookkeeping after it; a background write shows
    # in it only as contention.
    plain = [t for s, t in steps.items() if s > 1]
    result = {
        "mode": "async" if asynchronous else "sync",
        "step_seconds_median": statistics.median(plain) if plain else None,
        "saves": [
            {
                "step": m.step,
                "blocking_seconds": m.blocking_seconds,
                "total_seconds": m.total_seconds,
                "start_phases": m.start_phases,
            }
            for m in saves
        ],
        "skipped": skipped,
    }
    # The save at the last step is made by the end of training, which waits for it: not a step's cost.
    mid_run = [m for m in saves if m.step < args.iters]
    blocking = [m.blocking_seconds for m in mid_run if m.blocking_seconds is not None]
    total = [m.total_seconds for m in saves if m.total_seconds is not None]
    step = result["step_seconds_median"]
    added = (
        f", {100 * statistics.mean(blocking) / (args.interval * step):.0f} % added to the average step"
        if blocking and isinstance(step, float) and step > 0
        else ""
    )
    print(
        f"{result['mode']}: step p50 {step}s; mid-run save blocking {[round(b, 2) for b in blocking]}s{added};"
        f" start-to-complete p50 {statistics.median(total) if total else None}s; {len(saves)} saves,"
        f" skipped {skipped}",
        flush=True,
    )
    for m in saves:
        phases = " ".join(f"{k} {v:.3f}s" for k, v in (m.start_phases or {}).items())
        print(f"  save of step {m.step}: blocking {m.blocking_seconds:.3f}s ({phases}), total {m.total_seconds:.2f}s")
    return result


def restore(args: argparse.Namespace, root: Path) -> dict[str, object]:
    """Fresh warm pods restore the newest checkpoint under ``root`` and train one step: the load
    (verification included) and the first step, and the checkpoint's size for GB/s."""
    step = max(complete_steps(root))
    directory = checkpoint_dir(root, step)
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    spec = job_spec(args, dp=args.gpus, train_iters=step + 1)
    spec = spec.model_copy(update={"checkpoint": CheckpointSpec(path=str(root), interval_steps=10_000), "spares": 0})
    with tempfile.TemporaryDirectory(prefix="ckpt-load-") as work:
        cluster = WorkerCluster(spec, Path(work))
        try:
            pods = _start_pods(cluster, "r", args.gpus)
            sources = {
                r: StateSource(rank=r, kind=StateSourceKind.CHECKPOINT, checkpoint_step=step) for r in range(args.gpus)
            }
            cluster.assign(cluster.plan(pods, resume_step=step, sources=sources))
            cluster.wait_succeeded(pods, timeout=1200)
            phases = cluster.pods[pods[0]][0].of_type(PhaseTimes)[0].phases
        except BaseException:
            print(cluster.logs())
            raise
        finally:
            cluster.close()
    load = phases.get("restore", 0.0)
    result = {
        "checkpoint_step": step,
        "checkpoint_bytes": size,
        "restore_seconds": load,
        "load_gb_per_s": size / load / 1e9 if load > 0 else None,
        "plan_to_first_step_seconds": sum(v for k, v in phases.items() if k in _JOIN_PHASES),
        "phases": phases,
    }
    print(
        f"restore: {size / 1e9:.1f} GB checkpoint of step {step} verified and loaded in {load:.2f}s"
        f" ({result['load_gb_per_s'] or 0:.2f} GB/s); plan -> first step {result['plan_to_first_step_seconds']:.2f}s",
        flush=True,
    )
    return result


# The phases a worker reports between a plan and its first committed step (not their sub-phases).
_JOIN_PHASES = ("rendezvous", "rebuild", "restore", "verify", "first_step")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_args(parser)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint directory (default: a temporary one)")
    parser.add_argument("--skip-sync", action="store_true", help="only the asynchronous mode (and the restore)")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="ckpt-") as tmp:
        base = args.dir or Path(tmp)
        for asynchronous in (True,) if args.skip_sync else (False, True):
            results.append(run(args, asynchronous, base / ("async" if asynchronous else "sync")))
        loaded = restore(args, base / "async")
        for r in results:  # save throughput: the checkpoint's bytes over each save's start-to-complete
            for save in r["saves"]:  # type: ignore[union-attr]
                total = save["total_seconds"]
                save["gb_per_s"] = loaded["checkpoint_bytes"] / total / 1e9 if total else None  # type: ignore[operator]
        results.append({"mode": "restore", **loaded})
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
