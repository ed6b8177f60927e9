"""The training loop of a joined epoch: steps, progress and checkpoints reported to the agent, and
what a failed step leaves behind.

The loop runs until the job's last step, until a newer plan's resume step or shutdown, or until a
step fails. A step (or a checkpoint save, which is collective) that fails for a collective reason is
discarded: the worker leaves the epoch, reports the failure unless a newer plan caused it, and waits
for the next plan. A suspend plan trains no step: it writes one checkpoint and waits for its pod to
be deleted.

With the distributed optimizer and a plan that keeps buddy copies, every ``replicaIntervalSteps``-th
step starts a refresh of this rank's copies (worker/buddy_copies.py). It runs beside the steps that
follow: each step boundary notes whether it is done, and the next refresh that is due, or leaving
the epoch at a step boundary or at its end, waits for it (a transfer slower than the interval's
steps costs step time there). The copies held go to the agent (``ReplicaSteps``). A failed exchange is handled like a
failed step; a failed step first gives the ward's copy of the refresh in flight a moment to arrive
(:data:`SALVAGE_WAIT`). The copies only read the optimizer's state: training is the same with or
without them. Where the epoch's refreshes spent their time is logged as it ends
(worker/refresh_times.py). With a cost budget (``replicaCostPercent``) the epoch's first refreshes
calibrate the interval, which all ranks then agree on (worker/copy_schedule.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_contract.host_memory import ADAM_BYTES_PER_ELEMENT
from megatron_contract.mesh import MeshPlan
from megatron_trainer.channel import (
    CheckpointProblem,
    CheckpointSaved,
    CollectiveFailed,
    CopyInterval,
    PhaseTimes,
    Progress,
    ReplicaSteps,
)
from megatron_trainer.faults import InjectedFault, InjectionPoint
from megatron_trainer.worker import checkpoint
from megatron_trainer.worker.buddy_copies import GENERATIONS, BuddyCopies, buddy_and_ward
from megatron_trainer.worker.collective_errors import is_collective_error
from megatron_trainer.worker.copy_schedule import Calibration, CopySchedule
from megatron_trainer.worker.lifecycle import WorkerState
from megatron_trainer.worker.model import TrainState
from megatron_trainer.worker.optimizer_shards import buffer_layouts, flat_shards, materialize, shard_pieces
from megatron_trainer.worker.refresh_times import LOG_LINE, Stamp, summary
from megatron_trainer.worker.step import RefusedStep, StepResult, UpdateRefused, train_step
from megatron_trainer.worker.watchdog import Phase

if TYPE_CHECKING:
    from megatron_trainer.worker.runtime import Worker

log = logging.getLogger("megatron_trainer.worker")

#: How long a failed step waits for its ward's copy of the refresh in flight: normally it arrived
#: during the step; when it did not, the ward died or hung before sending it.
SALVAGE_WAIT = timedelta(seconds=0.25)


def train(worker: Worker, plan: MeshPlan, phases: dict[str, float]) -> None:
    """Train ``plan``'s epoch from the state the join left in ``worker.ts``; ``phases`` (the
    reconfiguration's timings) go to the agent with the first step's."""
    assert worker.ts is not None
    ts = worker.ts
    dp_rank = plan.sizes.coords_of(worker.rank).dp
    logs_samples = _logs_samples(worker, plan)
    first = True
    interval = _start_copies(worker, plan)
    schedule = None
    if interval > 0 and plan.optimizer_state is not None:
        schedule = CopySchedule(interval, plan.optimizer_state.replica_cost_percent, ts.step)
    worker.limits.reset()  # the epoch's first step is a warm-up: the collective timeout watches it
    while ts.step < worker.spec.training.train_iters:
        with worker.lock:
            nxt, shutdown = worker.pending_plan, worker.shutting_down
        if shutdown or (nxt is not None and nxt.resume_step <= ts.step):
            if not shutdown:
                _refresh_copies(worker, plan, due=False)  # the copy in flight completes before we leave
            _log_refresh_times(worker, plan)
            return  # the main loop enters the next plan (or shuts down)
        if worker.aborted.is_set():  # by the watchdog between two steps
            _on_step_failure(worker, plan, f"aborted: {worker.abort_reason}")
            return
        result = _run_step(worker, plan, ts, dp_rank)
        if result is None:
            return
        with worker.lock:
            worker.completed = ts.step
        if first:
            _report_phases(worker, plan, phases, result.seconds)
            first = False
        if logs_samples:
            _log_samples(worker, plan.epoch, worker.rank, dp_rank, ts.step - 1, result.samples, result.loss)
        worker.send(
            Progress(
                epoch=plan.epoch,
                step=ts.step,
                consumed_samples=ts.step * plan.batch.global_batch_size,
                loss=result.loss,
                step_time_seconds=result.seconds,
                tokens_per_second=result.tokens / result.seconds if result.seconds > 0 else 0.0,
            )
        )
        if schedule is not None and not _next_refresh(worker, plan, schedule, result.seconds):
            return
        if worker.saver is not None and not _checkpoint_after_step(worker, plan):
            return
    if not _refresh_copies(worker, plan, due=False):
        return
    _log_refresh_times(worker, plan)
    if worker.saver is not None:
        _report_checkpoint(worker, plan, worker.saver.finish(ts, plan.epoch, plan.sizes.model_dump()))
    worker.move(WorkerState.SUCCEEDED, f"trained {ts.step} steps")


def _run_step(worker: Worker, plan: MeshPlan, ts: TrainState, dp_rank: int) -> StepResult | None:
    """One step, watched by the watchdog; None when it failed for a collective reason (then
    handled, :func:`_on_step_failure`). Any other error is a bug or a bad configuration and raises:
    no reconfiguration would fix it."""
    failure: str | None = None
    worker.out_of_step.clear()
    step_index = ts.step
    worker.marks.begin(Phase.DATA, step_index)
    try:
        result = train_step(
            ts,
            worker.source,
            plan.batch,
            dp_rank,
            worker.device,
            partial(worker.faults.maybe_fire, plan.epoch, worker.rank, step_index),
            aborted=worker.aborted.is_set,
            data_hook=partial(worker.faults.maybe_fire, plan.epoch, worker.rank, step_index, InjectionPoint.DATA_READ),
            data_read=partial(worker.marks.begin, Phase.STEP, step_index),
        )
    except InjectedFault:
        raise
    except RuntimeError as err:
        if not (worker.aborted.is_set() or is_collective_error(err)):
            raise  # a bug or a bad configuration: no reconfiguration will fix it
        failure = f"{type(err).__name__}: {err}"
        if isinstance(err, UpdateRefused) and err.trained is not None and _logs_samples(worker, plan):
            worker.refused_step = RefusedStep(plan.epoch, worker.rank, dp_rank, step_index, err.trained)
    finally:
        compute_seconds = worker.marks.end()
        worker.out_of_step.set()
    if failure is not None:
        _on_step_failure(worker, plan, failure)
        return None
    worker.limits.record(compute_seconds)  # not when it was a warm-up step (worker/watchdog.py)
    return result


def _start_copies(worker: Worker, plan: MeshPlan) -> int:
    """The epoch's buddy copies, none yet (the buddies follow this plan); returns the steps between
    refreshes, 0 when the epoch keeps no copies."""
    pair = buddy_and_ward(plan, worker.rank)
    links = worker.copy_links
    # The last epoch's copies are no longer read (the join restored from them): their host buffers
    # go to this epoch's, as long as their shapes fit.
    recycled = worker.copies.buffers() if worker.copies is not None else []
    worker.copies = worker.copy_pieces = None
    if pair is not None and links is not None:
        over_nccl = not worker.copies_over_gloo
        worker.copies = BuddyCopies(worker.rank, *pair, links=links, over_nccl=over_nccl, recycled=recycled)
    if worker.copies is None or plan.optimizer_state is None or worker.ts is None:
        return 0
    interval = plan.optimizer_state.replica_interval_steps
    # The ward's shards are as large where it sits at the same model-parallel position (two units or
    # more, MeshPlan.buddy_of); their size is learnt at the first refresh.
    rows = sum(b.shard_numel for b in buffer_layouts(worker.ts.optimizer))
    own_bytes = GENERATIONS * rows * ADAM_BYTES_PER_ELEMENT  # fp32 rows (optimizer_shards.flat_shards)
    log.info(
        "epoch %d rank %d: buddy copies every %d steps, sent to rank %d, kept for rank %d: host memory "
        "%.3f GB (%d bytes) for %d generations of its own shards, and its ward's",
        plan.epoch,
        worker.rank,
        interval,
        worker.copies.buddy,
        worker.copies.ward,
        own_bytes / 1e9,
        own_bytes,
        GENERATIONS,
    )
    return interval


def _next_refresh(worker: Worker, plan: MeshPlan, schedule: CopySchedule, step_seconds: float) -> bool:
    """At a step boundary: note the step for the schedule, agree on the interval once it is
    calibrated, then finish or start refreshes as it says; False when that failed (handled)."""
    copies, ts = worker.copies, worker.ts
    assert copies is not None and ts is not None
    schedule.record_step(ts.step, step_seconds)
    if schedule.agree_at == ts.step and not _agree_interval(worker, plan, schedule):
        return False
    due, in_flight = schedule.due(ts.step), copies.in_flight
    began = time.perf_counter()
    if not _refresh_copies(worker, plan, due=due, wait=False):
        return False
    if in_flight and (due or not copies.in_flight):
        schedule.ended(ts.step)
    if due:
        schedule.started(ts.step, time.perf_counter() - began)
    return True


def _agree_interval(worker: Worker, plan: MeshPlan, schedule: CopySchedule) -> bool:
    """Propose this rank's calibrated interval and adopt the largest any rank proposed."""
    copies, ts = worker.copies, worker.ts
    assert copies is not None and ts is not None
    try:
        calibration = schedule.proposal()
    except ValueError as err:  # nothing measured (cannot happen in a whole calibration): keep the floor
        log.warning("epoch %d rank %d: the refreshes' cost was not measured (%s)", plan.epoch, worker.rank, err)
        calibration = Calibration(0.0, 0.0, 1, 0, schedule.interval)
    with _watched(worker, ts.step):
        try:
            agreed = copies.agree(calibration.proposal, stop=worker.aborted.is_set)
        except RuntimeError as err:
            if not (worker.aborted.is_set() or is_collective_error(err)):
                raise
            _on_step_failure(worker, plan, f"buddy copies: {type(err).__name__}: {err}")
            return False
    schedule.adopt(agreed, calibration)
    worker.send(
        CopyInterval(
            epoch=plan.epoch,
            interval=agreed,
            from_step=ts.step,
            proposed=calibration.proposal,
            refresh_cost_seconds=calibration.cost_s,
            clear_step_seconds=calibration.clear_step_s,
        )
    )
    log.info(
        "epoch %d rank %d: buddy copies every %d steps from step %d (agreed; this rank proposed %d: a refresh "
        "cost %.4f s beside a %.4f s step, %d refreshes measured, the longest ended after %d steps; budget %g %%)",
        plan.epoch,
        worker.rank,
        agreed,
        ts.step,
        calibration.proposal,
        calibration.cost_s,
        calibration.clear_step_s,
        calibration.refreshes,
        calibration.refresh_steps,
        schedule.budget_percent,
    )
    return True


