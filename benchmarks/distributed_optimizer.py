"""Megatron's distributed optimizer recovering in memory, in one run: what the buddy copies cost in
steady training, a shrink that takes the lost shard from its buddy's copy, a growth that reshards,
and the same failure recovered from the newest checkpoint.

Two GPUs (the first two of ``--gpus``): pods a and b train (TP 1, DP 2, one GPU each; bf16, the
distributed optimizer, an asynchronous checkpoint every ``--checkpoint-interval`` steps). In order:

1. steady: ``--rounds`` rounds of an epoch without buddy copies and one with copies for each of
   ``--steady-intervals`` (refreshed every so many steps; default ``--replica-interval``) and each of
   ``--steady-budgets`` (``replicaCostPercent``: the workers calibrate, agree on an interval, and the
   timed steps start after that), switched at step boundaries, every other round in reverse order,
   ``--steps`` timed steps each (a whole number of intervals, more when an interval needs it): the
   wall time per step of each and the copies' overhead at each interval or budget. An epoch's
   first ``SKIP`` steps and its first refresh are left out: they are paid once an epoch (the first
   step's own costs; the first refresh also connects the pair's transfers), and are printed from
   the workers' logs with where each refresh's time went (worker/refresh_times.py). The wall time
   includes what a refresh blocks between steps, which the workers' own step time does not. Each
   round's arms are also compared with that round's no-copies epoch (``overhead_percent_by_round``,
   and by the workers' median step): no-copies epochs more than ``NOISY_PERCENT`` apart are
   flagged as a noisy host, whose slow epoch the averaged overheads would hide;
2. shrink in memory: b is SIGKILLed mid-step; a goes on alone (DP 2 -> 1) with its own shard and
   the copy of b's it keeps, as the operator's planner says with in-memory restore on: kill -> a's
   first step, and the steps redone;
3. grow in memory: pod c boots on b's GPU and joins at a step boundary (DP 1 -> 2), its shard
   resharded from a's: the boundary reached -> the first step of both (one step of the new mesh
   included; a's step time before is printed beside it);
4. shrink from the checkpoint, for comparison: c is SIGKILLed mid-step and a reloads the newest
   checkpoint (the plan without in-memory restore): kill -> first step, and the steps redone.

Before the workers start, the rate of a pinned device-to-host copy is measured on one GPU alone and
on both at once: the refreshes' copies into host memory are bound by it. Then every step's samples
are checked (each committed step exactly its global batch; a redone step
counts in its final epoch). Prints and writes the figures, with each epoch's phase times.

    python benchmarks/distributed_optimizer.py --gpus 2 --out benchmarks/results/distributed_optimizer_2xH200.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("contract", "operator", "trainer", "localcluster", "tests", "tests/trainer")]
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from paired_steps import split_by_refresh  # noqa: E402
from steady_state import RECIPE  # noqa: E402
from trainer_recovery import add_job_args, job_spec, kill_inside_step  # noqa: E402
from worker_harness import WorkerCluster, in_memory_plan, wait_for  # noqa: E402

from localcluster.chaos import check_history, read_samples  # noqa: E402
from megatron_contract.job import CheckpointSpec, MegatronJobSpec  # noqa: E402
from megatron_contract.mesh import MeshPlan, PlanReason, StateSource, StateSourceKind  # noqa: E402
from megatron_trainer.channel import Hello, PhaseTimes, Progress  # noqa: E402
from megatron_trainer.worker.checkpoint_files import newest_complete  # noqa: E402
from megatron_trainer.worker.copy_schedule import CopySchedule  # noqa: E402
from megatron_trainer.worker.refresh_times import logged  # noqa: E402
from megatron_trainer.worker.settings import ENV_COPY_TRANSPORT  # noqa: E402

SKIP = 2  # an epoch's first steps: the first step's own costs
#: No-copies epochs further apart than this (percent of the fastest) are flagged as a noisy host.
NOISY_PERCENT = 5.0
#: The shortest interval whose epochs also measure a refresh against the steps beside it.
PAIRED_MIN = 3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16, help="timed steps of each steady epoch")
    parser.add_argument("--replica-interval", type=int, default=1, help="replicaIntervalSteps")
    parser.add_argument(
        "--steady-intervals",
        type=lambda v: [int(n) for n in v.split(",")],
        default=None,
        help="intervals of the steady arms with copies, comma-separated (default: --replica-interval)",
    )
    parser.add_argument(
        "--steady-budgets",
        type=lambda v: [float(n) for n in v.split(",")],
        default=[],
        help="replicaCostPercent of steady arms with copies (at --replica-interval), comma-separated",
    )
    parser.add_argument(
        "--replica-cost-percent",
        type=float,
        default=None,
        help="the spec's replicaCostPercent, for the failures after the steady arms (their kill waits for the "
        "interval to be agreed)",
    )
    parser.add_argument("--checkpoint-interval", type=int, default=10)
    parser.add_argument("--collective-timeout", type=float, default=300.0, help="seconds (the job's)")
    parser.add_argument(
        "--recipe",
        action="store_true",
        help="train with steady_state.py's Llama-3 recipe (warmup + cosine, weight decay, clipping)",
    )
    parser.add_argument(
        "--copy-transport",
        choices=["nccl", "gloo"],
        default="nccl",
        help="the buddy copies' transport on GPU (gloo: host memory over TCP, to compare)",
    )
    parser.add_argument(
        "--no-checkpoint-arm", action="store_true", help="leave out 4. (the shrink from the checkpoint)"
    )
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument("--logs", type=Path, default=None, help="copy the workers' logs into this directory")
    add_job_args(parser)
    parser.set_defaults(gpus=2)
    args = parser.parse_args()
    if args.gpus < 2 or args.global_batch % 2:
        parser.error("needs 2 GPUs (or CPU processes) and an even --global-batch")
    intervals = args.steady_intervals or [args.replica_interval]
    if min(intervals) < 1 or args.steps < 1:
        parser.error("intervals and --steps are at least 1")
    if any(not 0 < b <= 100 for b in [*args.steady_budgets, args.replica_cost_percent or 1]):
        parser.error("budgets are percentages in (0, 100]")
    gpu = torch.cuda.is_available()
    if gpu and torch.cuda.device_count() < 2:
        parser.error(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="distopt-"))
    # A save's gather of the distributed optimizer's state (fully reshardable) holds its step over
    # a minute at 1 B: the collective timeout must not take it for a hang.
    spec = job_spec(args, dp=2, train_iters=1_000_000, spares=0, collective_timeout=args.collective_timeout)
    spec = _distributed(spec, args, workdir)
    tokens_per_step = spec.training.global_batch_size * spec.model.seq_length
    cluster = WorkerCluster(spec, workdir)
    result: dict[str, Any] = {"args": vars(args)}
    t0 = time.monotonic()
    if gpu:
        result["host_copy_gb_per_s"] = rates = host_copy_rates()
        print(f"pinned device-to-host copies: {json.dumps(rates)}", flush=True)

    def boot(pod: str, device: int) -> None:
        env = {ENV_COPY_TRANSPORT: args.copy_transport}
        cluster.start_pod(pod, env={**env, "CUDA_VISIBLE_DEVICES": str(device)} if gpu else env)

    def assign(plan: MeshPlan, pods: list[str]) -> MeshPlan:
        cluster.assign(plan, pods)
        return plan

    def first_step_of(epoch: int, pods: list[str]) -> float:
        return cluster.wait_first_step(epoch, pods, timeout=600)

    def phases(epoch: int, pods: list[str]) -> dict[str, dict[str, float]]:
        return {w.pod: next(m.phases for m in w.of_type(PhaseTimes) if m.epoch == epoch) for w in cluster.workers(pods)}

    def boundary(pods: list[str], ahead: int) -> int:
        return max(w.last_step() for w in cluster.workers(pods)) + ahead

    def steps_of(epoch: int, pods: list[str]) -> dict[int, float]:
        """The step time the workers measure (the step alone) of each step of ``epoch`` every member
        reported, the slower member's, by step count."""
        reported = [
            {p.step: p.step_time_seconds for p in w.of_type(Progress) if p.epoch == epoch}
            for w in cluster.workers(pods)
        ]
        every = set(reported[0]).intersection(*reported[1:])
        return {step: max(times[step] for times in reported) for step in sorted(every)}

    def step_times(epoch: int, pods: list[str]) -> list[float]:
        """:func:`steps_of`'s times in order, past the epoch's first ``SKIP`` steps."""
        return list(steps_of(epoch, pods).values())[SKIP:]

    def pod_log(pod: str) -> str:
        return cluster.pods[pod][0].log_path.read_text(errors="replace")

    def agreed(epoch: int, first: int, interval: int, budget: float) -> dict[str, Any]:
        """Wait for ``epoch``'s workers to agree on their refresh interval (worker/copy_schedule.py);
        pod a's log line of it: the interval agreed, the step it holds from, and what a measured."""
        at = CopySchedule(interval, budget, first).agree_at
        assert at is not None
        cluster.wait_steps(["a", "b"], at + 1, timeout=900)
        pattern = (
            rf"epoch {epoch} rank 0: buddy copies every (\d+) steps from step (\d+) \(agreed; this rank proposed "
            rf"(\d+): a refresh cost ([\d.]+) s beside a ([\d.]+) s step"
        )
        found = re.search(pattern, pod_log("a"))
        assert found, f"pod a logged no agreed interval in epoch {epoch}"
        keys = ("interval", "from_step", "proposed_by_a", "cost_s_by_a", "clear_step_s_by_a")
        return {k: (float(v) if "_s_" in k else int(v)) for k, v in zip(keys, found.groups(), strict=True)}

    def restored(epoch: int) -> dict[str, int]:
        """The step pod a restored its shards at in ``epoch`` (agreed at runtime), the steps redone."""
        found = re.search(
            rf"epoch {epoch} rank 0: optimizer shards of step (\d+) restored in memory \(\w+, (\d+) steps redone\)",
            pod_log("a"),
        )
        assert found, f"pod a logged no in-memory restore in epoch {epoch}"
        return {"restored_step": int(found[1]), "steps_redone": int(found[2])}

    def log(line: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f} s] {line}", flush=True)

    def report(name: str, row: dict[str, Any]) -> None:
        result[name] = row
        shown = {k: v for k, v in row.items() if k != "phases_by_pod"}
        print(f"{name}: {json.dumps(shown)}", flush=True)

    try:
        boot("a", 0)
        boot("b", 1)
        cluster.wait_ready(["a", "b"], timeout=600)
        log("a and b warm")
        plan = assign(cluster.plan(["a", "b"], buddies=True), ["a", "b"])
        cluster.wait_steps(["a", "b"], 1, timeout=600)

        # 1. Steady state: epochs without copies and with copies at each interval or budget, alternating.
        budgets = args.steady_budgets
        kinds = ["none", *(f"copies every {n}" for n in intervals), *(f"copies within {b:g} %" for b in budgets)]
        settings = [(0, None), *((n, None) for n in intervals), *((args.replica_interval, b) for b in budgets)]
        medians: dict[str, list[float]] = {k: [] for k in kinds}
        walls: dict[str, list[float]] = {k: [] for k in kinds}
        memory: dict[str, list[int]] = {}  # the peak memory used on each GPU (MiB), by arm
        windows: dict[str, list[tuple[int, int]]] = {k: [] for k in kinds}  # steps whose boundaries were timed
        paired: dict[str, list[dict[str, float]]] = {}  # refresh_cost, epoch by epoch (refreshes >= PAIRED_MIN apart)
        calibrated: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds[len(intervals) + 1 :]}
        arms: list[tuple[str, int]] = []  # (kind, epoch) of each steady epoch
        for round_ in range(args.rounds):
            # Every other round runs its arms in reverse (none, 1, 4 / 4, 1, none): a host that drifts
            # slower or faster over the minutes of the rounds then favours no arm.
            order = list(zip(kinds, settings, strict=True))
            for kind, (interval, budget) in order if round_ % 2 == 0 else order[::-1]:
                start = boundary(["a", "b"], 2)
                plan = cluster.plan(["a", "b"], resume_step=start, reason=PlanReason.MIGRATE, buddies=interval > 0)
                if plan.optimizer_state is not None:
                    state = plan.optimizer_state.model_copy(
                        update={"replica_interval_steps": interval, "replica_cost_percent": budget}
                    )
                    plan = plan.model_copy(update={"optimizer_state": state})
                assign(plan, ["a", "b"])
                if budget is None:
                    every = interval
                    # The first refresh starts within an interval and ends by the next step boundary.
                    warm = start + SKIP + (interval + 1 if interval else 0)
                else:  # timed once the interval is agreed, past its first refresh
                    calibrated[kind].append(agreed(plan.epoch, start, interval, budget))
                    every = calibrated[kind][-1]["interval"]
                    warm = calibrated[kind][-1]["from_step"] + every + 1
                measured = -(-args.steps // max(every, 1)) * max(every, 1)  # whole intervals
                cluster.wait_steps(["a", "b"], warm, timeout=900)
                began = time.monotonic()
                with GpuMemory() as used:
                    cluster.wait_steps(["a", "b"], warm + measured, timeout=900)
                walls[kind].append((time.monotonic() - began) / measured)
                windows[kind].append((warm, warm + measured - 1))
                arms.append((kind, plan.epoch))
                memory[kind] = [max(m, u) for m, u in zip(memory.get(kind, used.peak), used.peak, strict=True)]
                medians[kind].append(statistics.median(step_times(plan.epoch, ["a", "b"])))
                if every >= PAIRED_MIN:
                    after = {n: t for n, t in steps_of(plan.epoch, ["a", "b"]).items() if n > warm}
                    paired.setdefault(kind, []).append(refresh_cost(after, every))
                log(f"steady epoch {plan.epoch} ({kind}): {walls[kind][-1]:.3f} s a step (wall)")
        # The failure below finds copies every --replica-interval steps (the spec's); the switch also
        # ends the last steady epoch, whose workers then log its refreshes' times.
        start = boundary(["a", "b"], 2)
        plan = assign(cluster.plan(["a", "b"], resume_step=start, reason=PlanReason.MIGRATE, buddies=True), ["a", "b"])
        cluster.wait_steps(["a", "b"], start + SKIP, timeout=900)
        failure_interval = None
        if args.replica_cost_percent is not None:  # the failure lands past the calibration
            failure_interval = agreed(plan.epoch, start, args.replica_interval, args.replica_cost_percent)
            result["failure_interval"] = failure_interval
            past = failure_interval["from_step"] + 2 * failure_interval["interval"]
            cluster.wait_steps(["a", "b"], past, timeout=900)
        without = statistics.median(walls["none"])
        # Each round's arms against that round's no-copies epoch: a host that slows one whole epoch
        # (seen on shared GPU machines) shows as rounds that disagree, not as a quiet average.
        by_round = {k: _overheads(walls[k], walls["none"]) for k in kinds[1:]}
        step_by_round = {k: _overheads(medians[k], medians["none"]) for k in kinds[1:]}
        spread = 100 * (max(walls["none"]) / min(walls["none"]) - 1)
        if spread > NOISY_PERCENT:
            log(
                f"WARNING: the no-copies epochs' wall times differ by {spread:.1f} %: a noisy host; the overheads"
                f" by round say which rounds it spoilt: {json.dumps(by_round)}"
            )
        # A checkpoint save holds its step (with this optimizer ~a minute at 1 B): an arm whose timed
        # steps include one measures the save, not the copies.
        saves = [int(n) for n in re.findall(r"checkpoint of step (\d+) started", pod_log("a"))]
        spoilt = {k: [n for n in saves for lo, hi in windows[k] if lo <= n <= hi] for k in kinds}
        for kind, steps in spoilt.items():
            if steps:
                log(f"WARNING: the {kind} arm timed the checkpoint save of step(s) {steps}, not only the copies")
        report(
            "steady",
            {
                "wall_s_per_step_without": round(without, 4),
                "tokens_per_s_without": round(tokens_per_step / without),
                **{f"{kind}: wall_s_per_step": round(statistics.median(walls[kind]), 4) for kind in kinds[1:]},
                **{
                    f"{kind}: overhead_percent": _overhead(statistics.median(walls[kind]), without)
                    for kind in kinds[1:]
                },
                "overhead_percent_by_round": by_round,  # wall per step, against the round's no-copies epoch
                "median_step_overhead_percent_by_round": step_by_round,  # the workers' median step, likewise
                "no_copies_spread_percent": round(spread, 2),
                "arms_in_order": [kind for kind, _ in arms],  # as they ran, round after round
                "epoch_wall_s_per_step": walls,
                "epoch_median_step_time_s": medians,  # the step alone, without the refresh around it
                "gpu_memory_used_mib_peak": memory,  # nvidia-smi, per GPU; empty on CPU
                "checkpoint_saves_timed": {k: v for k, v in spoilt.items() if v},
                # within each epoch of a rare refresh: the steps beside one against the others (below)
                "paired_refresh_cost": paired,
                "paired_refresh_cost_percent": {
                    k: round(statistics.median(r["percent"] for r in rows), 2) for k, rows in paired.items() if rows
                },
                # with a budget: each epoch's agreed interval and what pod a measured calibrating
                "calibrated": calibrated,
                # per epoch with copies and pod: the first refresh's times, the others' medians
                "refresh_times": {
                    f"{kind} (epoch {epoch})": {pod: refresh_times(pod_log(pod), epoch) for pod in ("a", "b")}
                    for kind, epoch in arms
                    if kind != "none"
                },
            },
        )
        cluster.wait_steps(["a", "b"], boundary(["a", "b"], 2), timeout=300)

        # 2. Shrink in memory: b dies, a takes b's shard from the copy it keeps.
        log("shrink in memory: SIGKILL of b")
        killed_at, step_time = kill_inside_step(cluster.pods["b"][0], rng)
        cluster.kill_pod("b")  # as its agent does: the worker's children (checkpoint writers) too
        # As the operator does when b's agent reports its worker dead (the survivor may be waiting on
        # the refresh in flight, which only a newer plan or gloo's timeout ends), from the step a
        # holds.
        survivors_step = max(w.last_step() for w in cluster.workers(["a"]))
        log(f"b is dead; a holds step {survivors_step}")
        previous = plan
        plan = assign(in_memory_plan(cluster, ["a"], previous, survivors_step, PlanReason.SHRINK), ["a"])
        end = first_step_of(plan.epoch, ["a"])
        state = plan.optimizer_state
        assert state is not None
        report(
            "shrink_in_memory",
            {
                "kill_to_first_step_s": round(end - killed_at, 3),
                "step_time_before_s": round(step_time, 3),
                "steps_redone_planned": survivors_step - plan.resume_step,
                **restored(plan.epoch),
                "source": state.source.value,
                "copies": [c.model_dump() for c in state.copies],
                "phases_by_pod": phases(plan.epoch, ["a"]),
            },
        )

        # 3. Grow in memory: c joins on b's GPU at a step boundary; its shard is resharded from a's.
        log("grow in memory: c boots")
        boot("c", 1)
        wait_for(lambda: cluster.pods["c"][0].of_type(Hello), 600, "pod c to warm up")
        at = boundary(["a"], 3)
        previous = plan
        plan = assign(in_memory_plan(cluster, ["a", "c"], previous, at, PlanReason.GROW), ["a", "c"])
        cluster.wait_steps(["a"], at, timeout=300)
        reached = time.time()
        end = first_step_of(plan.epoch, ["a", "c"])
        report(
            "grow_in_memory",
            {
                "boundary_to_first_step_s": round(end - reached, 3),
                "survivor_step_time_before_s": round(statistics.median(step_times(previous.epoch, ["a"])), 3),
                "boundary": at,
                **restored(plan.epoch),
                "phases_by_pod": phases(plan.epoch, ["a", "c"]),
            },
        )
        cluster.wait_steps(["a", "c"], at + 4, timeout=600)
        if args.no_checkpoint_arm:
            _check_samples(cluster, spec, ["a", "c"], result)
        else:
            wait_for(lambda: newest_complete(_checkpoint_root(spec)) is not None, 900, "a complete checkpoint")

            # 4. The same shrink from the newest checkpoint.
            log("shrink from the checkpoint: SIGKILL of c")
            killed_at, step_time = kill_inside_step(cluster.pods["c"][0], rng)
            # As its agent does; the plan follows at once, as in the shrink above: a waiting on a buddy
            # refresh from the dead c sees no failure of its own before the collective timeout.
            cluster.kill_pod("c")
            survivors_step = max(w.last_step() for w in cluster.workers(["a"]))
            saved = newest_complete(_checkpoint_root(spec))
            assert saved is not None, "no complete checkpoint to restore"
            sources = {0: StateSource(rank=0, kind=StateSourceKind.CHECKPOINT, checkpoint_step=saved)}
            plan = assign(
                cluster.plan(["a"], resume_step=saved, reason=PlanReason.SHRINK, sources=sources),
                ["a"],
            )
            end = first_step_of(plan.epoch, ["a"])
            report(
                "shrink_from_checkpoint",
                {
                    "kill_to_first_step_s": round(end - killed_at, 3),
                    "step_time_before_s": round(step_time, 3),
                    "steps_redone": survivors_step - saved,
                    "checkpoint_step": saved,
                    "phases_by_pod": phases(plan.epoch, ["a"]),
                },
            )
            cluster.wait_steps(["a"], survivors_step + 2, timeout=600)

            _check_samples(cluster, spec, ["a"], result)
            in_memory = result["shrink_in_memory"]["kill_to_first_step_s"]
            from_checkpoint = result["shrink_from_checkpoint"]["kill_to_first_step_s"]
            result["shrink_ratio_in_memory_to_checkpoint"] = round(in_memory / from_checkpoint, 3)
            print(f"shrink in memory / from the checkpoint: {result['shrink_ratio_in_memory_to_checkpoint']}")
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.close()
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            for path in workdir.glob("*.log"):
                shutil.copy(path, args.logs / path.name)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))
    return 0


