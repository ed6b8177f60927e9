"""The recovery scenarios beyond SIGKILL-with-spare on one running job (GPU with NCCL, or CPU).

With four GPUs (the default; ``--gpus N`` for N >= 3 alike), pods a, b, c train (TP=1, DP=N-1,
one GPU each) and s is a warm spare. In order:

1. hang: c is SIGSTOPped at a random moment inside a step. The survivors notice that their step
   stalls past max(``--hang-floor``, ``--hang-step-multiple`` x the epoch's median step) (the job's
   failureDetection defaults; ``--hang-step-multiple 0`` waits for ``--collective-timeout``
   instead), abort and report; the script, as agent, kills c and, as operator, plans s into c's
   rank with state broadcast from a DP peer;
2. shrink: b is SIGKILLed mid-step with no spare left; DP shrinks by one with the global batch kept;
3. grow: pod d boots on b's GPU and joins at a step boundary ahead of training (DP back up),
   receiving state from a DP peer.

With two GPUs there is no room for a spare: a and b train (DP=2); b hangs and the job shrinks to
DP=1 around it; d boots on b's GPU and joins (DP=2); d is SIGKILLed (DP=1); e joins (DP=2).

``--hang-last`` runs shrink and grow first and the hang last. Then every step committed so far is
checked: committed in exactly one epoch, consuming exactly
its global-batch samples (none dropped or repeated), with one loss that all members agree on.
Prints and writes per-phase times of each transition.

    python benchmarks/trainer_scenarios.py --gpus 4 --out scenarios.json
    python benchmarks/trainer_scenarios.py --gpus 2 --out scenarios-2gpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from trainer_recovery import add_job_args, job_spec
from worker_harness import WorkerCluster, wait_for

from megatron_contract.mesh import PlanReason, StateSource, StateSourceKind
from megatron_trainer.channel import Hello, PhaseTimes, Progress
from megatron_trainer.faults import Fault, inject_into

PHASES = ("step_exit", "abort", "rendezvous", "rebuild", "restore", "verify", "first_step")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collective-timeout", type=float, default=5.0)
    parser.add_argument(
        "--hang-step-multiple", type=float, default=3.0, help="hangDetectionStepMultiple (0: the collective timeout)"
    )
    parser.add_argument("--hang-floor", type=float, default=1.0, help="hangDetectionFloorSeconds")
    parser.add_argument("--steps-between", type=int, default=4, help="steps trained between two scenarios")
    parser.add_argument("--hang-last", action="store_true", help="shrink and grow first, the hang last")
    add_job_args(parser)
    args = parser.parse_args()
    if args.gpus < 2:
        parser.error("needs at least 2 GPUs (or CPU processes)")
    with_spare = args.gpus >= 3
    trainers = args.gpus - 1 if with_spare else args.gpus
    for dp in (trainers, trainers - 1):
        if args.global_batch % dp:
            parser.error(f"--global-batch must split over DP={trainers} and DP={trainers - 1}")
    gpu = torch.cuda.is_available()
    if gpu and torch.cuda.device_count() < args.gpus:
        parser.error(f"--gpus {args.gpus}, but this machine has {torch.cuda.device_count()}")
    rng = random.Random(args.seed)
    spec = job_spec(args, dp=trainers, train_iters=1_000_000, collective_timeout=args.collective_timeout)
    detection = spec.failure_detection.model_copy(
        update={
            "hang_detection_step_multiple": args.hang_step_multiple,
            "hang_detection_floor_seconds": args.hang_floor,
        }
    )
    spec = spec.model_copy(update={"failure_detection": detection})
    cluster = WorkerCluster(spec, Path(tempfile.mkdtemp(prefix="scenarios-")))
    device_of: dict[str, int] = {}
    rows: list[dict[str, Any]] = []

    def boot(pod: str, index: int) -> None:
        device_of[pod] = index
        cluster.start_pod(pod, env={"CUDA_VISIBLE_DEVICES": str(index)} if gpu else {})

    def mid_step(pod: str) -> None:
        """Sleep to a random moment inside one of ``pod``'s steps."""
        w = cluster.pods[pod][0]
        seen = w.last_step()
        wait_for(lambda: w.last_step() > seen, 120, "a step boundary")
        time.sleep(rng.uniform(0.1, 0.9) * w.of_type(Progress)[-1].step_time_seconds)

    def first_step_of(epoch: int, pods: list[str]) -> float:
        return cluster.wait_first_step(epoch, pods, timeout=300)

    def record(name: str, epoch: int, pods: list[str], start: float, end: float, **extra: Any) -> None:
        phases = {
            w.pod: next(m.phases for m in w.of_type(PhaseTimes) if m.epoch == epoch) for w in cluster.workers(pods)
        }
        row = {"scenario": name, "epoch": epoch, "seconds": end - start, **extra, "phases_by_pod": phases}
        worst = {k: max(p.get(k, 0.0) for p in phases.values()) for k in PHASES}
        rows.append(row)
        print(
            f"{name}: {row['seconds']:.3f}s | " + " ".join(f"{k} {v:.3f}" for k, v in worst.items()),
            *(f"| {k} {v}" for k, v in extra.items()),
            flush=True,
        )

    def hang(members: list[str], victim: str, spare: str | None) -> list[str]:
        """SIGSTOP ``victim``; the survivors' watchdogs detect it (their step stalls); ``spare`` takes
        its rank (without a spare the survivors go on alone)."""
        survivors = [p for p in members if p != victim]
        mid_step(victim)
        stopped_at = inject_into(cluster.pods[victim][0].process.pid, Fault.SIGSTOP)
        cluster.wait_failed_reports(survivors, epoch=cluster.epoch, timeout=args.collective_timeout + 60)
        reported_at = time.time()
        cluster.kill_pod(victim)  # the agent kills its hung worker; SIGKILL ends a stopped process
        resume = max(w.last_step() for w in cluster.workers(survivors))
        if spare is None:
            new = survivors
            plan = cluster.plan(new, resume_step=resume, reason=PlanReason.SHRINK)
        else:
            rank = members.index(victim)
            new = [spare if p == victim else p for p in members]
            peer = (rank + 1) % len(new)
            plan = cluster.plan(
                new,
                resume_step=resume,
                reason=PlanReason.REPLACE,
                sources={rank: StateSource(rank=rank, kind=StateSourceKind.PEER, peer_rank=peer)},
            )
        cluster.assign(plan, new)
        end = first_step_of(plan.epoch, new)
        record(
            "hang (SIGSTOP) replaced by the spare" if spare else f"hang (SIGSTOP): DP {len(members)} -> {len(new)}",
            plan.epoch,
            new,
            stopped_at,
            end,
            detected_after_s=round(reported_at - stopped_at, 3),
            resume_step=resume,
        )
        return new

    def shrink(members: list[str], victim: str) -> list[str]:
        """SIGKILL ``victim`` with no spare planned in: the others carry the whole global batch."""
        print(f"shrink: SIGKILL of {victim} after step {cluster.pods[victim][0].last_step()}", flush=True)
        new = [p for p in members if p != victim]
        mid_step(victim)
        killed_at = inject_into(cluster.pods[victim][0].process.pid, Fault.SIGKILL)
        assert cluster.pods[victim][0].eof.wait(30)
        resume = max(w.last_step() for w in cluster.workers(new))
        plan = cluster.plan(new, resume_step=resume, reason=PlanReason.SHRINK)
        cluster.assign(plan, new)
        end = first_step_of(plan.epoch, new)
        record(
            f"kill without a spare: DP {len(members)} -> {len(new)}",
            plan.epoch,
            new,
            killed_at,
            end,
            resume_step=resume,
        )
        cluster.kill_pod(victim)
        return new

    def grow(members: list[str], pod: str, device: int) -> list[str]:
        """``pod`` boots on ``device`` and joins at a step boundary ahead of training."""
        boot(pod, device)
        wait_for(lambda: cluster.pods[pod][0].of_type(Hello), 400, f"pod {pod} to warm up")
        boundary = max(w.last_step() for w in cluster.workers(members)) + 3
        print(f"grow: {pod} joins at step {boundary}", flush=True)
        new = [*members, pod]
        rank = len(members)
        plan = cluster.plan(
            new,
            resume_step=boundary,
            reason=PlanReason.GROW,
            sources={rank: StateSource(rank=rank, kind=StateSourceKind.PEER, peer_rank=0)},
        )
        cluster.assign(plan, new)
        cluster.wait_steps(members, boundary, timeout=120)
        reached_at = time.time()
        end = first_step_of(plan.epoch, new)
        record(f"grow: DP {len(members)} -> {len(new)} at a step boundary", plan.epoch, new, reached_at, end)
        return new

    def settle(members: list[str]) -> None:
        cluster.wait_steps(members, max(w.last_step() for w in cluster.workers(members)) + args.steps_between)

    try:
        members = [chr(ord("a") + i) for i in range(trainers)]
        pods = [*members, "s"] if with_spare else members
        for i, pod in enumerate(pods):
            boot(pod, i)
        cluster.wait_ready(pods, timeout=400)
        cluster.assign(cluster.plan(members), members)
        cluster.wait_steps(members, args.steps_between, timeout=300)
        if not with_spare:
            last = members[-1]
            members = hang(members, last, None)
            settle(members)
            members = grow(members, "d", device_of[last])
            settle(members)
            members = shrink(members, "d")
            settle(members)
            members = grow(members, "e", device_of["d"])
        elif args.hang_last:
            members = shrink(members, "b")
            settle(members)
            members = grow(members, "d", device_of["b"])
            settle(members)
            members = hang(members, members[-2], "s")
        else:
            members = hang(members, members[-1], "s")
            settle(members)
            members = shrink(members, "b")
            settle(members)
            members = grow(members, "d", device_of["b"])
        settle(members)
        checked = check_samples(cluster, members, spec.training.global_batch_size)
        print(f"samples: steps 0..{checked - 1} each committed once with exactly their global batch", flush=True)
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.close()

    if args.out:
        args.out.write_text(json.dumps({"scenarios": rows, "checked_steps": checked, "args": vars(args)}, default=str))
    return 0


def check_samples(cluster: WorkerCluster, members: list[str], global_batch: int) -> int:
    """Every step up to the members' common progress: one epoch, exactly samples [step*G, (step+1)*G),
    one loss. Returns the number of steps checked."""
    done = min(w.last_step() for w in cluster.workers(members))
    by_step: dict[int, list[int]] = {}
    epochs: dict[int, set[int]] = {}
    for r in cluster.sample_records():
        if r["step"] < done:
            by_step.setdefault(r["step"], []).extend(r["samples"])
            epochs.setdefault(r["step"], set()).add(r["epoch"])
    if sorted(by_step) != list(range(done)):
        raise AssertionError(f"steps committed: {sorted(by_step)}, expected 0..{done - 1}")
    for step, samples in by_step.items():
        if sorted(samples) != list(range(step * global_batch, (step + 1) * global_batch)):
            raise AssertionError(f"step {step} consumed {sorted(samples)}")
        if len(epochs[step]) != 1:
            raise AssertionError(f"step {step} was committed in epochs {sorted(epochs[step])}")
    cluster.losses(list(cluster.pods))  # raises if two workers report different losses for a step
    return done


if __name__ == "__main__":
    sys.exit(main())