@contextlib.contextmanager
def _watched(worker: Worker, step: int) -> Iterator[None]:
    """Work between steps watched like a save: the collective timeout allows it, and a long one tells
    stalled peers that this rank is alive (worker/watchdog.py)."""
    worker.out_of_step.clear()
    worker.marks.begin(Phase.CHECKPOINT, step)
    try:
        yield
    finally:
        worker.marks.end()
        worker.out_of_step.set()


def _refresh_copies(worker: Worker, plan: MeshPlan, due: bool, wait: bool = True) -> bool:
    """Finish the refresh in flight (when ``wait`` or ``due``; otherwise only note whether it is
    done), then start one when ``due``, and tell the agent which copies this rank holds; False when
    the exchange failed (then handled like a failed step)."""
    copies, ts = worker.copies, worker.ts
    if copies is None or ts is None or not (due or copies.in_flight):
        return True
    watched = due or wait
    with _watched(worker, ts.step) if watched else contextlib.nullcontext():
        try:
            if copies.in_flight:
                if watched:
                    copies.finish_refresh(stop=worker.aborted.is_set)  # a plan interrupting: the buddy may be dead
                elif not copies.poll():
                    return True  # still in flight: the next step runs beside it
                _log_copies(worker, copies, "copies")
            if due:
                began = Stamp(worker.device)
                if worker.copy_pieces is None:  # the optimizer's tensors stay the same within an epoch
                    worker.copy_pieces = shard_pieces(ts.optimizer)
                shards = copies.assemble(partial(materialize, worker.copy_pieces), worker.device)
                copies.start_refresh(ts.step, shards, began)
                _log_copies(worker, copies, "state")
        except RuntimeError as err:
            if not (worker.aborted.is_set() or is_collective_error(err)):
                raise
            _on_step_failure(worker, plan, f"buddy copies: {type(err).__name__}: {err}")
            return False
    worker.send(ReplicaSteps(epoch=plan.epoch, steps=copies.complete_steps()))
    return True


