"""A stand-in worker for the agent's fast tests: speaks the real channel protocol, trains nothing.

Run as ``python agent_fake_worker.py --channel-fd FD --local-rank I`` (the agent's worker command
line). It says Hello, waits for an Assign, and while its pod is a member sends a Progress every
``AGENT_FAKE_STEP_SECONDS`` starting at the plan's resume step, until ``trainIters``. Faults are
chosen by environment variables, so a test decides what goes wrong:

- ``AGENT_FAKE_EXIT_AT_STEP=N``: exit with code 3 on reaching step N (a crash).
- ``AGENT_FAKE_COLLECTIVE_FAIL_AT_STEP=N`` and ``AGENT_FAKE_PEER_RANK=R``: at step N report that a
  collective with rank R failed, then wait for the next plan.
- ``AGENT_FAKE_HELLO_DELAY_SECONDS``: wait before Hello (a slow model build).
- ``AGENT_FAKE_REPLICA_STEPS=1``: after every step ``s`` say it holds buddy copies of steps ``s`` and
  ``s - 1`` of the epoch (those after its resume step), local rank 1 none of a multiple of 5.
- ``AGENT_FAKE_CHECKPOINT_UNUSABLE=1``: on a plan naming the pod, report two checkpoints rejected
  (steps 8 and 6) and the restore given up, then fail with exit code 1 (as a real worker does).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import threading
import time

from megatron_contract import wire
from megatron_contract.job import MegatronJobSpec
from megatron_trainer.channel import (
    Assign,
    Channel,
    CheckpointProblem,
    CheckpointSaved,
    CollectiveFailed,
    Hello,
    PhaseTimes,
    Progress,
    ReplicaSteps,
    Shutdown,
    WorkerStatus,
)


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    return int(raw) if raw else None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    args = parser.parse_args()
    spec = MegatronJobSpec.model_validate(json.loads(os.environ[wire.ENV_JOB_SPEC]))
    pod = os.environ[wire.ENV_POD_NAME]
    step_seconds = float(os.environ.get("AGENT_FAKE_STEP_SECONDS", "0.05"))
    exit_at = _env_int("AGENT_FAKE_EXIT_AT_STEP")
    fail_at = _env_int("AGENT_FAKE_COLLECTIVE_FAIL_AT_STEP")
    peer_rank = _env_int("AGENT_FAKE_PEER_RANK")
    replica_steps = bool(os.environ.get("AGENT_FAKE_REPLICA_STEPS"))
    channel = Channel.from_fd(args.channel_fd)
    time.sleep(float(os.environ.get("AGENT_FAKE_HELLO_DELAY_SECONDS", "0")))
    channel.send(Hello(local_rank=args.local_rank, pid=os.getpid()))

    inbox: queue.Queue[Assign | Shutdown | None] = queue.Queue()

    def read() -> None:
        while True:
            message = channel.recv_to_worker()
            inbox.put(message)
            if message is None:
                return

    threading.Thread(target=read, daemon=True).start()
    plan = None
    step = 0
    failed_epoch = -1
    while True:
        training = (
            plan is not None
            and plan.member(pod) is not None
            and step < spec.training.train_iters
            and failed_epoch != plan.epoch
        )
        try:
            message = inbox.get(timeout=step_seconds if training else None)
        except queue.Empty:
            assert plan is not None
            step += 1
            channel.send(
                Progress(
                    epoch=plan.epoch,
                    step=step,
                    consumed_samples=step * spec.training.global_batch_size,
                    loss=1.0 / step,
                    step_time_seconds=step_seconds,
                    tokens_per_second=spec.training.global_batch_size * spec.model.seq_length / step_seconds,
                )
            )
            if replica_steps:
                held = [s for s in (step, step - 1) if s > plan.resume_step and (args.local_rank != 1 or s % 5)]
                channel.send(ReplicaSteps(epoch=plan.epoch, steps=held))
            if spec.checkpoint is not None and step % spec.checkpoint.interval_steps == 0:
                blocking = 0.25 + args.local_rank / 100
                channel.send(CheckpointSaved(epoch=plan.epoch, step=step, blocking_seconds=blocking))
            if step == exit_at:
                return 3
            if step == fail_at:
                channel.send(CollectiveFailed(epoch=plan.epoch, peer_rank=peer_rank, reason="fake: peer reset"))
                channel.send(WorkerStatus(state="reconfiguring", epoch=plan.epoch))
                failed_epoch = plan.epoch
            if step >= spec.training.train_iters:
                channel.send(WorkerStatus(state="succeeded", epoch=plan.epoch))
            continue
        if message is None or isinstance(message, Shutdown):
            return 0  # EOF (the agent died) or asked to finish
        started = time.monotonic()
        plan = message.plan
        if plan.member(pod) is None:
            channel.send(WorkerStatus(state="spare", epoch=plan.epoch))
            continue
        channel.send(WorkerStatus(state="reconfiguring", epoch=plan.epoch))
        if os.environ.get("AGENT_FAKE_CHECKPOINT_UNUSABLE"):
            for rejected in (8, 6):
                channel.send(
                    CheckpointProblem(epoch=plan.epoch, step=rejected, kind="rejected", detail="fake: damaged")
                )
            detail = "fake: no usable checkpoint at or before step 8"
            channel.send(CheckpointProblem(epoch=plan.epoch, step=8, kind="unusable", detail=detail))
            channel.send(WorkerStatus(state="failed", epoch=plan.epoch, detail=f"CheckpointUnusable: {detail}"))
            return 1
        step = plan.resume_step
        channel.send(PhaseTimes(epoch=plan.epoch, phases={"rendezvous": time.monotonic() - started}))
        channel.send(WorkerStatus(state="training", epoch=plan.epoch))


if __name__ == "__main__":
    raise SystemExit(main())
