"""The worker's main loop: wait as a spare, join an epoch, restore, verify, train, and reconfigure
in place when a newer plan arrives or a collective fails. The process is never restarted.

Threads:
- main: everything that touches torch.distributed and the model;
- channel reader: receives plans; when a newer plan must interrupt training, it marks the epoch
  aborted, which the main thread notices while it waits for the step's collectives;
- watchdog: aborts the epoch when the step in progress stalls (a hung peer): past a few times the
  epoch's recent step time, or past ``collectiveTimeoutSeconds`` when there is none yet; data reads
  and checkpoint saves have their own allowance, and a peer busy in one postpones the verdict
  (worker/watchdog.py).

Who aborts the NCCL communicators: the main thread, once it has left the step (worker/abort.py
explains why it does not wait for them). An abort holds each group's lock for its whole duration
(~1 s), and a collective launched meanwhile would block on that lock, so aborting while the main
thread still launches the step's collectives cost the survivors up to a second. Only if the main
thread has not left the step after :data:`ABORT_GRACE_SECONDS` (blocked somewhere no flag reaches)
does the interrupting thread abort the communicators itself, which frees any blocked call. On gloo,
where ``abort()`` frees nothing (pytorch#130345), a hang found by the watchdog shuts down the
process's gloo connections instead (:func:`abort.close_gloo_connections`).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_contract.mesh import BatchGeometry, MeshPlan, PlanReason, StateSourceKind
from megatron_trainer.channel import (
    Alive,
    Assign,
    Channel,
    CheckpointProblem,
    CheckpointSaved,
    CollectiveFailed,
    Hello,
    PhaseTimes,
    Progress,
    Shutdown,
    WireModel,
    WireWorkerState,
    WorkerStatus,
)
from megatron_trainer.faults import FaultPlan, InjectedFault, InjectionPoint
from megatron_trainer.worker import abort, checkpoint, rendezvous
from megatron_trainer.worker.collective_errors import is_collective_error
from megatron_trainer.worker.data import IndexedTokens, MockTokens, TokenSource
from megatron_trainer.worker.lifecycle import WorkerState, check_transition
from megatron_trainer.worker.model import (
    HeldState,
    TrainState,
    adopt_state,
    build_train_state,
    detach_state,
    sync_initial_weights,
)
from megatron_trainer.worker.peer_restore import restore_from_peers
from megatron_trainer.worker.settings import WorkerSettings
from megatron_trainer.worker.step import guard_commit, train_step
from megatron_trainer.worker.verify import StateMismatch, verify_state
from megatron_trainer.worker.watchdog import (
    GLOO_FLOOR_SECONDS,
    HangWatch,
    PeerActivity,
    Phase,
    ProgressMarks,
    StepLimit,
)

# is_collective_error lived here before collective_errors.py; others still import it from here.
__all__ = ["Worker", "is_collective_error"]

log = logging.getLogger("megatron_trainer.worker")


ABORT_GRACE_SECONDS = 0.5

#: How often the watchdog thread looks at the main thread's progress.
WATCHDOG_TICK_SECONDS = 0.05
#: How often a training worker tells its agent it is alive (a stopped process cannot).
ALIVE_SECONDS = 0.25
# What the agent hears of each state: waiting is reconfiguring to it; starting is not reported.
_WIRE_STATE: dict[WorkerState, WireWorkerState] = {
    WorkerState.SPARE: "spare",
    WorkerState.RECONFIGURING: "reconfiguring",
    WorkerState.WAITING: "reconfiguring",
    WorkerState.TRAINING: "training",
    WorkerState.SUCCEEDED: "succeeded",
    WorkerState.FAILED: "failed",
}
#: Worker states in which the watchdog tells the agent it is alive.
_SAYS_ALIVE = frozenset({WorkerState.SPARE, WorkerState.RECONFIGURING, WorkerState.TRAINING, WorkerState.WAITING})


class Worker:
    """One training process; see the module docstring."""

    def __init__(self, channel: Channel, local_rank: int, settings: WorkerSettings) -> None:
        self.channel = channel
        self.local_rank = local_rank
        self.spec = settings.spec
        self.pod = settings.pod
        self.sample_log_dir = settings.sample_log_dir
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
        self._lock = threading.Lock()
        self._plan_ready = threading.Condition(self._lock)
        self._pending: MeshPlan | None = None
        self._shutdown = False
        self._aborted = threading.Event()  # the current epoch's communicators were aborted
        self._abort_reason = ""
        self._detected_at: float | None = None  # monotonic time the current failure was noticed
        self._detected_wall: float | None = None
        self._marks = ProgressMarks()  # the main thread's training phase, for the watchdog
        self._limits = StepLimit(  # the epoch's recent step times
            self.spec.failure_detection, min_floor=GLOO_FLOOR_SECONDS if self.backend == "gloo" else 0.0
        )
        self._activity: PeerActivity | None = None  # the epoch's busy-peer counter (store)
        self._out_of_step = threading.Event()  # set while the main thread runs no training step
        self._out_of_step.set()
        self._abort: abort.Abort | None = None  # the last epoch's communicator aborts
        self._completed = 0  # steps completed, readable by the reader thread
        self._send_lock = threading.Lock()
        self._phases: dict[str, float] = {}
        self.saver = checkpoint.CheckpointSaver(self.spec) if self.spec.checkpoint is not None else None

    # -- messaging ---------------------------------------------------------------------------------

    def send(self, message: WireModel) -> None:
        """Send to the agent; a closed channel means the agent is gone, and so must we be."""
        with self._send_lock:
            try:
                self.channel.send(message)
            except OSError:
                log.error("channel to the agent is closed; exiting")
                os._exit(0)

    def _move(self, target: WorkerState, detail: str = "", epoch: int | None = None) -> None:
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
                with self._lock:
                    self._shutdown = True
                    self._plan_ready.notify_all()
                self._interrupt("shutdown", now=True)
                threading.Timer(30.0, lambda: os._exit(0)).start()  # blocked in a collective: go anyway
                continue
            assert isinstance(message, Assign)
            self._offer(message.plan)

    def _offer(self, plan: MeshPlan) -> None:
        with self._lock:
            newest = self._pending.epoch if self._pending else self.epoch
            if plan.epoch <= newest:
                log.warning("plan epoch %d ignored: not newer than %d", plan.epoch, newest)
                return
            self._pending = plan
            self._plan_ready.notify_all()
            # A plan that resumes at a step already reached interrupts now; one that names a
            # later step (growth at a boundary) lets training run until that step. A worker still
            # joining an epoch (connecting, waiting for peers, restoring) drops it for the newer
            # one at once: that epoch may never come together (a member died meanwhile).
            urgent = (
                self.state is WorkerState.TRAINING and plan.resume_step <= self._completed
            ) or self.state is WorkerState.RECONFIGURING
        if urgent:
            self._interrupt(f"new plan epoch {plan.epoch}")

    def _interrupt(self, reason: str, now: bool = False, hung: bool = False) -> None:
        """Mark the epoch aborted; abort its communicators here only if the main thread does not
        leave its step within the grace (or at once when ``now``). ``hung`` (the watchdog's verdict)
        also unblocks a gloo collective, which no flag reaches."""
        with self._lock:
            if self._aborted.is_set():
                return
            self._abort_reason = reason
            self._detected_at = time.monotonic()
            self._detected_wall = time.time()
            self._aborted.set()
            phases = self._phases  # this epoch's: the main thread may enter the next one meanwhile
        if self.backend == "nccl" and self.epoch and (now or not self._out_of_step.wait(ABORT_GRACE_SECONDS)):
            # Still in the step after the grace: blocked where the flag is not seen (a kernel launch
            # behind a full queue, a host sync inside Megatron). Aborting frees it.
            took = abort.abort_communicators()
            phases["abort_nccl"] = took
            thread = threading.current_thread().name
            log.info("communicators aborted in %.3fs by the %s thread (%s)", took, thread, reason)
        elif self.backend == "gloo" and hung and self.epoch and not self._out_of_step.wait(ABORT_GRACE_SECONDS):
            closed = abort.close_gloo_connections()
            log.info(
                "%d gloo connections shut down by the %s thread (%s)", closed, threading.current_thread().name, reason
            )

    # -- watchdog thread ---------------------------------------------------------------------------

    def _watch_progress(self) -> None:
        """Judge the main thread's progress every tick (worker/watchdog.py); abort on a hang. A bug
        in one tick is logged, never the end of the watchdog."""
        watch = HangWatch(self._limits)
        said_alive = 0.0
        while True:
            time.sleep(WATCHDOG_TICK_SECONDS)
            try:
                said_alive = self._watch_tick(watch, said_alive)
            except Exception:
                log.exception("watchdog tick failed")

    def _watch_tick(self, watch: HangWatch, said_alive: float) -> float:
        """One watchdog tick; returns when the agent last heard that this worker is alive."""
        training = self.state is WorkerState.TRAINING and not self._aborted.is_set()
        mark = self._marks.current() if training else None
        now = time.monotonic()
        # In every live state: while training (with the step's limit), and while an aborted step
        # unwinds, a join runs (rendezvous, rebuild, restore, verify) or the worker waits as a spare
        # or for a plan, without one: then the agent allows the hang timeout. A worker stopped in a
        # join would otherwise hold up its peers' rendezvous for ever, its agent still reporting.
        if self.state in _SAYS_ALIVE and now - said_alive >= ALIVE_SECONDS:
            limit = self._limits.step_limit()
            self.send(
                Alive(
                    epoch=self.epoch,
                    phase=mark.phase.value if mark is not None else None,
                    step_limit_seconds=limit if training and limit < self._limits.ceiling else None,
                )
            )
            said_alive = now
        hang = watch.check(mark, time.monotonic(), self._activity if mark is not None else None)
        if hang is not None:
            log.warning("%s", hang)
            self._interrupt(hang, hung=True)
        return said_alive

    # -- main thread -------------------------------------------------------------------------------

    def run(self) -> int:
        """Start warm, then serve plans until shutdown; returns the exit code."""
        start = time.perf_counter()
        self._warm_up()
        self.send(Hello(local_rank=self.local_rank, pid=os.getpid()))
        log.info("ready in %.2fs on %s", time.perf_counter() - start, self.device)
        threading.Thread(target=self._read_channel, daemon=True, name="channel").start()
        threading.Thread(target=self._watch_progress, daemon=True, name="watchdog").start()
        self._move(WorkerState.SPARE)
        while True:
            plan = self._next_plan()
            if plan is None:
                self._teardown()
                log.info("shut down")
                return 0
            self._enter(plan)

    def _warm_up(self) -> None:
        """Imports, CUDA context, model built in a communicator-free world: promotion then costs
        only rendezvous and state transfer."""
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
        # Everything alive now (torch, megatron, their module-level objects) lives as long as the
        # process: keep it out of every later collection, so the gc.collect() on the abort path
        # scans only the objects of the epoch being dropped (0.5 s -> a few ms on CPU).
        gc.freeze()

    def _next_plan(self) -> MeshPlan | None:
        with self._lock:
            while self._pending is None and not self._shutdown:
                self._plan_ready.wait()
            if self._shutdown:
                return None
            plan, self._pending = self._pending, None
            return plan

    def _teardown(self, aborted: bool = False) -> None:
        """Leave the current epoch: keep the state tensors, drop everything holding a group.

        After an abort on NCCL the groups are forgotten, not destroyed: destroying would wait
        ~1 s for the aborts to finish (worker/abort.py)."""
        if self.ts is None and self.epoch == 0 and not dist.is_initialized():
            return
        start = time.perf_counter()
        if self.ts is not None:
            self.held = detach_state(self.ts)
            self.ts = None
        t = time.perf_counter()
        gc.collect()  # frames of the failed step may still reference modules
        self._phases["abort_gc"] = time.perf_counter() - t
        if aborted and self.backend == "nccl":
            self._abort = abort.start_abort()  # may already run (see _interrupt)
            abort.forget_process_groups()
        else:
            abort.release_process_groups()
        self.epoch = 0
        self.store = None
        self._activity = None
        self._phases["abort"] = self._phases.get("abort", 0.0) + time.perf_counter() - start

    def _enter(self, plan: MeshPlan) -> None:
        member = plan.member(self.pod)
        if member is None:
            self._teardown()
            self.epoch = 0
            self._move(WorkerState.SPARE, f"not a member of epoch {plan.epoch}", epoch=plan.epoch)
            return
        if self.local_rank >= len(member.ranks):
            raise ValueError(
                f"plan epoch {plan.epoch} gives pod {self.pod} {len(member.ranks)} ranks;"
                f" this worker is local rank {self.local_rank}"
            )
        begin = time.perf_counter()
        self._move(WorkerState.RECONFIGURING, f"entering epoch {plan.epoch}", epoch=plan.epoch)
        self._teardown(aborted=self._aborted.is_set())
        phases = self._phases
        self._phases = {}
        if self._detected_wall is not None:
            phases["detected_at_unix"] = self._detected_wall
        self._aborted.clear()
        self._detected_at = self._detected_wall = None
        self.rank = member.ranks[self.local_rank]
        source = plan.source_of(self.rank)
        coords = plan.sizes.coords_of(self.rank)

        interrupted = self._superseded_check(plan.epoch)
        ts: TrainState | None = None
        adopted = False
        try:
            t = time.perf_counter()
            self.epoch = plan.epoch  # from here on _teardown releases whatever the join created
            self.store = rendezvous.join_epoch(
                plan, self.rank, self.backend, self.spec.failure_detection.collective_timeout_seconds, interrupted
            )
            phases["rendezvous"] = time.perf_counter() - t
            self._activity = PeerActivity(self.store)
            self._out_of_step.clear()  # collectives from here on: an interrupt may need to abort them

            t = time.perf_counter()
            connecting = rendezvous.connect_communicators(self.device)
            if source.kind is not StateSourceKind.SELF:
                # Free the warm (or stale) state first: the new build then reuses its blocks from
                # the caching allocator instead of paying for ~1000 fresh cudaMalloc calls.
                self.held = None
            ts = build_train_state(
                self.spec,
                self.device,
                initialize=source.kind is StateSourceKind.INIT,
                before_collectives=connecting.join if connecting else None,
            )
            if source.kind is StateSourceKind.SELF:
                if self.held is None:
                    raise RuntimeError(
                        f"plan epoch {plan.epoch} says rank {self.rank} keeps its state, but it holds none"
                    )
                adopt_state(ts, self.held)
                adopted = True
            elif source.kind is StateSourceKind.INIT:
                # GPU initialization draws from per-device generators; like Megatron's own training
                # loop, make every DP replica start from DP rank 0's weights.
                sync_initial_weights(ts)
            self.held = None
            guard_commit(
                ts,
                self._aborted.is_set,
                self.device,
                lambda s: self.faults.maybe_fire(plan.epoch, self.rank, s, InjectionPoint.BEFORE_UPDATE),
            )
            phases["rebuild"] = time.perf_counter() - t
            phases.update({f"rebuild_{k}": v for k, v in ts.build_seconds.items()})

            t = time.perf_counter()
            moved = self._restore(ts, plan, interrupted, phases)
            phases["restore"] = time.perf_counter() - t

            t = time.perf_counter()
            assert self.store is not None
            checksum = verify_state(ts, plan, self.rank, self.store, interrupted)
            phases["verify"] = time.perf_counter() - t
        except (rendezvous.Superseded, rendezvous.RendezvousFailed, RuntimeError) as err:
            joining = isinstance(err, rendezvous.Superseded | rendezvous.RendezvousFailed)
            if not joining and (isinstance(err, StateMismatch) or not (interrupted() or is_collective_error(err))):
                raise  # wrong state or a bug: no other plan would fix it
            if adopted and ts is not None:
                self.held = detach_state(ts)  # a keeper keeps its state for the next plan
            del ts
            self._abandon_join(plan, err)
            return
        finally:
            self._out_of_step.set()
        self.ts = ts
        with self._lock:
            self._completed = ts.step
        log.info(
            "epoch %d rank %d %s: state from %s (%d bytes moved), step %d, checksum %x, in %.3fs",
            plan.epoch,
            self.rank,
            coords.model_dump(),
            source.kind.value,
            moved,
            ts.step,
            checksum,
            time.perf_counter() - begin,
        )
        if plan.reason is PlanReason.SUSPEND:
            self._save_and_stop(plan)
            return
        self._move(WorkerState.TRAINING, f"rank {self.rank} of {plan.mesh_label}")
        try:
            self._train(plan, phases)
        finally:
            if self.saver is not None:
                self.saver.abandon()  # a save this epoch did not complete (nothing when none)

    def _restore(
        self, ts: TrainState, plan: MeshPlan, interrupted: Callable[[], bool], phases: dict[str, float]
    ) -> int:
        """The state this rank does not hold: from data-parallel peers, or the checkpoint the plan
        names. Returns the bytes received from peers."""
        assert self.store is not None
        moved = restore_from_peers(ts, plan, self.device, self.store, interrupted, phases)
        if StateSourceKind.CHECKPOINT in plan.source_kinds():
            if self.spec.checkpoint is None:
                raise ValueError("plan restores from a checkpoint but the job has no spec.checkpoint")
            step = plan.source_of(self.rank).checkpoint_step
            step = step if step is not None else plan.resume_step
            # Raises CheckpointUnusable after two checkpoints failed verification: the worker then
            # fails (reported) instead of restoring again and again.
            try:
                checkpoint.restore_checkpoint(
                    ts,
                    self.spec,
                    step,
                    on_rejected=lambda s, why: self.send(
                        CheckpointProblem(epoch=plan.epoch, step=s, kind="rejected", detail=why[:1000])
                    ),
                    phases=phases,
                )
            except checkpoint.CheckpointUnusable as err:
                self.send(CheckpointProblem(epoch=plan.epoch, step=step, kind="unusable", detail=str(err)[:1000]))
                raise
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return moved

    def _train(self, plan: MeshPlan, phases: dict[str, float]) -> None:
        assert self.ts is not None
        ts = self.ts
        dp_rank = plan.sizes.coords_of(self.rank).dp
        logs_samples = self._logs_samples(plan)
        first = True
        self._limits.reset()  # the epoch's first step is a warm-up: the collective timeout watches it
        while ts.step < self.spec.training.train_iters:
            with self._lock:
                nxt, shutdown = self._pending, self._shutdown
            if shutdown or (nxt is not None and nxt.resume_step <= ts.step):
                return  # the main loop enters the next plan (or shuts down)
            if self._aborted.is_set():  # by the watchdog between two steps
                self._on_step_failure(plan, f"aborted: {self._abort_reason}")
                return
            failure: str | None = None
            self._out_of_step.clear()
            step_index = ts.step
            self._marks.begin(Phase.DATA, step_index)
            try:
                result = train_step(
                    ts,
                    self.source,
                    plan.batch,
                    dp_rank,
                    self.device,
                    partial(self.faults.maybe_fire, plan.epoch, self.rank, step_index),
                    aborted=self._aborted.is_set,
                    data_hook=partial(
                        self.faults.maybe_fire, plan.epoch, self.rank, step_index, InjectionPoint.DATA_READ
                    ),
                    data_read=partial(self._marks.begin, Phase.STEP, step_index),
                )
            except InjectedFault:
                raise
            except RuntimeError as err:
                if not (self._aborted.is_set() or is_collective_error(err)):
                    raise  # a bug or a bad configuration: no reconfiguration will fix it
                failure = f"{type(err).__name__}: {err}"
            finally:
                compute_seconds = self._marks.end()
                self._out_of_step.set()
            if failure is not None:
                self._on_step_failure(plan, failure)
                return
            self._limits.record(compute_seconds)  # not when it was a warm-up step (worker/watchdog.py)
            with self._lock:
                self._completed = ts.step
            if first:
                phases["first_step"] = result.seconds
                if self._abort is not None and self._abort.finished is not None:
                    phases["abort_nccl"] = self._abort.finished - self._abort.started
                self._abort = None
                self.send(PhaseTimes(epoch=plan.epoch, phases=phases))
                log.info("epoch %d phases: %s", plan.epoch, {k: round(v, 4) for k, v in phases.items()})
                first = False
            if logs_samples:
                self._log_samples(plan, dp_rank, ts.step - 1, result.samples, result.loss)
            self.send(
                Progress(
                    epoch=plan.epoch,
                    step=ts.step,
                    consumed_samples=ts.step * plan.batch.global_batch_size,
                    loss=result.loss,
                    step_time_seconds=result.seconds,
                    tokens_per_second=result.tokens / result.seconds if result.seconds > 0 else 0.0,
                )
            )
            if self.saver is not None and not self._checkpoint_after_step(plan):
                return
        if self.saver is not None:
            self._report_checkpoint(plan, self.saver.finish(ts, plan.epoch, plan.sizes.model_dump()))
        self._move(WorkerState.SUCCEEDED, f"trained {ts.step} steps")

    def _save_and_stop(self, plan: MeshPlan) -> None:
        """A suspend plan: write a checkpoint of the step every member holds (agreed at verification),
        report it, leave the epoch and wait, holding the state, for the operator to delete the pod
        (or, should the checkpoint fail, for its next plan)."""
        assert self.ts is not None
        ts = self.ts
        if self.saver is None:
            detail = "the job has no spec.checkpoint to write a suspend checkpoint to"
            self.send(CheckpointProblem(epoch=plan.epoch, step=ts.step, kind="failed", detail=detail))
            self._teardown()
            self._move(WorkerState.WAITING, detail, epoch=plan.epoch)
            return
        self._out_of_step.clear()
        try:
            outcome = self.saver.save_now(ts, plan.epoch, plan.sizes.model_dump())
        except RuntimeError as err:
            if not (self._aborted.is_set() or is_collective_error(err)):
                raise
            self.saver.abandon()
            self._on_step_failure(plan, f"suspend checkpoint: {type(err).__name__}: {err}")
            return
        finally:
            self._out_of_step.set()
        self._report_checkpoint(plan, outcome)
        saved = any(done.step == ts.step for done in outcome.completed)
        self._teardown()
        detail = f"suspended: checkpoint of step {ts.step} " + ("complete" if saved else "failed")
        self._move(WorkerState.WAITING, detail, epoch=plan.epoch)

    def _superseded_check(self, epoch: int) -> rendezvous.Interrupted:
        """True once the join of ``epoch`` is moot: interrupted, or a newer plan is waiting."""

        def superseded() -> bool:
            with self._lock:
                pending = self._pending
            return self._aborted.is_set() or (pending is not None and pending.epoch > epoch)

        return superseded

    def _abandon_join(self, plan: MeshPlan, err: BaseException) -> None:
        """The join of ``plan`` failed or was overtaken: release what it created and, unless a
        newer plan ended it, tell the agent whom to suspect (the store's pod, or the ranks that
        never arrived), then wait for the next plan. The process lives on: a join that cannot
        complete is the epoch's failure, not this worker's."""
        self._aborted.set()  # late commits of this epoch must refuse
        self._teardown(aborted=True)
        with self._lock:
            newer = self._pending is not None and self._pending.epoch > plan.epoch
        if newer or isinstance(err, rendezvous.Superseded):
            log.info("epoch %d abandoned for a newer plan: %s", plan.epoch, err)
            return
        log.warning("epoch %d could not be joined: %s", plan.epoch, err)
        suspects: list[tuple[int | None, str | None]] = []
        if isinstance(err, rendezvous.RendezvousFailed):
            if err.store_host is not None:
                host = next((m.pod for m in plan.members if m.address == plan.rendezvous.host), None)
                suspects.append((None, host))
            pod_of = plan.pod_of_rank()
            for absent in dict.fromkeys(pod_of[r] for r in err.missing if r in pod_of):
                suspects.append((None, absent))
        for rank, pod in suspects[:8] or [(None, None)]:
            self.send(CollectiveFailed(epoch=plan.epoch, peer_rank=rank, peer_pod=pod, reason=str(err)[:1000]))
        self._move(WorkerState.WAITING, str(err)[:200], epoch=plan.epoch)

    def _checkpoint_after_step(self, plan: MeshPlan) -> bool:
        """Start or complete a checkpoint after a step (collective; watched like a step); False
        when a collective failed (the failure is then handled like a failed step)."""
        assert self.saver is not None and self.ts is not None
        self._out_of_step.clear()
        self._marks.begin(Phase.CHECKPOINT, self.ts.step)
        try:
            outcome = self.saver.after_step(self.ts, plan.epoch, plan.sizes.model_dump())
            # After the save's collectives: the peers go on and wait for this rank in the next step.
            self.faults.maybe_fire(plan.epoch, self.rank, self.ts.step, InjectionPoint.CHECKPOINT)
        except RuntimeError as err:
            if not (self._aborted.is_set() or is_collective_error(err)):
                raise
            self.saver.abandon()
            self._on_step_failure(plan, f"checkpoint: {type(err).__name__}: {err}")
            return False
        finally:
            took = self._marks.end()
            self._out_of_step.set()
        if outcome.completed or self.saver.in_flight is not None or took > self._limits.step_limit() / 2:
            self._limits.warm_up_next()  # a save ran or is being written: the next step may be slow
        self._report_checkpoint(plan, outcome)
        return True

    def _report_checkpoint(self, plan: MeshPlan, outcome: checkpoint.SaveOutcome) -> None:
        assert self.saver is not None
        for done in outcome.completed:
            self.send(
                CheckpointSaved(
                    epoch=plan.epoch,
                    step=done.step,
                    blocking_seconds=done.blocking_seconds,
                    total_seconds=done.total_seconds,
                    start_phases=done.start_phases,
                )
            )
        if outcome.skipped is not None:
            detail = f"the save of step {self.saver.in_flight} was still being written"
            self.send(CheckpointProblem(epoch=plan.epoch, step=outcome.skipped, kind="skipped", detail=detail))
        for step, why in outcome.failed:
            self.send(CheckpointProblem(epoch=plan.epoch, step=step, kind="failed", detail=why[:1000]))

    def _on_step_failure(self, plan: MeshPlan, failure: str) -> None:
        """The step failed or was aborted: discard it, free the groups, and report when it was
        not our own decision (a newer plan) that stopped it."""
        with self._lock:
            by_plan = self._aborted.is_set() and self._abort_reason.startswith("new plan")
            if self._aborted.is_set() and self._abort_reason.startswith("hang") and "hang" not in failure:
                failure = f"{self._abort_reason} ({failure})"  # say why the collective failed
            if self._detected_at is None:
                self._detected_at, self._detected_wall = time.monotonic(), time.time()
                self._abort_reason = failure
        self._aborted.set()  # late commits of this epoch must refuse
        if self._detected_at is not None:
            self._phases["step_exit"] = time.monotonic() - self._detected_at
        log.warning("epoch %d step %d discarded: %s", plan.epoch, self._completed, failure)
        self._teardown(aborted=True)
        if by_plan:
            return
        self.send(CollectiveFailed(epoch=plan.epoch, reason=failure[:1000]))
        self._move(WorkerState.WAITING, failure[:200], epoch=plan.epoch)

    def _logs_samples(
        self,
        plan: MeshPlan,
    ) -> bool:
        if not self.sample_log_dir:
            return False
        c = plan.sizes.coords_of(self.rank)
        return c.tp == 0 and c.cp == 0 and c.pp == 0

    def _log_samples(self, plan: MeshPlan, dp_rank: int, step: int, samples: tuple[int, ...], loss: float) -> None:
        assert self.sample_log_dir is not None
        path = Path(self.sample_log_dir) / f"{self.pod}-{self.local_rank}.jsonl"
        record = {
            "epoch": plan.epoch,
            "step": step,
            "dpRank": dp_rank,
            "rank": self.rank,
            "samples": list(samples),
            "loss": loss,
        }
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
