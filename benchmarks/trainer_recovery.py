"""GPU recovery benchmark: fault -> next completed step, with per-phase times.

One pod per GPU (``CUDA_VISIBLE_DEVICES`` per pod, as Kubernetes gives each pod its own GPU):
``--gpus - 1`` pods train a Megatron-Core GPT (TP=1, DP=gpus-1) and one pod is a warm spare. The
script plays agent and operator, as the tests do (``tests/trainer/worker_harness.py``): at a
random moment inside a step it SIGKILLs a training worker (``faults.inject_into``), sees the EOF,
pushes a replace plan (spare takes the dead rank, state broadcast from a DP peer), and measures
until every member reports the first completed step of the new epoch. It then boots a new spare
on the freed GPU and repeats. Prints one line per fault and p50/p95 at the end, and writes JSON.

On two GPUs (``--gpus 2``) there is no room for a spare: each fault is a shrink (the survivor goes on
alone, DP 2 -> 1: kill -> its next step) and a grow (a new pod on the freed GPU joins at a step
boundary, its state from the survivor, DP 1 -> 2: the survivor's boundary step -> the first step of
DP 2), each with p50/p95.

    python benchmarks/trainer_recovery.py --gpus 4 --faults 6 --out result.json
    python benchmarks/trainer_recovery.py --gpus 2 --faults 6 --out result.json

Model default: 20 layers, hidden 2048, 16 heads, seq 2048, vocab 50304 (~1.1 B parameters),
bf16 with fp32 main params and Adam (Megatron's optimizer), global batch 6, micro-batch 1.
``--preset llama3-1b`` (any ``spec.model.preset``) trains that architecture instead; size flags
given with it override the preset (e.g. ``--preset llama3-8b --layers 8``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [
    str(REPO / "contract"),
    str(REPO / "trainer"),
    str(REPO / "localcluster"),
    str(REPO / "tests"),
    str(REPO / "tests" / "trainer"),
]

from worker_harness import WorkerCluster, WorkerProcess, make_spec, wait_for  # noqa: E402

from megatron_contract.job import Activation, MegatronJobSpec, PositionEmbedding, Precision  # noqa: E402
from megatron_contract.mesh import PlanReason, StateSource, StateSourceKind  # noqa: E402
from megatron_contract.presets import ModelPreset  # noqa: E402
from megatron_trainer.channel import Hello, PhaseTimes, Progress  # noqa: E402
from megatron_trainer.faults import Fault, inject_into  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation beyond the data)."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def kill_inside_step(
    worker: WorkerProcess, rng: random.Random, after: int | None = None, timeout: float = 120.0
) -> tuple[float, float]:
    """SIGKILL ``worker`` at a random moment inside a step: once a step past ``after`` (by default
    the step in flight) is done, after a random fraction of that step's time. Returns (when it was
    killed, the step time); the worker's channel has closed by then."""
    seen = worker.last_step() if after is None else after
    wait_for(lambda: worker.last_step() > seen, timeout, f"a step past {seen}")
    step_time = worker.of_type(Progress)[-1].step_time_seconds
    time.sleep(rng.uniform(0.1, 0.9) * step_time)  # fault timing, not synchronization
    killed_at = inject_into(worker.process.pid, Fault.SIGKILL)
    assert worker.eof.wait(30), "the SIGKILLed worker's channel did not close"
    return killed_at, step_time


_DEFAULT_SHAPE = {"layers": 20, "hidden": 2048, "heads": 16, "seq": 2048, "vocab": 50304}


def add_job_args(parser: argparse.ArgumentParser) -> None:
    """GPUs, model size, batch and seed (shared with ``trainer_loss_parity.py`` and ``checkpoint_save.py``)."""
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument(
        "--preset",
        choices=[p.value for p in ModelPreset],
        default=None,
        help="a spec.model.preset; --layers/--hidden/--heads/--seq/--vocab given with it override it",
    )
    add_shape_args(parser)
    parser.add_argument("--global-batch", type=int, default=6)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """--layers, --hidden, --heads, --seq and --vocab: the model's shape, each one given replacing the
    default GPT's (or the preset's) (shared with ``steady_state.py``)."""
    for name, default in _DEFAULT_SHAPE.items():
        parser.add_argument(f"--{name}", type=int, default=None, help=f"default {default} (or the preset's)")


