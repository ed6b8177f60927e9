"""What slows the training step beside a buddy-copy refresh, part by part, without Megatron.

Each rank emulates a data-parallel step of the distributed optimizer at the sizes of a model of
``--params`` parameters: GEMMs of a transformer layer's shapes (the compute, about ``--step-ms``),
a reduce-scatter of fp32 gradients and an all-gather of bf16 parameters on a DP communicator of
their own, and an Adam update of its fp32 shard (12 bytes a parameter over DP). A refresh, as
worker/buddy_copies.py does it, runs on a side stream after a step: the shard assembled into one
flat tensor, copied to pinned host memory, and sent to the buddy (the next rank) over the world
communicator in chunks, the ward's chunks landing in host memory through a staging buffer.

Each arm (:data:`ARMS`) switches parts of the refresh off or changes them: only the transfers,
only the copies to host memory, a fraction of the shard's bytes, the copies to host memory issued
at a paced rate, the ward's shard received whole into GPU memory before either copy to host
memory, the ward's chunks received into two staging buffers in turn and copied out on a stream of
their own (the next transfer need not wait for the last copy out), and the bytes of a refresh by
update log (a step's gradients and a rolling part of the whole state, worker/step_log.py). An arm refreshes every
:data:`INTERVAL` steps, and its cost is the median step beside a refresh against the median step
clear of one, seconds apart in the same arm (:func:`paired_cost`): epochs minutes apart differed by
more than the cost on every host tried. ``--copy-ctas`` and
``--cta-policy`` put the transfers on a communicator of their own with that ncclConfig.

    python benchmarks/refresh_interference.py --gpus 2 --out results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import threading
import time
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from paired_steps import split_by_refresh

CHUNK = 64 << 20  # elements a transfer (and of the staging buffer), as worker/buddy_copies.CHUNK_ELEMENTS
INTERVAL = 3  # steps between refreshes: the step after one is left out of both medians
WARM_STEPS = 4  # an arm's first steps, left out


@dataclasses.dataclass(frozen=True)
class Parts:
    """What a refresh does (and whether the step runs its DP collectives)."""

    refresh: bool = True  # False: an arm of no refreshes, the control
    assemble: bool = True  # the shard into one flat tensor (a GPU copy)
    own: bool = True  # that copy to pinned host memory
    exchange: bool = True  # to the buddy, the ward's in, chunk by chunk
    ward: bool = True  # the ward's chunks to pinned host memory
    fraction: float = 1.0  # of the shard's 12 bytes a parameter
    dp: bool = True  # the step's reduce-scatter and all-gather
    pace_gbps: float = 0.0  # copies to host memory issued from a thread at most this fast (0: at once)
    decoupled: bool = False  # the ward's shard whole into GPU memory first, both copies to host after
    pipelined: bool = False  # two staging buffers, the ward's chunks copied out on a stream of their own


#: arm -> what its refreshes do
ARMS: dict[str, Parts] = {
    "none": Parts(refresh=False),
    "full": Parts(),
    "exchange_only": Parts(own=False, ward=False),
    "host_only": Parts(exchange=False, ward=False),
    "assemble_only": Parts(own=False, exchange=False, ward=False),
    "full_third": Parts(fraction=1 / 3),
    "full_sixth": Parts(fraction=1 / 6),
    "third_decoupled": Parts(fraction=1 / 3, decoupled=True),
    "sixth_decoupled": Parts(fraction=1 / 6, decoupled=True),
    "none_no_dp": Parts(refresh=False, dp=False),
    "full_no_dp": Parts(dp=False),
    "full_decoupled": Parts(decoupled=True),
    "full_pipelined": Parts(pipelined=True),
    "third_pipelined": Parts(fraction=1 / 3, pipelined=True),
    # A refresh by update log (worker/step_log.py): each step's gradients (a third of the bytes) and
    # a rolling eighth / sixteenth of the whole state.
    "log_rolling_8_pipelined": Parts(fraction=1 / 3 + 1 / 8, pipelined=True),
    "log_rolling_16_pipelined": Parts(fraction=1 / 3 + 1 / 16, pipelined=True),
    # Without the own copy to host memory (the ward's only), and a sixth (bf16 gradients).
    "third_pipelined_no_own": Parts(fraction=1 / 3, pipelined=True, own=False),
    "sixth_pipelined": Parts(fraction=1 / 6, pipelined=True),
    "sixth_pipelined_no_own": Parts(fraction=1 / 6, pipelined=True, own=False),
    "host_both_only": Parts(exchange=False, decoupled=True),
    "host_paced_40": Parts(exchange=False, ward=False, pace_gbps=40),
    "host_paced_20": Parts(exchange=False, ward=False, pace_gbps=20),
}


def _moved(shard: int, parts: Parts, chunk: int = CHUNK) -> int:
    """Elements a refresh moves: whole chunks of its fraction of the shard's three fp32 tensors."""
    return int(shard * 3 * parts.fraction) // chunk * chunk


