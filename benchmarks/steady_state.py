"""Steady-state cost of the worker: the same training in a plain Megatron-Core loop and under our
worker, alternated in one run; and, per model configuration, tokens/s and memory per GPU.

Two arms train the same job on the same GPUs (one process per GPU each, DP = number of GPUs):

- **plain**: a plain Megatron-Core training loop, no agent, no epochs, no watchdog. Model, DDP
  wrapper, optimizer (``get_megatron_optimizer``) and LR scheduler come from the worker's own
  builder (``megatron_trainer.worker.model.build_train_state``), the step is Megatron's
  ``forward_backward_func`` then ``optimizer.step()`` and ``scheduler.step()``, the data the worker's
  mock tokens; the loss is summed and all-reduced over DP every step but read on the host only at
  the end of a window, as Megatron-LM's training loop logs it.
- **worker**: the real worker process (``python -m megatron_trainer.worker``), started and fed a
  plan as the agent does (``tests/trainer/worker_harness.py``), training in one epoch: channel
  reader and watchdog threads, per-micro-batch dropout reseeding, the abortable commit, the loss
  read every step, a ``Progress`` message per step.

Both arms stay alive, warm, on the same GPUs; one trains while the other waits. The plain arm waits
for a command between windows; the worker arm is frozen (SIGSTOP to each worker's process group)
just after every worker reported the window's last step, before its next step reaches a collective,
and thawed (SIGCONT) for its next window. The watchdog's limit is set past the longest freeze. Each
window trains ``--warmup`` steps, not counted (the first one spans the freeze), then ``--steps``
measured steps; windows alternate (plain, worker, worker, plain, ...) ``--rounds`` times.

Step time of a window: the plain arm synchronizes the device before and after its measured steps;
for the worker, the time between the arrivals of its ``Progress`` messages for the step before the
window and the window's last step (the worker reads the loss every step, so it is in step with the
device there). Per-step times (for p50) are host timestamps at each step's end in both arms.
Overhead = worker / plain - 1 over all measured steps (target <= 1 %). ``--decompose`` adds a third
arm, the worker's own step function (``worker/step.py``) run by the plain process: it splits the
overhead into the step function's share and the worker process's (threads, channel, messages).

Configurations (``--configs``, each run in turn with fresh processes):

- ``gpt``: the GPT of the other trainer benchmarks (~1.1 B: 20 layers, hidden 2048, 16 heads,
  seq 2048, vocab 50304), Megatron's plain Adam, constant LR, clipping 1.0;
- ``gpt-zero1``: that GPT with the recipe below;
- ``llama3-1b``: ``spec.model.preset: llama3-1b`` (1.24 B, seq cut to 2048 as in the other
  benchmarks: attention is unfused without Transformer Engine) with the recipe: Megatron's
  distributed optimizer (ZeRO-1), warmup 10 steps then cosine decay, weight decay 0.1, clipping 1.0,
  Adam betas 0.9/0.95. The distributed optimizer needs ``spec.checkpoint``: a directory is given,
  with an interval no window reaches (what a save costs is ``checkpoint_save.py``'s figure).

Memory per GPU: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` of the plain arm
(the same build as the worker's), and each process's device memory as NVML sees it where
``pynvml`` is importable (the worker's includes what its warm-up as a spare reserved).

    python benchmarks/steady_state.py --configs gpt llama3-1b --out result.json

Runs on every visible GPU (``--gpus`` fewer); without CUDA on CPU processes with gloo (a smoke
test: ``--gpus 2 --layers 2 --hidden 64 --heads 8 --seq 32 --vocab 256``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# trainer_recovery puts the source folders and the worker harness on sys.path.
from trainer_recovery import add_shape_args, job_spec
from worker_harness import WorkerCluster, WorkerProcess, spawn_with_channel, wait_for

from megatron_contract import wire
from megatron_contract.job import (
    CheckpointSpec,
    LrDecayStyle,
    LrScheduleSpec,
    MegatronJobSpec,
    OptimizerSpec,
)
from megatron_trainer.agent.supervisor import signal_group
from megatron_trainer.channel import Progress

TARGET_OVERHEAD_PCT = 1.0
# The worker's collective timeout: its watchdog must not take a freeze for a hung step.
WATCHDOG_LIMIT_S = 1800.0

# Llama-3-style pretraining settings (issue 9): ZeRO-1, warmup then cosine, weight decay, clipping.
RECIPE: dict[str, Any] = {
    "lr": 3e-4,
    "optimizer": OptimizerSpec(
        adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.1, clip_grad=1.0, distributed=True
    ),
    "lr_schedule": LrScheduleSpec(warmup_steps=10, decay_style=LrDecayStyle.COSINE, min_lr=3e-5, decay_steps=5000),
}
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt": {"preset": None, "recipe": False},
    "gpt-zero1": {"preset": None, "recipe": True},
    "llama3-1b": {"preset": "llama3-1b", "recipe": True, "seq": 2048},
}


# -- the plain arm: one process per GPU ------------------------------------------------------------


def start_rank(rank: int, world: int, store: Any) -> tuple[MegatronJobSpec, Any]:
    """Start a benchmark's rank as the worker starts one: the worker's environment defaults (so only
    the worker machinery differs), this rank's device (``CUDA_VISIBLE_DEVICES`` names its GPU; CPU
    shims where there is none), the default process group on ``store`` and Megatron's parallel state
    for the job in the environment. Returns that job and the device. The caller may have imported
    torch and made ``store``, but not used CUDA yet. Also used by step_replay.py."""
    from megatron_trainer.worker.settings import apply_process_defaults

    apply_process_defaults()
    import warnings
    from datetime import timedelta

    warnings.filterwarnings("ignore", module="megatron")
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_trainer.worker.rendezvous import device_for

    spec = MegatronJobSpec.model_validate_json(os.environ[wire.ENV_JOB_SPEC])
    device = device_for(0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        from megatron_trainer import cpu_compat

        cpu_compat.install()
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=30),
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        context_parallel_size=spec.cp,
        create_gloo_process_groups=False,
    )
    return spec, device


def plain_rank_main(argv: list[str]) -> int:
    """One rank of the plain Megatron-Core loop; serves ``run`` / ``memory`` / ``exit`` commands
    (JSON lines) on the socket ``--channel-fd``."""
    parser = argparse.ArgumentParser(prog="steady_state.py plain-rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--channel-fd", type=int, required=True)
    args = parser.parse_args(argv)

    from datetime import timedelta

    import torch
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=600))
    spec, device = start_rank(args.rank, args.world, dist.PrefixStore("plain/", client))
    from megatron.core import parallel_state

    from megatron_contract.mesh import BatchGeometry
    from megatron_trainer.worker.data import MockTokens
    from megatron_trainer.worker.model import build_train_state, sync_initial_weights

    ts = build_train_state(spec, device, initialize=True)
    sync_initial_weights(ts)
    dp = parallel_state.get_data_parallel_world_size()
    batch = BatchGeometry.split(spec.training.global_batch_size, spec.training.micro_batch_size, dp)
    source = MockTokens(spec.training.seed, spec.model.vocab_size, spec.model.seq_length)
    loop = PlainLoop(ts, source, batch, parallel_state.get_data_parallel_rank(), device)

    sock = socket.socket(fileno=args.channel_fd)
    stream = sock.makefile("rw", encoding="utf-8")

    def reply(message: dict[str, Any]) -> None:
        stream.write(json.dumps(message) + "\n")
        stream.flush()

    reply(
        {
            "ready": True,
            "parameters": sum(p.numel() for p in ts.model.module.parameters()),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        }
    )
    for line in stream:
        command = json.loads(line)
        if command["cmd"] == "run":
            reply(loop.window(command["warmup"], command["steps"], command.get("variant", "plain")))
        elif command["cmd"] == "memory":
            reply(_memory(device))
        else:
            break
    dist.destroy_process_group()
    return 0


class PlainLoop:
    """Megatron-Core's training step with nothing around it (Megatron-LM's ``train_step`` shape)."""

    def __init__(self, ts: Any, source: Any, batch: Any, dp_rank: int, device: Any) -> None:
        self.ts, self.source, self.batch, self.dp_rank, self.device = ts, source, batch, dp_rank, device
        self.loss_total: Any = None

    def train_step(self) -> None:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_trainer.worker.data import micro_batches

        ts = self.ts
        mbs = list(micro_batches(self.source, self.batch, self.dp_rank, ts.step, self.device))
        seq = mbs[0].tokens.shape[1]
        positions = torch.arange(seq, device=self.device).unsqueeze(0)

        def forward_step(data_iterator: Any, model: Any) -> Any:
            mb = next(data_iterator)
            batch = {
                "tokens": mb.tokens,
                "labels": mb.labels,
                "position_ids": positions,
                "loss_mask": torch.ones_like(mb.labels, dtype=torch.float),
            }
            return ts.forward_step(iter([batch]), model)  # the job's forward step, as the worker's

        ts.model.zero_grad_buffer()
        ts.optimizer.zero_grad()
        reported = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(mbs),
            model=[ts.model],
            num_microbatches=len(mbs),
            seq_length=seq,
            micro_batch_size=self.batch.micro_batch_size,
            forward_only=False,
        )
        ts.optimizer.step()
        ts.scheduler.step(1)
        # The loss for the log: summed over micro-batches and DP replicas on the device, read later.
        totals = torch.stack([r["lm loss"] for r in reported]).sum(0)
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        self.loss_total = totals
        ts.step += 1

    def worker_step(self) -> None:
        """The worker's own step function (``worker/step.py``: dropout reseeded per micro-batch, the
        loss read before the update, the abortable commit), without the worker process around it."""
        from megatron_trainer.worker.step import train_step

        train_step(self.ts, self.source, self.batch, self.dp_rank, self.device, lambda: None)
        self.loss_total = None

    def window(self, warmup: int, steps: int, variant: str = "plain") -> dict[str, Any]:
        """``warmup`` steps, then ``steps`` timed ones: device-synced start and end, host time at
        each step's end. ``variant`` ``worker-step`` trains with :meth:`worker_step`."""
        from megatron_trainer.worker.step import guard_commit

        step, unguard = self.train_step, lambda: None
        if variant == "worker-step":
            step = self.worker_step
            unguard = guard_commit(self.ts, lambda: False, self.device)  # as the worker installs it per epoch
        try:
            for _ in range(warmup):
                step()
            self._sync()
            start = time.perf_counter()
            ends = []
            for _ in range(steps):
                step()
                ends.append(time.perf_counter())
            self._sync()
            end = time.perf_counter()
        finally:
            unguard()  # the plain arm's next window runs the plain step
        loss = float(self.loss_total[0] / self.loss_total[1]) if self.loss_total is not None else float("nan")
        return {"start": start, "ends": ends, "end": end, "loss": loss, "step": self.ts.step}

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _memory(device: Any) -> dict[str, Any]:
    import torch

    if device.type != "cuda":
        return {}
    return {
        "max_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "max_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "allocated_bytes": torch.cuda.memory_allocated(device),
    }


