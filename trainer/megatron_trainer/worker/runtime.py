"""The worker's main loop: wait as a spare, join an epoch, restore, verify, train, and reconfigure
in place when a newer plan arrives or a collective fails. The process is never restarted.

Threads:
- main: everything that touches torch.distributed and the model: it serves one plan after another,
  entering each plan's epoch (worker/epoch_entry.py) and training in it (worker/training_loop.py);
- channel reader: receives plans; when a newer plan must interrupt training, it marks the epoch
  aborted, which the main thread notices while it waits for the step's collectives;
- watchdog: aborts the epoch when the step in progress stalls (a hung peer): past a few times the
  epoch's recent step time, or past ``collectiveTimeoutSeconds`` when there is none yet; data reads
  and checkpoint saves have their own allowance, and a peer busy in one postpones the verdict
  (worker/watchdog.py).

How the other threads interrupt the main one, and who aborts the communicators: see
worker/progress_watch.py. :class:`Worker` holds what the threads share: the pending plan, the
epoch's interrupt (aborted, why, since when), the main thread's progress marks and step limits.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time

import torch
import torch.distributed as dist

from megatron_contract.mesh import BatchGeometry, MeshPlan
from megatron_trainer.channel import Assign, Channel, Hello, Shutdown, WireModel, WireWorkerState, WorkerStatus
from megatron_trainer.faults import FaultPlan
from megatron_trainer.worker import abort, checkpoint, epoch_entry, progress_watch, rendezvous
from megatron_trainer.worker.buddy_copies import BuddyCopies, PairLink
from megatron_trainer.worker.collective_errors import is_collective_error
from megatron_trainer.worker.data import IndexedTokens, MockTokens, TokenSource
from megatron_trainer.worker.lifecycle import WorkerState, check_transition
from megatron_trainer.worker.model import HeldState, TrainState, build_train_state, detach_state
from megatron_trainer.worker.optimizer_shards import ShardPieces
from megatron_trainer.worker.settings import WorkerSettings
from megatron_trainer.worker.step import RefusedStep, train_step
from megatron_trainer.worker.watchdog import GLOO_FLOOR_SECONDS, PeerActivity, ProgressMarks, StepLimit

# is_collective_error lived here before collective_errors.py; others still import it from here.
__all__ = ["Worker", "is_collective_error"]

log = logging.getLogger("megatron_trainer.worker")

# What the agent hears of each state: waiting is reconfiguring to it; starting is not reported.
_WIRE_STATE: dict[WorkerState, WireWorkerState] = {
    WorkerState.SPARE: "spare",
    WorkerState.RECONFIGURING: "reconfiguring",
    WorkerState.WAITING: "reconfiguring",
    WorkerState.TRAINING: "training",
    WorkerState.SUCCEEDED: "succeeded",
    WorkerState.FAILED: "failed",
}


class Worker:
    """One training process; see the module docstring."""

    def __init__(self, channel: Channel, local_rank: int, settings: WorkerSettings) -> None:
        self.channel = channel
        self.local_rank = local_rank
        self.spec = settings.spec
        self.pod = settings.pod
        self.sample_log_dir = settings.sample_log_dir
        self.copy_log_dir = settings.copy_log_dir
        self.copies_over_gloo = settings.copies_over_gloo
        self.device = rendezvous.device_for(local_rank)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.faults = FaultPlan.from_env()
        self.source: TokenSource = (
            IndexedTokens(self.spec.training.data_path, self.spec.model.seq_length)
            if self.spec.training.data_path
            else MockTokens(self.spec.training.seed, self.spec.model.vocab_size, self.spec.model.seq_length)
        )
        self.state = WorkerState.STARTING
        self.ts: TrainState | None = None
        self.held: HeldState | None = None
        self.epoch = 0  # epoch whose groups this process holds (0: none)
        self.rank = -1
        self.store: dist.Store | None = None
        # Shared with the reader and watchdog threads.
        self.lock = threading.Lock()
        self._plan_ready = threading.Condition(self.lock)
        self.pending_plan: MeshPlan | None = None
        self.shutting_down = False
        self.aborted = threading.Event()  # the current epoch's communicators were aborted
        self.abort_reason = ""
        self.detected_at: float | None = None  # monotonic time the current failure was noticed
        self.detected_wall: float | None = None
        self.limits = StepLimit(  # the epoch's recent step times
            self.spec.failure_detection, min_floor=GLOO_FLOOR_SECONDS if self.backend == "gloo" else 0.0
        )
        self.marks = ProgressMarks(self.limits)  # the main thread's training phase, for the watchdog
        self.activity: PeerActivity | None = None  # the epoch's busy-peer counter (store)
        self.out_of_step = threading.Event()  # set while the main thread runs no training step
        self.out_of_step.set()
        self.last_abort: abort.Abort | None = None  # the last epoch's communicator aborts
        self.completed = 0  # steps completed, readable by the reader thread
        # The last step this rank discarded at its update, for the sample log (training_loop.py).
        self.refused_step: RefusedStep | None = None
        self._send_lock = threading.Lock()
        self.phases: dict[str, float] = {}
        self.saver = checkpoint.CheckpointSaver(self.spec) if self.spec.checkpoint is not None else None
        self.copy_links: tuple[PairLink, PairLink] | None = None  # the epoch's, to the buddy and from the ward
        # The buddy copies of the epoch being trained, or of the last one (complete copies only).
        self.copies: BuddyCopies | None = None
        self.copy_pieces: list[ShardPieces] | None = None  # where the epoch's copies read the optimizer

    # -- messaging ---------------------------------------------------------------------------------

    def send(self, message: WireModel) -> None:
        """Send to the agent; a closed channel means the agent is gone, and so must we be."""
        with self._send_lock:
            try:
                self.channel.send(message)
            except OSError:
                log.error("channel to the agent is closed; exiting")
                os._exit(0)

    def move(self, target: WorkerState, detail: str = "", epoch: int | None = None) -> None:
        """Change state (only along the lifecycle's transitions) and tell the agent; ``epoch``
        names the plan's epoch when the worker holds no groups of it (yet, or any more)."""
        self.state = check_transition(self.state, target)
        epoch = self.epoch if epoch is None else epoch
        wire_state = _WIRE_STATE.get(target)
        if wire_state is not None:
            self.send(WorkerStatus(state=wire_state, epoch=epoch, detail=detail))
        log.info("state %s (epoch %d) %s", target.value, epoch, detail)

    # -- channel reader thread -----------------------------------------------------------------

    def _read_channel(self) -> None:
        while True:
            try:
                message = self.channel.recv_to_worker()
            except ValueError as err:
                log.error("unreadable message from the agent ignored: %s", err)
                continue
            if message is None:
                log.warning("agent closed the channel; exiting")
                os._exit(0)
            if isinstance(message, Shutdown):
                log.info("shutdown requested: %s", message.reason)
                with self.lock:
                    self.shutting_down = True
                    self._plan_ready.notify_all()
                progress_watch.interrupt(self, "shutdown", now=True)
                threading.Timer(30.0, lambda: os._exit(0)).start()  # blocked in a collective: go anyway
                continue
            assert isinstance(message, Assign)
            self._offer(message.plan)

    def _offer(self, plan: MeshPlan) -> None:
        with self.lock:
            newest = self.pending_plan.epoch if self.pending_plan else self.epoch
            if plan.epoch <= newest:
                log.warning("plan epoch %d ignored: not newer than %d", plan.epoch, newest)
                return
            self.pending_plan = plan
            self._plan_ready.notify_all()
            # A plan that resumes at a step already reached interrupts now; one that names a
            # later step (growth at a boundary) lets training run until that step. A worker still
            # joining an epoch (connecting, waiting for peers, restoring) drops it for the newer
            # one at once: that epoch may never come together (a member died meanwhile).
            urgent = (
                self.state is WorkerState.TRAINING and plan.resume_step <= self.completed
            ) or self.state is WorkerState.RECONFIGURING
        if urgent:
            progress_watch.interrupt(self, f"new plan epoch {plan.epoch}")

    # -- main thread -------------------------------------------------------------------------------

    def run(self) -> int:
        """Start warm, then serve plans until shutdown; returns the exit code."""
        start = time.perf_counter()
        self._warm_up()
        self.send(Hello(local_rank=self.local_rank, pid=os.getpid()))
        log.info("ready in %.2fs on %s", time.perf_counter() - start, self.device)
        threading.Thread(target=self._read_channel, daemon=True, name="channel").start()
        threading.Thread(target=progress_watch.watch_progress, args=(self,), daemon=True, name="watchdog").start()
        self.move(WorkerState.SPARE)
        while True:
            plan = self._next_plan()
            if plan is None:
                self.teardown()
                log.info("shut down")
                return 0
            epoch_entry.enter(self, plan)

    def _warm_up(self) -> None:
        """Imports, CUDA context, model built in a communicator-free world, NCCL's one-time set-up:
        promotion then costs only rendezvous, the epoch's communicators and state transfer."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.zeros(1, device=self.device)  # creates the CUDA context now, not at promotion
        else:
            from megatron_trainer import cpu_compat

            cpu_compat.install()
        rendezvous.join_spare_world(self.spec, self.local_rank)
        ts = build_train_state(self.spec, self.device, initialize=False)
        # One forward/backward on the fake world (its collectives are no-ops), gradients dropped.
        warm = BatchGeometry.split(self.spec.training.micro_batch_size, self.spec.training.micro_batch_size, 1)
        train_step(ts, self.source, warm, 0, self.device, lambda: None, commit=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.held = detach_state(ts)
        del ts
        if self.device.type == "cuda":
            # Build once more and drop it: CUDA's caching allocator keeps the blocks of a whole
            # build (including the optimizer's clone-then-cast of every parameter), so the build
            # at promotion or recovery reuses them instead of calling cudaMalloc ~1000 times.
            spare_blocks = build_train_state(self.spec, self.device, initialize=False)
            del spare_blocks
            gc.collect()
        abort.release_process_groups()
        if self.backend == "nccl":
            log.info("NCCL initialized in %.2fs", rendezvous.warm_up_nccl(self.device))
        # Everything alive now (torch, megatron, their module-level objects) lives as long as the
        # process: keep it out of every later collection, so the gc.collect() on the abort path
        # scans only the objects of the epoch being dropped (0.5 s -> a few ms on CPU).
        gc.freeze()

    def _next_plan(self) -> MeshPlan | None:
        with self.lock:
            while self.pending_plan is None and not self.shutting_down:
                self._plan_ready.wait()
            if self.shutting_down:
                return None
            plan, self.pending_plan = self.pending_plan, None
            return plan

    def teardown(self, aborted: bool = False, moving: bool = False) -> None:
        """Leave the current epoch: keep the state tensors, drop everything holding a group.

        After an abort on NCCL the groups are forgotten, not destroyed: destroying would wait
        ~1 s for the aborts to finish (worker/abort.py). So are they when the worker is ``moving``
        into its next epoch at a step boundary (a growth, a migration): destroying Megatron's
        groups in line took 1.7-2.0 s of a growth on 2xH200, which every survivor and the
        newcomer waited for; the aborts retire them on background threads while the next epoch
        is built (nothing is in flight on them at a boundary)."""
        if self.ts is None and self.epoch == 0 and not dist.is_initialized():
            return
        start = time.perf_counter()
        if self.ts is not None:
            self.held = detach_state(self.ts, self.rank)
            self.ts = None
        if self.copies is not None:
            self.copies.abandon()  # a refresh in flight is incomplete; the complete copies stay
        self.copy_links = None  # freed with the collection below, which closes their connections
        t = time.perf_counter()
        gc.collect()  # frames of the failed step may still reference modules
        self.phases["abort_gc"] = time.perf_counter() - t
        if (aborted or moving) and self.backend == "nccl":
            self.last_abort = abort.start_abort()  # may already run (see progress_watch.interrupt)
            abort.forget_process_groups()
        else:
            abort.release_process_groups()
        self.epoch = 0
        self.store = None
        self.activity = None
        self.phases["abort"] = self.phases.get("abort", 0.0) + time.perf_counter() - start
