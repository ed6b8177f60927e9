"""In place vs a cold restart: what a lost worker costs under the operator and the way users
restart jobs today, on the same GPUs, model and run.

``--gpus N`` pods of one GPU each train a Megatron-Core model (TP 1, DP N, bf16, asynchronous
checkpoints every ``--interval`` steps). The script plays agent and operator, as the tests do
(``tests/trainer/worker_harness.py``). Arms, in this order:

1. ``in place, from a DP peer`` (N >= 2): the last pod's worker is SIGKILLed at a random moment
   inside a step; the survivors shrink DP by one around it and carry the whole global batch, state
   kept in memory (no step redone). A new pod then boots on the freed GPU and joins (DP back to N).
2. ``in place, warm spares, from the checkpoint``: one warm spare per GPU waits beside the trainers
   (imports done, CUDA and NCCL ready, model built; they share the GPUs with the trainers). Once the
   newest checkpoint is complete and ``--steps-after`` more steps ran, every trainer is SIGKILLed
   (the case in which no peer holds the state: a whole job, or every replica of a shard); the
   spares restore the newest checkpoint and go on.
3. ``cold restart, from the checkpoint``: the same, but the job is restarted the way it is without
   the operator: fresh processes on the same GPUs (Python and Megatron imports, CUDA and NCCL
   initialisation, model and optimizer build), then the newest checkpoint's load. Pod scheduling,
   image pull and container start, which a real restart adds, are not counted: the figure is a
   lower bound.

For each arm: kill -> first committed step, the steps redone (committed before the kill, after
the checkpoint), kill -> back at the step the job had reached, and the ratio of each arm to the
cold restart. Prints a line per arm and, with ``--out``, writes JSON.

    python benchmarks/restart_vs_in_place.py --gpus 2 --out result.json

Model default as ``trainer_recovery.py`` (~1.1 B parameters, bf16, Adam). Checkpoints go to
``--dir`` (default: a temporary directory; give it the storage to measure).
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

from megatron_contract.job import CheckpointSpec
from megatron_contract.mesh import PlanReason, StateSource, StateSourceKind
from megatron_trainer.channel import CheckpointSaved, Hello, PhaseTimes, Progress
from megatron_trainer.faults import Fault, inject_into


class Bench:
    """The running job and what the arms need from it."""

    def __init__(self, args: argparse.Namespace, cluster: WorkerCluster, gpu: bool) -> None:
        self.args = args
        self.cluster = cluster
        self.gpu = gpu
        self.rng = random.Random(args.seed)
        self.device_of: dict[str, int] = {}
        self.booted = 0

    def boot(self, device: int, prefix: str) -> str:
        self.booted += 1
        pod = f"{prefix}{self.booted}"
        self.device_of[pod] = device
        self.cluster.start_pod(pod, env={"CUDA_VISIBLE_DEVICES": str(device)} if self.gpu else {})
        return pod

    def last_step(self, pods: list[str]) -> int:
        return max(w.last_step() for w in self.cluster.workers(pods))

    def step_time(self, pods: list[str]) -> float:
        times = [p.step_time_seconds for p in self.cluster.workers(pods)[0].of_type(Progress)[-5:]]
        return sorted(times)[len(times) // 2]

    def kill_mid_step(self, victims: list[str], watch: str) -> float:
        """SIGKILL the workers of ``victims`` at a random moment inside one of ``watch``'s steps."""
        w = self.cluster.pods[watch][0]
        seen = w.last_step()
        wait_for(lambda: w.last_step() > seen, 300, "a step boundary")
        time.sleep(self.rng.uniform(0.1, 0.9) * w.of_type(Progress)[-1].step_time_seconds)
        killed_at = time.time()
        for pod in victims:
            for worker in self.cluster.pods[pod]:
                inject_into(worker.process.pid, Fault.SIGKILL)
        for pod in victims:
            assert self.cluster.pods[pod][0].eof.wait(30)
        return killed_at

    def time_of_step(self, pods: list[str], epoch: int, step: int) -> float:
        """Wall clock when every member of ``pods`` had committed ``step`` in ``epoch`` (polled
        every 5 ms)."""

        def arrived() -> bool:
            for w in self.cluster.workers(pods):
                self.cluster.raise_if_failed(w)
            return all(
                any(p.epoch == epoch and p.step >= step for p in w.of_type(Progress))
                for w in self.cluster.workers(pods)
            )

        wait_for(arrived, 900, f"step {step} of epoch {epoch}", interval=0.005)
        return time.time()

    def newest_checkpoint_then(self, pods: list[str]) -> int:
        """Wait for a checkpoint to complete and ``--steps-after`` steps past it, no save in flight."""
        w = self.cluster.pods[pods[0]][0]
        known = {m.step for m in w.of_type(CheckpointSaved)}
        saved = wait_for(
            lambda: max({m.step for m in w.of_type(CheckpointSaved)} - known, default=None), 900, "a new checkpoint"
        )
        target = saved + self.args.steps_after
        self.cluster.wait_steps(pods, target, timeout=300)
        return saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_args(parser)
    parser.set_defaults(gpus=2)
    parser.add_argument("--interval", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--steps-after", type=int, default=5, help="steps trained past the checkpoint before a kill")
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint directory (default: a temporary one)")
    args = parser.parse_args()
    if not 0 < args.steps_after < args.interval:
        parser.error("--steps-after must be between 1 and --interval - 1 (the kill lands between two saves)")
    gpu = torch.cuda.is_available()
    if gpu and torch.cuda.device_count() < args.gpus:
        parser.error(f"--gpus {args.gpus}, but this machine has {torch.cuda.device_count()}")
    if args.gpus >= 2 and args.global_batch % (args.gpus - 1):
        parser.error(f"--global-batch must split over DP={args.gpus} and DP={args.gpus - 1}")
    with tempfile.TemporaryDirectory(prefix="restart-") as tmp:
        root = args.dir or Path(tmp) / "checkpoints"
        spec = job_spec(args, dp=args.gpus, train_iters=1_000_000)
        spec = spec.model_copy(
            update={"checkpoint": CheckpointSpec(path=str(root), interval_steps=args.interval, keep=2, async_save=True)}
        )
        cluster = WorkerCluster(spec, Path(tmp) / "work")
        bench = Bench(args, cluster, gpu)
        arms: list[dict[str, Any]] = []
        try:
            members = [bench.boot(i, "t") for i in range(args.gpus)]
            cluster.wait_ready(members, timeout=900)
            cluster.assign(cluster.plan(members), members)
            cluster.wait_steps(members, 3, timeout=600)
            if args.gpus >= 2:
                members = peer_arm(bench, members, arms)
                _write(args, arms)  # each arm's figures are kept even if a later arm does not end
            members = checkpoint_arm(bench, members, arms, warm=True)
            _write(args, arms)
            members = checkpoint_arm(bench, members, arms, warm=False)
        except BaseException:
            print(cluster.logs())
            raise
        finally:
            cluster.close()
    cold = next(a for a in arms if a["arm"].startswith("cold"))
    for arm in arms:
        arm["first_step_vs_cold"] = arm["kill_to_first_step_s"] / cold["kill_to_first_step_s"]
        arm["caught_up_vs_cold"] = arm["kill_to_caught_up_s"] / cold["kill_to_caught_up_s"]
        print(
            f"{arm['arm']}: kill -> first step {arm['kill_to_first_step_s']:.2f}s"
            f" ({arm['first_step_vs_cold']:.2f} x cold), {arm['steps_redone']} steps redone,"
            f" back at the step of the kill after {arm['kill_to_caught_up_s']:.2f}s"
            f" ({arm['caught_up_vs_cold']:.2f} x cold)",
            flush=True,
        )
    _write(args, arms)
    return 0


def _write(args: argparse.Namespace, arms: list[dict[str, Any]]) -> None:
    if args.out:
        args.out.write_text(json.dumps({"arms": arms, "args": vars(args)}, indent=1, default=str))


def peer_arm(bench: Bench, members: list[str], arms: list[dict[str, Any]]) -> list[str]:
    """SIGKILL the last pod; the others shrink around it; a new pod joins on its GPU."""
    cluster = bench.cluster
    victim = members[-1]
    survivors = members[:-1]
    killed_at = bench.kill_mid_step([victim], survivors[0])
    reached = bench.last_step(survivors)
    plan = cluster.plan(survivors, resume_step=reached, reason=PlanReason.SHRINK)
    cluster.assign(plan, survivors)
    first = bench.time_of_step(survivors, plan.epoch, reached + 1)
    name = "in place, from a DP peer (shrink)"
    arms.append(_arm(name, killed_at, first, first, reached, reached, bench, survivors, plan.epoch))
    cluster.kill_pod(victim)
    newcomer = bench.boot(bench.device_of[victim], "t")
    wait_for(lambda: cluster.pods[newcomer][0].of_type(Hello), 900, f"{newcomer} to warm up")
    boundary = bench.last_step(survivors) + 3
    grown = [*survivors, newcomer]
    rank = len(survivors)
    plan = cluster.plan(
        grown,
        resume_step=boundary,
        reason=PlanReason.GROW,
        sources={rank: StateSource(rank=rank, kind=StateSourceKind.PEER, peer_rank=0)},
    )
    cluster.assign(plan, grown)
    bench.time_of_step(grown, plan.epoch, boundary + 1)
    print(f"grow: {newcomer} joined at step {boundary} (DP {len(grown)})", flush=True)
    return grown


def checkpoint_arm(bench: Bench, members: list[str], arms: list[dict[str, Any]], warm: bool) -> list[str]:
    """Every trainer SIGKILLed after a checkpoint; warm spares (or fresh processes) restore it."""
    cluster = bench.cluster
    spares = [bench.boot(bench.device_of[p], "s") for p in members] if warm else []
    if spares:
        cluster.wait_ready(spares, timeout=900)
    saved = bench.newest_checkpoint_then(members)
    killed_at = bench.kill_mid_step(members, members[0])
    reached = bench.last_step(members)
    for pod in members:
        cluster.kill_pod(pod)
    if not warm:  # the restart: new processes on the same GPUs
        spares = [bench.boot(bench.device_of[p], "c") for p in members]
        cluster.wait_ready(spares, timeout=900)
    sources = {
        r: StateSource(rank=r, kind=StateSourceKind.CHECKPOINT, checkpoint_step=saved) for r in range(len(spares))
    }
    plan = cluster.plan(spares, resume_step=saved, reason=PlanReason.REPLACE, sources=sources)
    cluster.assign(plan, spares)
    first = bench.time_of_step(spares, plan.epoch, saved + 1)
    caught_up = bench.time_of_step(spares, plan.epoch, reached)
    name = "in place, warm spares, from the checkpoint" if warm else "cold restart, from the checkpoint"
    arms.append(_arm(name, killed_at, first, caught_up, reached, saved, bench, spares, plan.epoch))
    return spares


# The worst member's phases printed per arm (the JSON has every member's).
_PHASES = ("rendezvous", "rebuild", "restore", "restore_verify", "restore_load", "verify", "first_step")


def _arm(
    name: str,
    killed_at: float,
    first: float,
    caught_up: float,
    reached: int,
    resumed: int,
    bench: Bench,
    pods: list[str],
    epoch: int,
) -> dict[str, Any]:
    arm = {
        "arm": name,
        "kill_to_first_step_s": first - killed_at,
        "kill_to_caught_up_s": caught_up - killed_at,
        "steps_redone": reached - resumed,
        "step_reached_at_kill": reached,
        "resumed_after_step": resumed,
        "step_seconds": bench.step_time(pods),
        "phases_by_pod": {
            w.pod: wait_for(
                lambda w=w: next((m.phases for m in w.of_type(PhaseTimes) if m.epoch == epoch), None),
                60,
                f"phase times of {w.name}",
            )
            for w in bench.cluster.workers(pods)
        },
    }
    worst = {k: max(p.get(k, 0.0) for p in arm["phases_by_pod"].values()) for k in _PHASES}
    print(
        f"{name}: kill -> first step {arm['kill_to_first_step_s']:.2f}s, {arm['steps_redone']} steps redone,"
        f" back at step {reached} after {arm['kill_to_caught_up_s']:.2f}s | "
        + " ".join(f"{k} {v:.2f}" for k, v in worst.items() if v),
        flush=True,
    )
    return arm


if __name__ == "__main__":
    sys.exit(main())