class PlainArm:
    """The plain loop's processes, one per GPU, driven over a socket each."""

    def __init__(self, spec: MegatronJobSpec, gpus: int, gpu: bool, env: dict[str, str], workdir: Path) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.ranks: list[tuple[subprocess.Popen[bytes], Any, Path]] = []
        for rank in range(gpus):
            log_path = workdir / f"plain-{rank}.log"
            command = [sys.executable, str(Path(__file__).resolve()), "plain-rank", "--rank", str(rank)]
            command += ["--world", str(gpus), "--store-port", str(self.store.port)]
            rank_env = {**env, **({"CUDA_VISIBLE_DEVICES": str(rank)} if gpu else {})}
            process, ours = spawn_with_channel(command, rank_env, log_path)
            self.ranks.append((process, ours.makefile("rw", encoding="utf-8"), log_path))
        self.info: dict[str, Any] = {}

    @property
    def pids(self) -> list[int]:
        return [p.pid for p, _, _ in self.ranks]

    def _ask_all(self, command: dict[str, Any]) -> list[dict[str, Any]]:
        for _, stream, _ in self.ranks:
            stream.write(json.dumps(command) + "\n")
            stream.flush()
        return [self._read(i) for i in range(len(self.ranks))]

    def _read(self, index: int) -> dict[str, Any]:
        process, stream, log_path = self.ranks[index]
        line = stream.readline()
        if not line:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
            raise RuntimeError(f"plain rank {index} exited (code {process.poll()}):\n{tail}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def wait_ready(self) -> None:
        infos = [self._read(i) for i in range(len(self.ranks))]  # every rank must be ready
        self.info = infos[0]

    def window(self, warmup: int, steps: int, variant: str = "plain") -> dict[str, Any]:
        return self._ask_all({"cmd": "run", "warmup": warmup, "steps": steps, "variant": variant})[0]

    def memory(self) -> list[dict[str, Any]]:
        return self._ask_all({"cmd": "memory"})

    def logs(self) -> str:
        return "\n".join(
            f"===== plain rank {i} =====\n" + "\n".join(p.read_text(errors="replace").splitlines()[-40:])
            for i, (_, _, p) in enumerate(self.ranks)
        )

    def close(self) -> None:
        for _, stream, _ in self.ranks:
            with contextlib.suppress(OSError, ValueError):
                stream.write(json.dumps({"cmd": "exit"}) + "\n")
                stream.flush()
        deadline = time.monotonic() + 30
        for process, stream, _ in self.ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            signal_group(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
            with contextlib.suppress(OSError):
                stream.close()


# -- the worker arm ---------------------------------------------------------------------------------


class FreezableCluster(WorkerCluster):
    """The test harness, plus: the arrival time of every ``Progress``, and a freeze of all workers
    as soon as every one of them has reported a given step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.arrivals: dict[str, dict[int, float]] = {}
        self._freeze_at: int | None = None
        self._freeze_lock = threading.Lock()
        self.frozen = threading.Event()
        super().__init__(*args, **kwargs)

    def _pump(self, worker: WorkerProcess) -> None:
        receive = worker.channel.recv_to_agent
        arrivals = self.arrivals.setdefault(worker.name, {})

        def timed() -> Any:
            message = receive()
            if isinstance(message, Progress):
                arrivals[message.step] = time.perf_counter()
                self._maybe_freeze()
            return message

        worker.channel.recv_to_agent = timed  # type: ignore[method-assign]
        super()._pump(worker)

    def _maybe_freeze(self) -> None:
        with self._freeze_lock:
            target = self._freeze_at
            if target is None:
                return
            if any(self._reported(w) < target for w in self.workers()):
                return
            # Every worker has launched all of step ``target``'s work: none is inside a collective
            # that a frozen peer would leave spinning on its GPU.
            for w in self.workers():
                signal_group(w.process.pid, signal.SIGSTOP)
            self._freeze_at = None
            self.frozen.set()

    def _reported(self, worker: WorkerProcess) -> int:
        """The last step ``worker`` reported (0 before its first)."""
        return max(self.arrivals.get(worker.name, {}), default=0)

    def freeze_after(self, step: int) -> None:
        """Freeze every worker once all have reported ``step`` (call before they can reach it)."""
        with self._freeze_lock:
            self.frozen.clear()
            self._freeze_at = step
        self._maybe_freeze()

    def thaw(self) -> None:
        for w in self.workers():
            signal_group(w.process.pid, signal.SIGCONT)

    def last_step(self) -> int:
        return min(self._reported(w) for w in self.workers())

    def close(self) -> None:
        self.thaw()  # a frozen worker reads no Shutdown
        super().close()


# -- one configuration --------------------------------------------------------------------------


def config_spec(args: argparse.Namespace, name: str, gpus: int, checkpoint_dir: Path) -> MegatronJobSpec:
    """The job of configuration ``name``: TP 1, one GPU per pod, DP = ``gpus``, bf16."""
    config = CONFIGS[name]
    shape = argparse.Namespace(
        preset=config["preset"],
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq=args.seq if args.seq is not None else config.get("seq"),
        vocab=args.vocab,
        global_batch=args.global_batch or 4 * gpus,
    )
    spec = job_spec(shape, dp=gpus, train_iters=10_000_000, collective_timeout=WATCHDOG_LIMIT_S)
    spec = spec.model_copy(update={"spares": 0})
    if config["recipe"]:
        training = spec.training.model_copy(update=RECIPE)
        checkpoint = CheckpointSpec(path=str(checkpoint_dir), interval_steps=10_000_000, async_save=True)
        spec = spec.model_copy(update={"training": training, "checkpoint": checkpoint})
    # Validated as the worker will read it (the distributed optimizer needs spec.checkpoint).
    return MegatronJobSpec.model_validate_json(json.dumps(spec.to_wire()))


def run_config(args: argparse.Namespace, name: str, gpus: int, gpu: bool) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"steady-{name}-"))
    spec = config_spec(args, name, gpus, workdir / "checkpoints")
    tokens_per_step = spec.training.global_batch_size * spec.model.seq_length
    print(
        f"== {name}: DP {gpus}, global batch {spec.training.global_batch_size} x {spec.model.seq_length} tokens, "
        f"optimizer {'distributed' if spec.training.optimizer.distributed else 'plain'} Adam, "
        f"LR {spec.training.lr_schedule.decay_style.value} (warmup {spec.training.lr_schedule.warmup_steps}), "
        f"weight decay {spec.training.optimizer.weight_decay}, clip {spec.training.optimizer.clip_grad}",
        flush=True,
    )
    # No sample log: a production worker keeps none (the harness turns it on for the tests).
    cluster = FreezableCluster(spec, workdir, extra_env={"MEGATRON_WORKER_SAMPLE_LOG": ""})
    pods = [f"w{i}" for i in range(gpus)]
    plain: PlainArm | None = None
    windows: list[dict[str, Any]] = []
    try:
        t0 = time.time()
        for i, pod in enumerate(pods):
            cluster.start_pod(pod, env={"CUDA_VISIBLE_DEVICES": str(i)} if gpu else {})
        env = cluster.env("plain")
        env.pop("MEGATRON_WORKER_SAMPLE_LOG", None)
        plain = PlainArm(spec, gpus, gpu, env, workdir)
        cluster.wait_ready(pods, timeout=900)
        cluster.freeze_after(args.warmup)
        cluster.assign(cluster.plan(pods))
        wait_for(cluster.frozen.is_set, 900, f"the workers' first {args.warmup} steps")
        plain.wait_ready()
        plain.window(args.warmup, 0)
        print(f"both arms warm in {time.time() - t0:.1f}s", flush=True)

        first = cluster.pods[pods[0]][0]
        arms = ["plain", "worker", *(["worker-step"] if args.decompose else [])]
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                if arm != "worker":
                    got = plain.window(args.warmup, args.steps, arm)
                    ends = [got["start"], *got["ends"]]
                    total = got["end"] - got["start"]
                    internal: list[float] = []
                else:
                    before = cluster.last_step()
                    ref, last = before + args.warmup, before + args.warmup + args.steps
                    cluster.freeze_after(last)
                    cluster.thaw()
                    wait_for(cluster.frozen.is_set, 900, f"worker steps {before}..{last}", interval=0.01)
                    arrivals = cluster.arrivals[first.name]
                    ends = [arrivals[s] for s in range(ref, last + 1)]
                    total = ends[-1] - ends[0]
                    internal = [p.step_time_seconds for p in first.of_type(Progress) if ref < p.step <= last]
                steps = [b - a for a, b in itertools.pairwise(ends)]
                row = {
                    "round": r,
                    "arm": arm,
                    "mean_s": total / args.steps,
                    "p50_s": statistics.median(steps),
                    "step_s": steps,
                }
                if internal:
                    row["worker_reported_step_s"] = internal
                windows.append(row)
                print(
                    f"round {r} {arm:11s}: mean {row['mean_s']:.4f}s p50 {row['p50_s']:.4f}s "
                    f"({tokens_per_step / row['mean_s']:,.0f} tokens/s)",
                    flush=True,
                )
        memory = plain.memory()
        nvml = _nvml_memory(
            {**{p: "plain" for p in plain.pids}, **{w.process.pid: "worker" for w in cluster.workers()}}
        )
        loss = [p.loss for p in first.of_type(Progress)][-1]
    except BaseException:
        print(cluster.logs())
        if plain is not None:
            print(plain.logs())
        raise
    finally:
        cluster.close()
        if plain is not None:
            plain.close()
    return summarize(name, spec, gpus, tokens_per_step, windows, memory, nvml, plain.info, loss)


def summarize(
    name: str,
    spec: MegatronJobSpec,
    gpus: int,
    tokens_per_step: int,
    windows: list[dict[str, Any]],
    memory: list[dict[str, Any]],
    nvml: dict[str, list[int]],
    info: dict[str, Any],
    worker_loss: float,
) -> dict[str, Any]:
    arms: dict[str, dict[str, Any]] = {}
    for arm in dict.fromkeys(w["arm"] for w in windows):
        rows = [w for w in windows if w["arm"] == arm]
        mean = statistics.fmean(r["mean_s"] for r in rows)
        every = [s for r in rows for s in r["step_s"]]
        arms[arm] = {
            "mean_s": mean,
            "p50_s": statistics.median(every),
            "window_means_s": [r["mean_s"] for r in rows],
            "tokens_per_s": tokens_per_step / mean,
            "tokens_per_s_per_gpu": tokens_per_step / mean / gpus,
        }
    plain, worker = arms["plain"], arms["worker"]
    overhead = (worker["mean_s"] / plain["mean_s"] - 1) * 100
    overhead_p50 = (worker["p50_s"] / plain["p50_s"] - 1) * 100
    # The spread between windows of one arm: an overhead below it is noise.
    spread = max((max(a["window_means_s"]) - min(a["window_means_s"])) / a["mean_s"] * 100 for a in arms.values())
    gib = 1 << 30
    mem = {
        "max_allocated_gib": max((m.get("max_allocated_bytes", 0) for m in memory), default=0) / gib,
        "max_reserved_gib": max((m.get("max_reserved_bytes", 0) for m in memory), default=0) / gib,
        "state_allocated_gib": max((m.get("allocated_bytes", 0) for m in memory), default=0) / gib,
        "nvml_process_gib": {k: [v / gib for v in vs] for k, vs in nvml.items()},
    }
    m = spec.model
    summary = {
        "config": name,
        "device": info.get("device_name"),
        "gpus": gpus,
        "parameters": info.get("parameters"),
        "model": {
            "preset": m.preset.value if m.preset else None,
            "layers": m.num_layers,
            "hidden": m.hidden_size,
            "heads": m.num_attention_heads,
            "query_groups": m.query_groups,
            "seq": m.seq_length,
            "vocab": m.vocab_size,
        },
        "training": spec.training.to_wire(),
        "tokens_per_step": tokens_per_step,
        **arms,
        "overhead_pct": overhead,
        "overhead_p50_pct": overhead_p50,
        "window_spread_pct": spread,
        "target_overhead_pct": TARGET_OVERHEAD_PCT,
        "memory_per_gpu": mem,
        "worker_last_loss": worker_loss,
        "windows": windows,
    }
    params = f"{summary['parameters'] / 1e9:.2f} B" if summary["parameters"] else "?"
    print(f"-- {name} on {gpus} x {summary['device']}: {params} parameters", flush=True)
    if "worker-step" in arms:
        # The worker's step function alone, in the plain process: what is left is the process.
        summary["worker_step_overhead_pct"] = (arms["worker-step"]["mean_s"] / plain["mean_s"] - 1) * 100
    for arm, a in arms.items():
        print(
            f"   {arm:11s}: step mean {a['mean_s']:.4f}s p50 {a['p50_s']:.4f}s, {a['tokens_per_s']:,.0f} tokens/s "
            f"({a['tokens_per_s_per_gpu']:,.0f} per GPU); windows "
            + " / ".join(f"{v:.4f}" for v in a["window_means_s"]),
            flush=True,
        )
    verdict = "within" if overhead <= TARGET_OVERHEAD_PCT else "over"
    print(
        f"   overhead {overhead:+.2f} % (mean), {overhead_p50:+.2f} % (p50); spread between windows "
        f"{spread:.2f} %; {verdict} the {TARGET_OVERHEAD_PCT:.0f} % target",
        flush=True,
    )
    if "worker_step_overhead_pct" in summary:
        print(
            f"   of which the worker's step function {summary['worker_step_overhead_pct']:+.2f} % "
            "(in the plain process), the rest the worker process around it",
            flush=True,
        )
    if mem["max_allocated_gib"]:
        print(
            f"   memory per GPU (plain loop): peak allocated {mem['max_allocated_gib']:.1f} GiB, peak reserved "
            f"{mem['max_reserved_gib']:.1f} GiB, state {mem['state_allocated_gib']:.1f} GiB; per process (NVML): "
            + ", ".join(f"{k} {max(v):.1f} GiB" for k, v in mem["nvml_process_gib"].items() if v),
            flush=True,
        )
    return summary


def _nvml_memory(roles: dict[int, str]) -> dict[str, list[int]]:
    """Device memory of each process by role, as NVML reports it; empty without pynvml."""
    try:
        import pynvml
    except ImportError:
        return {}
    out: dict[str, list[int]] = {}
    try:
        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid in roles and p.usedGpuMemory is not None:
                    out.setdefault(roles[p.pid], []).append(int(p.usedGpuMemory))
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as err:
        print(f"NVML: {err}", flush=True)
    return out


def main() -> int:
    if sys.argv[1:2] == ["plain-rank"]:
        return plain_rank_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["gpt", "llama3-1b"])
    parser.add_argument("--gpus", type=int, default=None, help="default: every visible GPU (on CPU: 2 processes)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations; each trains a window per arm")
    parser.add_argument("--warmup", type=int, default=5, help="uncounted steps at the start of each window")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per window")
    parser.add_argument(
        "--decompose",
        action="store_true",
        help="a third arm: the worker's step function (worker/step.py) run by the plain process",
    )
    parser.add_argument("--global-batch", type=int, default=None, help="default 4 micro-batches per GPU")
    add_shape_args(parser)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.warmup < 2 or args.steps < 2:
        parser.error("--warmup and --steps must be at least 2 (the first step of a worker window spans its freeze)")
    import torch

    gpu = torch.cuda.is_available()
    visible = torch.cuda.device_count() if gpu else 0
    gpus = args.gpus or (visible if gpu else 2)
    if gpu and gpus > visible:
        parser.error(f"--gpus {gpus}, but {visible} CUDA devices are visible")
    results = [run_config(args, name, gpus, gpu) for name in args.configs]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"configs": results, "args": vars(args)}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