def _log_refresh_times(worker: Worker, plan: MeshPlan) -> None:
    """Where the epoch's refreshes spent their time (worker/refresh_times.py), once, as it ends."""
    line = summary(worker.copies.times) if worker.copies is not None else None
    if line is not None:
        log.info(LOG_LINE, plan.epoch, worker.rank, line)


def _log_copies(worker: Worker, copies: BuddyCopies, kind: str) -> None:
    """For tests (``MEGATRON_WORKER_COPY_LOG``): after a finished refresh (``copies``) the copies of
    its step, this rank's and its ward's; after a started one (``state``) this rank's optimizer
    shards read anew, to compare the copies with."""
    if not worker.copy_log_dir or worker.ts is None:
        return
    if kind == "copies":
        step = copies.complete_steps()[0]
        saved = {"own": copies.own(step), "ward": copies.ward_copy(step), "ward_rank": copies.ward}
    else:
        step, saved = worker.ts.step, {"shards": flat_shards(worker.ts.optimizer)}
    torch.save(saved, Path(worker.copy_log_dir) / f"{kind}-{worker.rank}-{step}.pt")


def _report_phases(worker: Worker, plan: MeshPlan, phases: dict[str, float], first_step_seconds: float) -> None:
    """The epoch's first step ends its reconfiguration: send the agent what each stage took."""
    phases["first_step"] = first_step_seconds
    last_abort = worker.last_abort
    if last_abort is not None and last_abort.finished is not None:
        phases["abort_nccl"] = last_abort.finished - last_abort.started
    worker.last_abort = None
    worker.send(PhaseTimes(epoch=plan.epoch, phases=phases))
    log.info("epoch %d phases: %s", plan.epoch, {k: round(v, 4) for k, v in phases.items()})