_MODEL_FIELDS = {
    "layers": "num_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "seq": "seq_length",
    "vocab": "vocab_size",
}


def job_spec(
    args: argparse.Namespace, dp: int, train_iters: int, collective_timeout: float = 60.0, spares: int = 1
) -> MegatronJobSpec:
    """The benchmark's job: TP=1, one GPU per pod, ``dp`` replicas and ``spares``, bf16; prints its size."""
    given = {k: getattr(args, k) for k in _MODEL_FIELDS if getattr(args, k) is not None}
    shape = given if args.preset else {**_DEFAULT_SHAPE, **given}
    model = {_MODEL_FIELDS[k]: v for k, v in shape.items()}
    if args.preset:
        model["preset"] = args.preset
    spec = make_spec(
        replicas=dp,
        spares=spares,
        tp=1,
        gpus_per_pod=1,
        train_iters=train_iters,
        global_batch_size=args.global_batch,
        collective_timeout=collective_timeout,
        **model,
    )
    spec = spec.model_copy(update={"training": spec.training.model_copy(update={"precision": Precision.BF16})})
    m = spec.model
    h, L, V, S, f = m.hidden_size, m.num_layers, m.vocab_size, m.max_positions, m.ffn_size
    kv = m.query_groups * (m.kv_channels or h // m.num_attention_heads)
    mlp = (3 if m.activation is Activation.SWIGLU else 2) * h * f
    params = L * (2 * h * h + 2 * h * kv + mlp) + V * h * (2 if m.untie_embeddings_and_output_weights else 1)
    if m.position_embedding is PositionEmbedding.LEARNED:
        params += S * h
    name = f"preset {args.preset}, " if args.preset else ""
    print(
        f"model: {name}{L} layers, hidden {h}, ~{params / 1e9:.2f} B parameters; DP={dp} + {spares} spare(s)",
        flush=True,
    )
    return spec


def elastic(args: argparse.Namespace) -> int:
    """Two GPUs: no room for a spare. Each fault SIGKILLs a member mid-step and the survivor goes on
    alone (shrink, DP 2 -> 1, state in its own memory); a new pod then boots on the freed GPU and
    joins at a step boundary ahead of training (grow, DP 1 -> 2, its state from the survivor)."""
    rng = random.Random(args.seed)
    spec = job_spec(args, 2, train_iters=1_000_000, spares=0)
    cluster = WorkerCluster(spec, Path(tempfile.mkdtemp(prefix="recovery-")))
    names = (f"pod{i}" for i in range(1_000_000))
    gpu_of: dict[str, int] = {}

    def boot(gpu: int) -> str:
        name = next(names)
        gpu_of[name] = gpu
        cluster.start_pod(name, env={"CUDA_VISIBLE_DEVICES": str(gpu)})
        return name

    def first_step_at(pods: list[str], epoch: int) -> float:
        wait_for(
            lambda: all(any(p.epoch == epoch for p in w.of_type(Progress)) for w in cluster.workers(pods)),
            300,
            f"first step of epoch {epoch}",
            interval=0.002,
        )
        return time.time()

    def phases(pods: list[str], epoch: int) -> dict[str, float]:
        """The slowest member's time in each phase of joining ``epoch``."""
        got = [next(m.phases for m in w.of_type(PhaseTimes) if m.epoch == epoch) for w in cluster.workers(pods)]
        return {k: max(p.get(k, 0.0) for p in got) for k in _ELASTIC_PHASES}

    rows: list[dict[str, object]] = []
    try:
        members = [boot(0), boot(1)]
        cluster.wait_ready(members, timeout=400)
        cluster.assign(cluster.plan(members))
        cluster.wait_steps(members, 3, timeout=300)
        for n in range(args.faults):
            victim = members[rng.randrange(2)]
            survivor = next(p for p in members if p != victim)
            fault_at, step_time = kill_inside_step(cluster.pods[victim][0], rng)
            resume = cluster.pods[survivor][0].last_step()
            plan = cluster.plan([survivor], resume_step=resume, reason=PlanReason.SHRINK)
            cluster.assign(plan, [survivor])
            took = first_step_at([survivor], plan.epoch) - fault_at
            shrink = {"fault": n, "kind": "shrink", "fault_to_next_step_s": took, "step_time_s": step_time}
            rows.append({**shrink, **phases([survivor], plan.epoch), "resume_step": resume})
            cluster.kill_pod(victim)
            newcomer = boot(gpu_of[victim])
            wait_for(lambda p=newcomer: cluster.pods[p][0].of_type(Hello), 400, f"{newcomer} to warm up")
            boundary = cluster.pods[survivor][0].last_step() + 3
            members = [survivor, newcomer]
            plan = cluster.plan(
                members,
                resume_step=boundary,
                reason=PlanReason.GROW,
                sources={1: StateSource(rank=1, kind=StateSourceKind.PEER, peer_rank=0)},
            )
            cluster.assign(plan, members)
            cluster.wait_steps([survivor], boundary, timeout=120)
            reached_at = time.time()
            # The survivor's pause: its boundary step done -> the first step of DP 2 done.
            took = first_step_at(members, plan.epoch) - reached_at
            rows.append({"fault": n, "kind": "grow", "boundary_to_next_step_s": took, **phases(members, plan.epoch)})
            print(
                f"fault {n}: shrink {rows[-2]['fault_to_next_step_s']:.3f}s (kill -> next step), "
                f"grow {took:.3f}s (boundary -> next step) | step {step_time:.3f}s",
                flush=True,
            )
        cluster.losses(members)
    finally:
        if not rows:
            print(cluster.logs())
        cluster.close()

    summary = {}
    for kind, key in (("shrink", "fault_to_next_step_s"), ("grow", "boundary_to_next_step_s")):
        values = [float(r[key]) for r in rows if r["kind"] == kind]  # type: ignore[arg-type]
        summary[kind] = {"n": len(values), "p50_s": statistics.median(values), "p95_s": percentile(values, 95)}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "faults": rows, "args": vars(args)}, default=str))
    return 0


