"""Bringing an older copy of the distributed optimizer's shard forward by replaying logged updates
(worker/step_log.py): is the result bitwise the shard that training reached, what does the replay
take, what does logging cost a step, and how many bytes a step logs against the whole shard.

This is the premise of a cheaper buddy refresh: a buddy that holds the shard of step ``s`` and the
logged inputs (clipped fp32 gradients, hyperparameters) of the steps after it has the shard of the
newest step, though each refresh moved a third of the bytes of a whole shard.

Ranks (one process per GPU, DP = ``--gpus``, TP 1; ``--cpu``: gloo, the tests' tiny GPT) build the
worker's model, DDP wrapper, distributed optimizer and scheduler with a real recipe (warm-up then
cosine learning rate, weight decay 0.1, clipping 1.0, Adam betas 0.9 / 0.95: the logged
hyperparameters change from step to step), train ``--warmup`` steps with the worker's step function
(worker/step.py), then each rank:

1. copies its flat shard (worker/optimizer_shards.py) and Adam's step count to host memory: the
   old copy, of step ``s``;
2. trains ``--steps`` steps with the log on, then ``--steps`` with it off (each step's time: what
   the log's copies of the gradients to pinned host memory, on the step's stream, cost it);
3. after step ``s + steps`` (the end of 2's logged half) has copied the shard again: the truth;
4. loads the old copy and replays the log onto it (timed, device-synced): compared with the truth
   element by element (bitwise: ``torch.equal`` of the bits; mismatching elements are counted per
   column: main parameter, exp_avg, exp_avg_sq) and Adam's step counts;
5. loads the old copy again and replays the log twice, the first half of the parameters, then the
   rest (as a rolling refresh would bring parts of a shard forward from copies of different steps),
   compared the same way;
6. the control: loads the old copy and replays all but the last update, which must not compare
   equal (else the comparison could not tell).

Prints and writes (``--out``) per rank: the bytes of a shard and of a step's log, the step times,
the replay's time, and the comparisons; exits 1 unless every rank's replays were bitwise and its
control was not.

    python benchmarks/step_replay.py --gpus 2 --global-batch 8 --out benchmarks/results/step_replay_2xH200.json
    python benchmarks/step_replay.py --cpu --gpus 2 --steps 3 --warmup 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("contract", "operator", "trainer", "localcluster", "tests", "tests/trainer")]
sys.path.insert(0, str(REPO / "benchmarks"))

from steady_state import RECIPE, start_rank  # noqa: E402
from trainer_recovery import add_job_args, job_spec  # noqa: E402
from worker_harness import make_spec  # noqa: E402

from localcluster.cluster import free_port  # noqa: E402
from megatron_contract import wire  # noqa: E402
from megatron_contract.job import CheckpointSpec, MegatronJobSpec  # noqa: E402
from megatron_trainer.agent.supervisor import signal_group  # noqa: E402

#: Columns of a flat shard, by name, for the comparisons.
COLUMN_NAMES = ("param", "exp_avg", "exp_avg_sq")


def _spec(args: argparse.Namespace, checkpoint_dir: Path) -> MegatronJobSpec:
    """The job: the tests' tiny GPT (``--cpu``) or the benchmarks' (``--layers`` ...), bf16 on GPU,
    trained with steady_state.py's recipe (its hyperparameters change from step to step)."""
    if args.cpu:
        spec = make_spec(replicas=args.gpus, tp=1, gpus_per_pod=1, global_batch_size=args.global_batch)
    else:
        spec = job_spec(args, dp=args.gpus, train_iters=1_000_000, spares=0)
    training = spec.training.model_copy(update={**RECIPE, "train_iters": 1_000_000})
    # The distributed optimizer needs a checkpoint directory in the spec; nothing is saved here.
    checkpoint = CheckpointSpec(path=str(checkpoint_dir), interval_steps=10_000_000)
    spec = spec.model_copy(update={"training": training, "checkpoint": checkpoint})
    return MegatronJobSpec.model_validate_json(json.dumps(spec.to_wire()))  # validated as the ranks read it