def save_and_stop(worker: Worker, plan: MeshPlan) -> None:
    """A suspend plan: write a checkpoint of the step every member holds (agreed at verification),
    report it, leave the epoch and wait, holding the state, for the operator to delete the pod
    (or, should the checkpoint fail, for its next plan)."""
    assert worker.ts is not None
    ts = worker.ts
    if worker.saver is None:
        detail = "the job has no spec.checkpoint to write a suspend checkpoint to"
        worker.send(CheckpointProblem(epoch=plan.epoch, step=ts.step, kind="failed", detail=detail))
        worker.teardown()
        worker.move(WorkerState.WAITING, detail, epoch=plan.epoch)
        return
    worker.out_of_step.clear()
    try:
        outcome = worker.saver.save_now(ts, plan.epoch, plan.sizes.model_dump())
    except RuntimeError as err:
        if not (worker.aborted.is_set() or is_collective_error(err)):
            raise
        worker.saver.abandon()
        _on_step_failure(worker, plan, f"suspend checkpoint: {type(err).__name__}: {err}")
        return
    finally:
        worker.out_of_step.set()
    _report_checkpoint(worker, plan, outcome)
    saved = any(done.step == ts.step for done in outcome.completed)
    worker.teardown()
    detail = f"suspended: checkpoint of step {ts.step} " + ("complete" if saved else "failed")
    worker.move(WorkerState.WAITING, detail, epoch=plan.epoch)


def _checkpoint_after_step(worker: Worker, plan: MeshPlan) -> bool:
    """Start or complete a checkpoint after a step (collective; watched like a step); False
    when a collective failed (the failure is then handled like a failed step)."""
    assert worker.saver is not None and worker.ts is not None
    worker.out_of_step.clear()
    worker.marks.begin(Phase.CHECKPOINT, worker.ts.step)
    try:
        outcome = worker.saver.after_step(worker.ts, plan.epoch, plan.sizes.model_dump())
        # After the save's collectives: the peers go on and wait for this rank in the next step.
        worker.faults.maybe_fire(plan.epoch, worker.rank, worker.ts.step, InjectionPoint.CHECKPOINT)
    except RuntimeError as err:
        if not (worker.aborted.is_set() or is_collective_error(err)):
            raise
        worker.saver.abandon()
        _on_step_failure(worker, plan, f"checkpoint: {type(err).__name__}: {err}")
        return False
    finally:
        took = worker.marks.end()
        worker.out_of_step.set()
    if outcome.completed or worker.saver.in_flight is not None or took > worker.limits.step_limit() / 2:
        worker.limits.warm_up_next()  # a save ran or is being written: the next step may be slow
    _report_checkpoint(worker, plan, outcome)
    return True