def paired_cost(times: list[float], warm: int = WARM_STEPS) -> dict[str, float]:
    """The median step beside a refresh against the median step clear of one, from an arm's step
    ``times`` (``paired_steps.split_by_refresh``, each index as its step count): a refresh started
    after step i (i % INTERVAL == 0) runs beside step i + 1, and step i + INTERVAL, the next to start
    one, is clear of it. The first ``warm`` steps are left out."""
    beside, clear = split_by_refresh({i: t for i, t in enumerate(times) if i >= warm}, INTERVAL)
    if not beside or not clear:
        raise ValueError(f"{len(times)} steps hold no step beside a refresh and none clear of one after {warm}")
    b, c = statistics.median(beside), statistics.median(clear)
    return {
        "median_step_s": statistics.median(times[warm:]),
        "beside_s": b,
        "clear_s": c,
        "cost_ms": (b - c) * 1000,
        "cost_percent": (b / c - 1) * 100,
        "pairs": min(len(beside), len(clear)),
    }


def _gemms(device: torch.device, tokens: int, hidden: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    h4 = torch.randn(tokens, 4 * hidden, device=device, dtype=torch.bfloat16)
    shapes = [(x, 3 * hidden), (x, hidden), (x, 4 * hidden), (h4, hidden)]
    return [(a, torch.randn(a.shape[1], n, device=device, dtype=torch.bfloat16)) for a, n in shapes]


def _compute(gemms: list[tuple[torch.Tensor, torch.Tensor]], rounds: int) -> None:
    for _ in range(rounds):
        for a, b in gemms:
            torch.mm(a, b)


class _Refresh(NamedTuple):
    """A refresh in flight: its side stream's events, and the thread issuing paced copies (or None)."""

    read: torch.cuda.Event  # the shard was read: the next optimizer update may write it
    start: torch.cuda.Event
    end: torch.cuda.Event
    pacer: threading.Thread | None

    def wait(self) -> float:
        """Wait for the refresh's end; its time on the side stream (ms)."""
        if self.pacer is not None:
            self.pacer.join()  # the end event is recorded once every paced copy was issued
        self.end.synchronize()
        return self.start.elapsed_time(self.end)


def _worker(rank: int, world: int, args: argparse.Namespace, port: int, results: dict) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=5),
        device_id=device,
    )
    dp = dist.new_group(list(range(world)))  # the training's communicator; the refresh uses the world's
    copies = None  # the world group, unless the copies get a communicator of their own
    if args.copy_ctas or args.cta_policy >= 0:
        options = dist.ProcessGroupNCCL.Options()
        if args.copy_ctas:
            options.config.max_ctas = args.copy_ctas
        if args.cta_policy >= 0:
            options.config.cta_policy = args.cta_policy
        copies = dist.new_group(list(range(world)), pg_options=options)
    buddy, ward = (rank + 1) % world, (rank - 1) % world
    params = args.params // world * world
    shard = params // world
    grads = torch.zeros(params, device=device, dtype=torch.float32)
    weights = torch.zeros(params, device=device, dtype=torch.bfloat16)
    grad_shard = torch.zeros(shard, device=device, dtype=torch.float32)
    main, m, v = (torch.rand(shard, device=device) for _ in range(3))
    pinned_own = torch.empty(3 * shard, dtype=torch.float32, pin_memory=True)
    pinned_ward = torch.empty(3 * shard, dtype=torch.float32, pin_memory=True)
    chunk = args.chunk  # fp32 elements
    # The second staging buffer only where a pipelined arm runs: the others hold the product's one.
    buffers = 2 if any(ARMS[arm].pipelined for arm in args.arms) else 1
    stagings = [torch.empty(chunk, device=device, dtype=torch.float32) for _ in range(buffers)]
    staging = stagings[0]
    side = torch.cuda.Stream(device=device)
    outs = torch.cuda.Stream(device=device)  # a pipelined arm's copies out of its staging buffers
    gemms = _gemms(device, args.tokens, args.hidden)

    def optimizer() -> None:
        m.mul_(0.9).add_(grad_shard, alpha=0.1)
        v.mul_(0.999).addcmul_(grad_shard, grad_shard, value=0.001)
        main.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-4)

    def step(rounds: int, collectives: bool, hold: torch.cuda.Event | None) -> None:
        _compute(gemms, rounds)
        if collectives:
            dist.reduce_scatter_tensor(grad_shard, grads, group=dp)
        if hold is not None:
            torch.cuda.current_stream().wait_event(hold)  # the update waits for the assembly's read
        optimizer()
        if collectives:
            dist.all_gather_into_tensor(weights, main.to(torch.bfloat16), group=dp)
        torch.cuda.current_stream().synchronize()  # not the device's: the side stream runs on

    ward_whole = torch.empty(0, device=device)  # for decoupled arms, made on first use

    def paced(pairs: list[tuple[torch.Tensor, torch.Tensor]], gbps: float, end: torch.cuda.Event) -> threading.Thread:
        def issue() -> None:
            torch.cuda.set_device(device)
            with torch.cuda.stream(side):
                for host, gpu in pairs:
                    host.copy_(gpu, non_blocking=True)
                    time.sleep(gpu.numel() * gpu.element_size() / gbps / 1e9)
                end.record(side)

        thread = threading.Thread(target=issue)
        thread.start()
        return thread

    def refresh(parts: Parts) -> _Refresh:
        nonlocal ward_whole
        n = _moved(shard, parts, chunk)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            start = torch.cuda.Event(enable_timing=True)
            start.record(side)
            if not parts.assemble:
                flat = main.new_empty(n)
            else:
                flat = torch.cat([main, m, v])[:n] if n > main.numel() else main[:n].clone()
            read = torch.cuda.Event()
            read.record(side)
            if parts.own and parts.pace_gbps:
                pieces = [(pinned_own[i : i + chunk], flat[i : i + chunk]) for i in range(0, n, chunk)]
                end = torch.cuda.Event(enable_timing=True)
                flat.record_stream(side)
                return _Refresh(read, start, end, paced(pieces, parts.pace_gbps, end))  # beside the next step
            elif parts.own and not parts.decoupled:
                pinned_own[:n].copy_(flat, non_blocking=True)
            if parts.decoupled and ward_whole.numel() < n:
                ward_whole = torch.empty(n, device=device)
            if parts.exchange and parts.pipelined:
                freed: list[torch.cuda.Event | None] = [None, None]  # each buffer's last copy out
                for k, i in enumerate(range(0, n, chunk)):
                    into = stagings[k % 2]
                    if freed[k % 2] is not None:
                        side.wait_event(freed[k % 2])
                    ops = [
                        dist.P2POp(dist.isend, flat[i : i + chunk], buddy, copies),
                        dist.P2POp(dist.irecv, into, ward, copies),
                    ]
                    for work in dist.batch_isend_irecv(ops):
                        work.wait()
                    outs.wait_stream(side)
                    with torch.cuda.stream(outs):
                        pinned_ward[i : i + chunk].copy_(into, non_blocking=True)
                        freed[k % 2] = torch.cuda.Event()
                        freed[k % 2].record(outs)
                side.wait_stream(outs)  # the end below covers the copies out
            elif parts.exchange:
                for i in range(0, n, chunk):
                    into = ward_whole[i : i + chunk] if parts.decoupled else staging
                    ops = [
                        dist.P2POp(dist.isend, flat[i : i + chunk], buddy, copies),
                        dist.P2POp(dist.irecv, into, ward, copies),
                    ]
                    for work in dist.batch_isend_irecv(ops):
                        work.wait()
                    if parts.ward and not parts.decoupled:
                        pinned_ward[i : i + chunk].copy_(staging, non_blocking=True)
            if parts.decoupled:
                pinned_own[:n].copy_(flat, non_blocking=True)
                if parts.ward:
                    pinned_ward[:n].copy_(ward_whole[:n], non_blocking=True)
            flat.record_stream(side)
            end = torch.cuda.Event(enable_timing=True)
            end.record(side)
        return _Refresh(read, start, end, None)

    # Calibrate the compute to about --step-ms (alone, no collectives).
    _compute(gemms, 5)
    torch.cuda.synchronize()
    began = time.perf_counter()
    _compute(gemms, 20)
    torch.cuda.synchronize()
    per_round = (time.perf_counter() - began) / 20
    count = torch.tensor([max(1, round(args.step_ms / 1000 / per_round))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    rounds = int(count.item())
    # Warm: every communicator and transfer once.
    step(rounds, True, None)
    torch.cuda.synchronize()
    refresh(ARMS["full"]).wait()
    if len(stagings) == 2:
        refresh(ARMS["full_pipelined"]).wait()
    dist.barrier()

    out: dict = {"rounds": rounds, "gemm_round_ms": per_round * 1000, "arms": {}}
    for arm in args.arms:
        parts = ARMS[arm]
        times: list[float] = []
        refresh_ms: list[float] = []
        pending: _Refresh | None = None
        for i in range(args.steps):
            hold = pending.read if pending else None
            dist.barrier(group=dp)  # the ranks start each step together, as after a loss's all-reduce
            began = time.perf_counter()
            step(rounds, parts.dp, hold)
            times.append(time.perf_counter() - began)
            if pending:
                refresh_ms.append(pending.wait())  # the host waits here, after the step beside it was timed
                pending = None
            if parts.refresh and i % INTERVAL == 0:
                pending = refresh(parts)
        if pending:
            pending.wait()
        out["arms"][arm] = {**paired_cost(times), "refresh_ms": statistics.median(refresh_ms) if refresh_ms else 0.0}
        if rank == 0:
            print(arm, json.dumps({k: round(x, 4) for k, x in out["arms"][arm].items()}), flush=True)
    results[rank] = out
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--params", type=int, default=1_110_000_000)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--step-ms", type=float, default=300.0, help="the compute of a step, about")
    parser.add_argument("--steps", type=int, default=40, help="per arm")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--chunk-mib", type=int, default=CHUNK >> 18, help="a transfer, and the staging buffer")
    parser.add_argument("--copy-ctas", type=int, default=0, help="the copies on a communicator of this maxCTAs")
    parser.add_argument("--cta-policy", type=int, default=-1, help="the copies on a communicator of this ctaPolicy")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.arms = args.arms.split(",")
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown}; the arms: {', '.join(ARMS)}")
    if len(set(args.arms)) < len(args.arms):
        parser.error(f"--arms names an arm twice ({args.arms}): the report keeps one result an arm")
    if not 2 <= args.gpus <= torch.cuda.device_count():
        parser.error(f"--gpus {args.gpus}: two CUDA devices at least, and this machine has {torch.cuda.device_count()}")
    args.chunk = args.chunk_mib << 18  # fp32 elements
    small = [a for a in args.arms if ARMS[a].refresh and not _moved(args.params // args.gpus, ARMS[a], args.chunk)]
    if small:
        parser.error(f"--params {args.params} over {args.gpus} GPUs is less than a chunk a refresh for {small}")
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(args.gpus, args, port, results), nprocs=args.gpus, join=True)
        report = {"args": vars(args), "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
        report["ranks"] = dict(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