# -- one rank ---------------------------------------------------------------------------------------


def rank_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="step_replay.py rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args(argv)

    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    store = dist.TCPStore("127.0.0.1", args.store_port, args.world, args.rank == 0, timeout=timedelta(seconds=600))
    spec, device = start_rank(args.rank, args.world, store)  # the worker's environment, device and groups

    from megatron_contract.mesh import BatchGeometry
    from megatron_trainer.worker.data import MockTokens
    from megatron_trainer.worker.model import build_train_state, inner_optimizers, sync_initial_weights
    from megatron_trainer.worker.optimizer_shards import flat_shards, load_flat_shards
    from megatron_trainer.worker.step import train_step
    from megatron_trainer.worker.step_log import StepLog, replay

    ts = build_train_state(spec, device, initialize=True)
    sync_initial_weights(ts)
    dp_rank = parallel_state.get_data_parallel_rank()
    batch = BatchGeometry.split(spec.training.global_batch_size, spec.training.micro_batch_size, args.world)
    source = MockTokens(spec.training.seed, spec.model.vocab_size, spec.model.seq_length)

    def sync() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def step() -> float:
        start = sync()
        train_step(ts, source, batch, dp_rank, device, lambda: None)  # reads the loss: in step with the device
        return sync() - start

    def step_counts() -> list[int]:
        opts = inner_optimizers(ts.optimizer)
        return [int(opt.state[p]["step"]) for opt in opts for group in opt.param_groups for p in group["params"]]

    def snapshot() -> tuple[list[torch.Tensor], list[int]]:
        return [s.to("cpu") for s in flat_shards(ts.optimizer)], step_counts()

    def restore(old: tuple[list[torch.Tensor], list[int]]) -> None:
        shards, counts = old
        if len(set(counts)) != 1:
            raise RuntimeError(f"Adam's step counts differ across parameters: {sorted(set(counts))}")
        load_flat_shards(ts.optimizer, [s.to(device) for s in shards], step=counts[0])

    def compare(truth: tuple[list[torch.Tensor], list[int]]) -> dict[str, Any]:
        got = snapshot()
        mismatches = dict.fromkeys(COLUMN_NAMES, 0)
        max_abs = dict.fromkeys(COLUMN_NAMES, 0.0)
        for want, have in zip(truth[0], got[0], strict=True):
            for c, name in enumerate(COLUMN_NAMES):
                a, b = want[:, c], have[:, c]
                differ = a.view(torch.int32) != b.view(torch.int32)  # bits: NaNs and -0.0 count too
                mismatches[name] += int(differ.sum())
                if differ.any():
                    max_abs[name] = max(max_abs[name], float((a - b).abs().max()))
        return {
            "bitwise": not any(mismatches.values()) and got[1] == truth[1],
            "mismatching_elements": mismatches,
            "max_abs_difference": max_abs,
            "step_counts_equal": got[1] == truth[1],
        }

    for _ in range(args.warmup):
        step()
    old = snapshot()
    log = StepLog(ts.optimizer)
    logged_times = [step() for _ in range(args.steps)]
    log.close()
    truth = snapshot()
    plain_times = [step() for _ in range(args.steps)]
    shard_bytes = sum(s.numel() * s.element_size() for s in old[0])

    restore(old)
    start = sync()
    replay(ts.optimizer, log.updates)
    replay_seconds = sync() - start
    whole = compare(truth)

    params = [p for opt in inner_optimizers(ts.optimizer) for g in opt.param_groups for p in g["params"]]
    first_half = {id(p) for p in params[: len(params) // 2]}
    restore(old)
    replay(ts.optimizer, log.updates, only=lambda p: id(p) in first_half)
    replay(ts.optimizer, log.updates, only=lambda p: id(p) not in first_half)
    halves = compare(truth)

    # The control: one update short of the log must differ, or the comparison could not tell.
    restore(old)
    replay(ts.optimizer, log.updates[:-1])
    one_short = compare(truth)

    result = {
        "rank": args.rank,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "parameters": sum(p.numel() for p in ts.model.module.parameters()),
        "shard_bytes": shard_bytes,
        "log_bytes_per_step": log.nbytes // args.steps,
        "updates_logged": len(log.updates),
        "lr_logged": [u.groups[0]["lr"] for u in log.updates if u.optimizer == 0],
        "step_logged_s": logged_times,
        "step_plain_s": plain_times,
        "replay_s": replay_seconds,
        "replay_s_per_step": replay_seconds / args.steps,
        "whole": whole,
        "halves": halves,
        "one_short": one_short,
        "from_step": old[1][0],
        "to_step": truth[1][0],
    }
    dist.destroy_process_group()
    print(json.dumps(result), flush=True)
    return 0


# -- the launcher -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start one rank per GPU (each in a process group of its own), wait for their results, and
    end every group still running (one failed, the others wait for it)."""
    with tempfile.TemporaryDirectory(prefix="step-replay-") as tmp:
        spec = _spec(args, Path(tmp) / "ckpt")
        port = free_port()
        procs = []
        try:
            for rank in range(args.gpus):
                env = dict(os.environ, **{wire.ENV_JOB_SPEC: json.dumps(spec.to_wire())})
                env["CUDA_VISIBLE_DEVICES"] = "" if args.cpu else str(rank)
                cmd = [sys.executable, __file__, "rank", "--rank", str(rank), "--world", str(args.gpus)]
                cmd += ["--store-port", str(port), "--warmup", str(args.warmup), "--steps", str(args.steps)]
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, process_group=0))
            results = []
            for rank, proc in enumerate(procs):
                out, _ = proc.communicate(timeout=args.timeout)
                if proc.returncode != 0:
                    raise RuntimeError(f"rank {rank} exited with {proc.returncode} (its stderr is above)")
                results.append(json.loads(out.strip().splitlines()[-1]))
            return results
        finally:
            for proc in procs:
                if proc.poll() is None:
                    signal_group(proc.pid, 9)
                    proc.wait()


def report(results: list[dict[str, Any]]) -> None:
    for r in results:
        logged, plain = statistics.median(r["step_logged_s"]), statistics.median(r["step_plain_s"])
        print(
            f"rank {r['rank']} ({r['device']}, {r['parameters'] / 1e6:.1f} M parameters): shard "
            f"{r['shard_bytes'] / 2**20:.1f} MiB, logged per step {r['log_bytes_per_step'] / 2**20:.1f} MiB "
            f"({100 * r['log_bytes_per_step'] / r['shard_bytes']:.1f} %); steps {r['from_step']} -> {r['to_step']}"
        )
        print(
            f"  step median: logged {logged:.4f} s, plain {plain:.4f} s ({100 * (logged / plain - 1):+.2f} %); "
            f"replay {r['replay_s']:.4f} s ({r['replay_s_per_step'] * 1000:.1f} ms a step)"
        )
        for name in ("whole", "halves", "one_short"):
            c = r[name]
            print(
                f"  replay {name}: bitwise {c['bitwise']}, mismatching elements {c['mismatching_elements']}, "
                f"max |difference| {c['max_abs_difference']}, step counts equal {c['step_counts_equal']}"
            )


def main() -> int:
    if sys.argv[1:2] == ["rank"]:
        return rank_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_job_args(parser)
    parser.set_defaults(gpus=2, global_batch=8)
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU, the tests' tiny GPT")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the old copy")
    parser.add_argument("--steps", type=int, default=4, help="steps logged, and as many timed without the log")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    if args.gpus < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--gpus and --steps must be at least 1, --warmup at least 0")
    print(f"step replay: {args.gpus} rank(s) on {'CPU' if args.cpu else 'GPU'}, {args.steps} steps logged", flush=True)
    results = run(args)
    report(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "ranks": results}, indent=1)
        )
        print(f"wrote {args.out}")
    exact = all(r["whole"]["bitwise"] and r["halves"]["bitwise"] and not r["one_short"]["bitwise"] for r in results)
    print("replay " + ("bitwise on every rank (and one update short is not)" if exact else "NOT bitwise"))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