def _report_checkpoint(worker: Worker, plan: MeshPlan, outcome: checkpoint.SaveOutcome) -> None:
    """Tell the agent which saves completed, which one was skipped and which failed."""
    assert worker.saver is not None
    for done in outcome.completed:
        worker.send(
            CheckpointSaved(
                epoch=plan.epoch,
                step=done.step,
                blocking_seconds=done.blocking_seconds,
                total_seconds=done.total_seconds,
                start_phases=done.start_phases,
            )
        )
    if outcome.skipped is not None:
        detail = f"the save of step {worker.saver.in_flight} was still being written"
        worker.send(CheckpointProblem(epoch=plan.epoch, step=outcome.skipped, kind="skipped", detail=detail))
    for step, why in outcome.failed:
        worker.send(CheckpointProblem(epoch=plan.epoch, step=step, kind="failed", detail=why[:1000]))


def _on_step_failure(worker: Worker, plan: MeshPlan, failure: str) -> None:
    """The step failed or was aborted: discard it, free the groups, and report when it was
    not our own decision (a newer plan) that stopped it."""
    with worker.lock:
        by_plan = worker.aborted.is_set() and worker.abort_reason.startswith("new plan")
        if worker.aborted.is_set() and worker.abort_reason.startswith("hang") and "hang" not in failure:
            failure = f"{worker.abort_reason} ({failure})"  # say why the collective failed
        if worker.detected_at is None:
            worker.detected_at, worker.detected_wall = time.monotonic(), time.time()
            worker.abort_reason = failure
    worker.aborted.set()  # late commits of this epoch must refuse
    if worker.detected_at is not None:
        worker.phases["step_exit"] = time.monotonic() - worker.detected_at
    log.warning("epoch %d step %d discarded: %s", plan.epoch, worker.completed, failure)
    if worker.ts is not None and worker.ts.torn:
        log.warning(
            "epoch %d step %d: the optimizer update had written this rank's shard when the step failed: its"
            " state is of no step, its shard comes back from a host copy",
            plan.epoch,
            worker.completed,
        )
    copies = worker.copies
    if copies is not None and copies.salvage(SALVAGE_WAIT):  # before the report: the plan may use them
        worker.send(ReplicaSteps(epoch=plan.epoch, steps=copies.complete_steps()))
    worker.teardown(aborted=True)
    if by_plan:
        return
    worker.send(CollectiveFailed(epoch=plan.epoch, reason=failure[:1000]))
    worker.move(WorkerState.WAITING, failure[:200], epoch=plan.epoch)


def _logs_samples(worker: Worker, plan: MeshPlan) -> bool:
    """Whether this rank writes the samples it trained on: one rank per data-parallel replica (the
    first of its tensor, context and pipeline groups), and only when a sample log is asked for."""
    if not worker.sample_log_dir:
        return False
    c = plan.sizes.coords_of(worker.rank)
    return c.tp == 0 and c.cp == 0 and c.pp == 0


def log_refused_step(worker: Worker) -> None:
    """After joining a new epoch: log the samples of the step this rank discarded at its update in
    the previous one when its data-parallel peers committed that step, with this rank's gradients
    (the state it now holds is past that step); forget that step either way. Called for the epoch
    right after, before anything trains: a later one may have trained that step again."""
    refused, worker.refused_step = worker.refused_step, None
    if refused is None or worker.ts is None or worker.ts.step <= refused.step:
        return
    log.info(
        "epoch %d step %d, discarded here at the update, was committed by the data-parallel peers",
        refused.epoch,
        refused.step,
    )
    _log_samples(
        worker,
        refused.epoch,
        refused.rank,
        refused.dp_rank,
        refused.step,
        refused.trained.samples,
        refused.trained.loss,
    )


def _log_samples(
    worker: Worker, epoch: int, rank: int, dp_rank: int, step: int, samples: tuple[int, ...], loss: float
) -> None:
    """Append a committed step's sample indices to this process's sample log, one JSON line per step
    (``MEGATRON_WORKER_SAMPLE_LOG``: tests and benchmarks check the sample accounting with it)."""
    assert worker.sample_log_dir is not None
    path = Path(worker.sample_log_dir) / f"{worker.pod}-{worker.local_rank}.jsonl"
    record = {
        "epoch": epoch,
        "step": step,
        "dpRank": dp_rank,
        "rank": rank,
        "samples": list(samples),
        "loss": loss,
    }
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