def _overheads(arm: list[float], without: list[float]) -> list[float]:
    """Each round's overhead in percent: ``arm``'s figure against the no-copies epoch of its round."""
    return [_overhead(a, n) for a, n in zip(arm, without, strict=True)]


def _overhead(figure: float, without: float) -> float:
    """``figure`` against ``without``, in percent (two decimals)."""
    return round(100 * (figure / without - 1), 2)


def refresh_cost(times: dict[int, float], interval: int) -> dict[str, float]:
    """A refresh's cost to the step beside it, measured inside one epoch of copies every
    ``interval`` (>= :data:`PAIRED_MIN`) steps: ``times`` (step time by step count) splits into the
    steps that ran beside a refresh (it starts after the step count reaches a multiple of the
    interval and runs beside the next step) and those at least two steps after one (a refresh that
    outlasts its step slows the next). The median of each, their difference, and that difference
    against a clear step: the overhead copies every step would have, if a refresh held only its own
    step, less the training thread's own time per refresh between steps (``refresh_times``'
    ``host_s``, a few ms). Epochs alternate minutes apart, and a shared host drifted by more than the
    copies cost between them (5-25 % on the machines measured); steps a second apart do not."""
    beside, clear = split_by_refresh(times, interval)
    if not beside or not clear:
        raise ValueError(f"no steps to compare at interval {interval}: {sorted(times)}")
    on, off = statistics.median(beside), statistics.median(clear)
    return {
        "beside_s": round(on, 4),
        "clear_s": round(off, 4),
        "cost_s": round(on - off, 4),
        "percent": _overhead(on, off),
        "percent_a_step_at_interval": round((on - off) / off * 100 / interval, 2),  # the cost spread over its steps
        "steps_beside": len(beside),
        "steps_clear": len(clear),
    }


