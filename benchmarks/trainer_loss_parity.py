"""Loss after an in-place recovery vs a failure-free run with the same seed (GPU or CPU).

Two runs of the same job (``trainer_recovery.py``'s model, TP=1, DP=gpus-1, one GPU per pod):

1. reference: ``--steps`` steps without a fault;
2. faulty: the same plus a warm spare; at a random moment inside step ``--fault-step`` a training
   worker is SIGKILLed, the spare takes its rank with state broadcast from a DP peer, and training
   goes on to ``--steps``. On two GPUs (``--gpus 2``: DP 2, no room for a spare) the survivor trains
   on alone for three steps (DP 1), then a new pod joins with its state from the survivor (DP 2).

Prints how many steps' losses are bitwise equal and the largest relative difference, before and
after the fault. ``--control`` adds a second failure-free run: its distance from the first is the
spread the kernels give without any fault.
On CPU the test suite asserts equality; on GPU some kernels are not deterministic (atomics in
backward passes), so this script reports rather than asserts.

    python benchmarks/trainer_loss_parity.py --gpus 4 --steps 60 --fault-step 20 --control
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_recovery import add_job_args, job_spec, kill_inside_step
from worker_harness import WorkerCluster

from megatron_contract.mesh import PlanReason, StateSource, StateSourceKind


def run(args: argparse.Namespace, fault: bool) -> dict[int, float]:
    """Train ``args.steps`` steps on ``gpus - 1`` pods (plus a spare when ``fault``); step -> loss.
    On two GPUs: two pods, and the fault is a shrink and a grow (:func:`shrink_and_grow`)."""
    elastic = args.gpus == 2
    dp = 2 if elastic else args.gpus - 1
    spec = job_spec(args, dp, train_iters=args.steps, spares=0 if elastic else 1)
    cluster = WorkerCluster(spec, Path(tempfile.mkdtemp(prefix="parity-")))
    try:
        members = [f"pod{g}" for g in range(dp)]
        # On two GPUs the pod that joins after the shrink warms up beside the one it replaces.
        pods = [*members, "joiner" if elastic else "spare"] if fault else members
        for gpu, pod in enumerate(pods):
            cluster.start_pod(pod, env={"CUDA_VISIBLE_DEVICES": str(min(gpu, args.gpus - 1))})
        cluster.wait_ready(pods, timeout=400)
        cluster.assign(cluster.plan(members))
        if fault and elastic:
            members = shrink_and_grow(cluster, args, members)
        elif fault:
            rng = random.Random(args.seed)
            victim_pod = members[rng.randrange(dp)]
            victim = cluster.pods[victim_pod][0]
            fault_at, _ = kill_inside_step(victim, rng, after=args.fault_step - 1, timeout=300)
            dead = members.index(victim_pod)
            sources = {dead: StateSource(rank=dead, kind=StateSourceKind.PEER, peer_rank=(dead + 1) % dp)}
            members = [p if p != victim_pod else "spare" for p in members]
            resume = max(w.last_step() for w in cluster.workers([p for p in members if p != "spare"]))
            cluster.assign(
                cluster.plan(members, resume_step=resume, reason=PlanReason.REPLACE, sources=sources), members
            )
            print(f"rank {dead} killed {time.time() - fault_at:.3f}s ago during step {resume}; spare promoted")
            cluster.kill_pod(victim_pod)
        cluster.wait_succeeded(members, timeout=600)
        return cluster.losses(cluster.pods)  # every worker that ran, checked to agree step by step
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.close()


def shrink_and_grow(cluster: WorkerCluster, args: argparse.Namespace, members: list[str]) -> list[str]:
    """Inside step ``--fault-step`` the second pod is SIGKILLed; the first trains on alone (DP 1) for
    three steps, then the pod warmed up on the same GPU joins with its state from it (DP 2 again)."""
    survivor, victim = members
    kill_inside_step(cluster.pods[victim][0], random.Random(args.seed), after=args.fault_step - 1, timeout=300)
    resume = cluster.pods[survivor][0].last_step()
    cluster.assign(cluster.plan([survivor], resume_step=resume, reason=PlanReason.SHRINK), [survivor])
    cluster.kill_pod(victim)
    boundary = resume + 3
    grown = [survivor, "joiner"]
    sources = {1: StateSource(rank=1, kind=StateSourceKind.PEER, peer_rank=0)}
    cluster.assign(cluster.plan(grown, resume_step=boundary, reason=PlanReason.GROW, sources=sources), grown)
    print(f"rank 1 killed during step {resume}; DP 1 until step {boundary}, then DP 2 again", flush=True)
    return grown


def compare(reference: dict[int, float], other: dict[int, float], args: argparse.Namespace) -> dict[str, object]:
    """How far ``other``'s losses are from the reference run's, before and after the fault step."""
    steps = sorted(reference)
    if steps != sorted(other) or steps != list(range(1, args.steps + 1)):
        raise SystemExit(f"step sets differ: reference {steps[:3]}..{steps[-3:]}, other {sorted(other)[-3:]}")
    equal = {s for s in steps if reference[s] == other[s]}
    rel = {s: abs(other[s] - reference[s]) / abs(reference[s]) for s in steps}
    after = [s for s in steps if s > args.fault_step]
    return {
        "steps": len(steps),
        "bitwise_equal_steps": len(equal),
        "bitwise_equal_after_fault": sum(1 for s in after if s in equal),
        "steps_after_fault": len(after),
        "max_rel_diff_before_fault": max((rel[s] for s in steps if s <= args.fault_step), default=0.0),
        "max_rel_diff_after_fault": max((rel[s] for s in after), default=0.0),
        "step_1": [reference[1], other[1]],
        "around_fault": {s: [reference[s], other[s]] for s in steps if abs(s - args.fault_step - 1) <= 1},
        "last_step": [reference[steps[-1]], other[steps[-1]]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fault-step", type=int, default=20)
    parser.add_argument(
        "--control", action="store_true", help="also a second failure-free run: the kernels' own run-to-run spread"
    )
    add_job_args(parser)
    args = parser.parse_args()
    if args.gpus < 2:
        parser.error("--gpus must be at least 2 (two DP replicas, so a peer holds the state)")
    if not 0 < args.fault_step < args.steps:
        parser.error("--fault-step must lie inside the run")

    reference = run(args, fault=False)
    runs = {"faulty": run(args, fault=True)}
    if args.control:
        runs["control"] = run(args, fault=False)
    summary = {name: compare(reference, losses, args) for name, losses in runs.items()}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "reference": reference, **runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