_ELASTIC_PHASES = ("rendezvous", "rebuild", "restore", "verify", "first_step")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=6)
    add_job_args(parser)
    args = parser.parse_args()
    if args.gpus < 2:
        parser.error("--gpus must be at least 2: a data-parallel peer holds the state of the rank that is lost")
    if args.gpus == 2:
        return elastic(args)
    rng = random.Random(args.seed)
    dp = args.gpus - 1
    spec = job_spec(args, dp, train_iters=1_000_000)

    cluster = WorkerCluster(spec, Path(tempfile.mkdtemp(prefix="recovery-")))
    gpu_of: dict[str, int] = {}
    counter = 0

    def boot(gpu: int) -> str:
        nonlocal counter
        name = f"pod{counter}"
        counter += 1
        gpu_of[name] = gpu
        cluster.start_pod(name, env={"CUDA_VISIBLE_DEVICES": str(gpu)})
        return name

    results = []
    try:
        t0 = time.time()
        members = [boot(g) for g in range(dp)]
        spare = boot(dp)
        cluster.wait_ready([*members, spare], timeout=400)
        print(f"workers warm in {time.time() - t0:.1f}s", flush=True)
        cluster.assign(cluster.plan(members))
        cluster.wait_steps(members, 3, timeout=300)
        steps = [p.step_time_seconds for p in cluster.pods[members[0]][0].of_type(Progress)][1:]
        print(f"step time {statistics.median(steps):.3f}s", flush=True)

        for n in range(args.faults):
            victim_pod = members[rng.randrange(len(members))]
            victim = cluster.pods[victim_pod][0]
            fault_at, step_time = kill_inside_step(victim, rng)
            eof_at = victim.eof_at or time.time()
            survivors = [p for p in members if p != victim_pod]
            resume = max(w.last_step() for w in cluster.workers(members))
            new_members = [spare if p == victim_pod else p for p in members]
            dead_rank = members.index(victim_pod)
            sources = {
                dead_rank: StateSource(
                    rank=dead_rank, kind=StateSourceKind.PEER, peer_rank=(dead_rank + 1) % len(members)
                )
            }
            plan = cluster.plan(new_members, resume_step=resume, reason=PlanReason.REPLACE, sources=sources)
            plan_at = time.time()
            cluster.assign(plan, new_members)
            epoch = plan.epoch

            def first_steps(e: int = epoch, pods: list[str] = new_members) -> list[Progress] | None:
                got = [next((p for p in w.of_type(Progress) if p.epoch == e), None) for w in cluster.workers(pods)]
                return None if any(g is None for g in got) else got  # type: ignore[return-value]

            wait_for(first_steps, 300, f"first step of epoch {epoch}", interval=0.002)
            done_at = time.time()
            phases = {
                w.pod: next(m.phases for m in w.of_type(PhaseTimes) if m.epoch == epoch)
                for w in cluster.workers(new_members)
            }
            survivor_phases = [phases[p] for p in survivors]
            row = {
                "fault": n,
                "epoch": epoch,
                "victim_rank": dead_rank,
                "fault_to_next_step_s": done_at - fault_at,
                "fault_to_eof_s": eof_at - fault_at,
                "fault_to_plan_s": plan_at - fault_at,
                "detect_s": max(p.get("detected_at_unix", plan_at) for p in survivor_phases) - fault_at,
                # Fault -> the survivors' failed step returns (the spare starts at once).
                "step_exit_s": max(p.get("step_exit", 0.0) for p in survivor_phases),
                "abort_s": max(p.get("abort", 0.0) for p in survivor_phases),
                # The NCCL aborts themselves, off the critical path (worker/abort.py); 0 when the
                # first step came before they finished.
                "abort_nccl_s": max(p.get("abort_nccl", 0.0) for p in survivor_phases),
                "rendezvous_s": max(p["rendezvous"] for p in phases.values()),
                "rebuild_s": max(p["rebuild"] for p in phases.values()),
                "restore_s": max(p["restore"] for p in phases.values()),
                "verify_s": max(p["verify"] for p in phases.values()),
                "first_step_s": max(p["first_step"] for p in phases.values()),
                "step_time_s": step_time,
                "resume_step": resume,
                "phases_by_pod": phases,
            }
            results.append(row)
            print(
                f"fault {n}: rank {dead_rank} -> next step {row['fault_to_next_step_s']:.3f}s | detect "
                f"{row['detect_s']:.3f} step_exit {row['step_exit_s']:.3f} abort {row['abort_s']:.3f} "
                f"(nccl {row['abort_nccl_s']:.3f}) rendezvous {row['rendezvous_s']:.3f} "
                f"rebuild {row['rebuild_s']:.3f} restore {row['restore_s']:.3f} verify {row['verify_s']:.3f} "
                f"first_step {row['first_step_s']:.3f}",
                flush=True,
            )
            members = new_members
            cluster.kill_pod(victim_pod)  # reap it (already dead)
            if n + 1 < args.faults:
                spare = boot(gpu_of[victim_pod])
                t = time.time()
                wait_for(lambda s=spare: cluster.pods[s][0].of_type(Hello), 400, "the new spare")
                print(f"new spare warm in {time.time() - t:.1f}s", flush=True)
        # Same seed, same mesh: losses of all members agree at every step (checked by losses()).
        cluster.losses(members)
    finally:
        if not results:
            print(cluster.logs())
        cluster.close()

    totals = [r["fault_to_next_step_s"] for r in results]
    summary = {
        "n": len(totals),
        "p50_s": statistics.median(totals),
        "p95_s": percentile(totals, 95),
        "max_s": max(totals),
        "phases_p50": {
            k: statistics.median(r[k] for r in results)
            for k in (
                "detect_s",
                "step_exit_s",
                "abort_s",
                "abort_nccl_s",
                "rendezvous_s",
                "rebuild_s",
                "restore_s",
                "verify_s",
                "first_step_s",
            )
        },
        "target_p95_s": 2.5,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "faults": results, "args": vars(args)}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