def refresh_times(log: str, epoch: int) -> dict[str, dict[str, float]]:
    """From a worker's log: ``epoch``'s first refresh's times and the medians of the others'."""
    found = [line for line in logged(log) if line.epoch == epoch]
    if not found:
        return {}
    return {"first": found[0].first} | ({"others": found[0].others} if found[0].others else {})


def host_copy_rates(gib: float = 2.0, repeats: int = 3) -> dict[str, float]:
    """GB/s of a pinned device-to-host copy of ``gib`` GiB: one GPU alone, and each of the first two
    GPUs copying at once (the best of ``repeats``); the memory is given back after."""
    n = int(gib * (1 << 30)) // 4
    devices = [torch.device("cuda", i) for i in range(2)]
    sources = [torch.ones(n, device=d) for d in devices]
    targets = [torch.empty(n, pin_memory=True) for _ in devices]

    def rate(count: int) -> float:
        for d in devices:
            torch.cuda.synchronize(d)
        began = time.perf_counter()
        for source, target in zip(sources[:count], targets[:count], strict=True):
            target.copy_(source, non_blocking=True)
        for d in devices[:count]:
            torch.cuda.synchronize(d)
        return n * 4 / (time.perf_counter() - began) / 1e9

    rate(2)  # warm-up: the first copy maps the pinned pages
    result = {  # in this order: one GPU alone first
        "one_gpu_alone": max(rate(1) for _ in range(repeats)),
        "each_of_two_at_once": max(rate(2) for _ in range(repeats)),
    }
    sources.clear()
    targets.clear()
    torch.cuda.empty_cache()
    return {k: round(v, 2) for k, v in result.items()}


def _check_samples(cluster: WorkerCluster, spec: MegatronJobSpec, pods: list[str], result: dict[str, Any]) -> None:
    """Every committed step consumed its global batch once (a redone step counts in its final epoch)."""
    done = min(w.last_step() for w in cluster.workers(pods))
    problems, _, redone = check_history(
        {k: v for k, v in read_samples(cluster.sample_dir).items() if k[1] < done},
        done,
        spec.training.global_batch_size,
        victims={"b", "c"},
    )
    if problems:
        raise AssertionError(problems)
    # Losses are not compared across epochs: a step redone at DP 1 after the checkpoint was trained
    # at DP 2 before, and its loss sums micro-batches in another order.
    result["samples"] = {"steps_checked": done, "steps_trained_again": redone}
    print(f"samples: steps 0..{done - 1} each consumed its global batch once; trained again: {redone}")


def _distributed(spec: MegatronJobSpec, args: argparse.Namespace, workdir: Path) -> MegatronJobSpec:
    if args.recipe:
        spec = spec.model_copy(update={"training": spec.training.model_copy(update=RECIPE)})
        print(f"recipe: {RECIPE['lr_schedule'].to_wire()}, optimizer {RECIPE['optimizer'].to_wire()}", flush=True)
    wire = spec.to_wire()
    wire["training"]["optimizer"].update({"distributed": True, "replicaIntervalSteps": args.replica_interval})
    if args.replica_cost_percent is not None:
        wire["training"]["optimizer"]["replicaCostPercent"] = args.replica_cost_percent
    root = args.checkpoint_dir or workdir / "checkpoints"
    wire["checkpoint"] = CheckpointSpec(path=str(root), interval_steps=args.checkpoint_interval).to_wire()
    return MegatronJobSpec.model_validate(wire)


class GpuMemory:
    """The peak memory used on each GPU (MiB, ``nvidia-smi``, every process's) while the block
    runs, sampled every 0.2 s on a thread; no GPUs: none."""

    def __init__(self) -> None:
        self.peak: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="gpu-memory", daemon=True)

    def __enter__(self) -> GpuMemory:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _sample(self) -> None:
        while True:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            used = [int(line) for line in out.split()]
            self.peak = [max(p, u) for p, u in zip(self.peak or used, used, strict=True)]
            if self._stop.wait(0.2):
                return


def _checkpoint_root(spec: MegatronJobSpec) -> Path:
    assert spec.checkpoint is not None
    return Path(spec.checkpoint.path)


if __name__ == "__main__":
    sys.exit(main())
