"""Entering an epoch: the stages of one reconfiguration, from a plan to the epoch's first step.

A plan that names this pod takes the worker out of its previous epoch (worker/abort.py), then
through rendezvous (rendezvous.py), rebuild (model.py), restore (peer_restore.py, checkpoint.py) and
verify (verify.py), timing each stage for the agent (``PhaseTimes``, sent with the first step's
time), and hands the epoch to the training loop (training_loop.py) or, for a suspend plan, to its
checkpoint. A plan that does not name the pod makes the worker a spare.

A join that fails for a collective reason, or that a newer plan overtakes, is the epoch's failure,
not this worker's: it releases what it created, tells the agent whom to suspect unless a newer plan
ended it, and waits for the next plan. A state mismatch or a bug raises: no other plan would fix it.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from megatron_contract.mesh import MeshPlan, PlanReason, StateSourceKind
from megatron_trainer.channel import CheckpointProblem, CollectiveFailed
from megatron_trainer.faults import InjectionPoint
from megatron_trainer.worker import checkpoint, rendezvous, shard_restore, training_loop
from megatron_trainer.worker.buddy_copies import buddy_and_ward, exchange_links
from megatron_trainer.worker.collective_errors import is_collective_error
from megatron_trainer.worker.lifecycle import WorkerState
from megatron_trainer.worker.model import (
    HeldState,
    TrainState,
    adopt_state,
    build_train_state,
    detach_state,
    sync_initial_weights,
)
from megatron_trainer.worker.peer_restore import restore_from_peers
from megatron_trainer.worker.step import guard_commit
from megatron_trainer.worker.verify import StateMismatch, verify_state
from megatron_trainer.worker.watchdog import PeerActivity

if TYPE_CHECKING:
    from megatron_trainer.worker.runtime import Worker

log = logging.getLogger("megatron_trainer.worker")


def enter(worker: Worker, plan: MeshPlan) -> None:
    """Serve ``plan``: wait as a spare when it does not name this pod; otherwise join its epoch and
    train in it until the epoch ends (done, a newer plan, a failure) or, for a suspend, save."""
    member = plan.member(worker.pod)
    if member is None:
        worker.refused_step = None  # others may train that step again meanwhile
        worker.teardown()
        worker.copies = None  # no plan takes a shard from a spare's copies: free their host memory
        worker.epoch = 0
        worker.move(WorkerState.SPARE, f"not a member of epoch {plan.epoch}", epoch=plan.epoch)
        return
    if worker.local_rank >= len(member.ranks):
        raise ValueError(
            f"plan epoch {plan.epoch} gives pod {worker.pod} {len(member.ranks)} ranks;"
            f" this worker is local rank {worker.local_rank}"
        )
    begin = time.perf_counter()
    worker.move(WorkerState.RECONFIGURING, f"entering epoch {plan.epoch}", epoch=plan.epoch)
    worker.teardown(aborted=worker.aborted.is_set(), moving=True)
    phases = _start_phases(worker)
    worker.rank = member.ranks[worker.local_rank]
    if not EpochJoin(worker, plan, phases, begin).run():
        return
    training_loop.log_refused_step(worker)
    if plan.reason is PlanReason.SUSPEND:
        training_loop.save_and_stop(worker, plan)
        return
    worker.move(WorkerState.TRAINING, f"rank {worker.rank} of {plan.mesh_label}")
    try:
        training_loop.train(worker, plan, phases)
    finally:
        if worker.saver is not None:
            worker.saver.abandon()  # a save this epoch did not complete (nothing when none)


def _start_phases(worker: Worker) -> dict[str, float]:
    """The new reconfiguration's timings, starting with the previous epoch's abort and when its
    failure was noticed; the interrupt is cleared for the new epoch."""
    phases = worker.phases
    worker.phases = {}
    if worker.detected_wall is not None:
        phases["detected_at_unix"] = worker.detected_wall
    worker.aborted.clear()
    worker.detected_at = worker.detected_wall = None
    return phases


class EpochJoin:
    """One attempt at joining ``plan``'s epoch as ``worker.rank``. Holds what its stages built so
    far, so that a join abandoned midway leaves a keeper the state it kept."""

    def __init__(self, worker: Worker, plan: MeshPlan, phases: dict[str, float], begin: float) -> None:
        self.worker = worker
        self.plan = plan
        self.phases = phases
        self.begin = begin  # when the plan was taken up (perf_counter)
        self.source = plan.source_of(worker.rank)
        self.interrupted = _superseded_check(worker, plan.epoch)
        self.ts: TrainState | None = None
        self.adopted = False  # ts holds the state this worker kept
        self.moved = 0  # bytes received from peers
        self.checksum = 0
        # The plan moves distributed-optimizer shards: the state this worker trained with stays
        # whole until the restore took its shard (and goes back to the worker if the join fails).
        self.moves_shards = shard_restore.moves_shards(plan, worker.spec.training.optimizer.distributed)
        self.kept: HeldState | None = None

    def run(self) -> bool:
        """Rendezvous, rebuild, restore and verify; True with the verified state in ``worker.ts``,
        False when the join was abandoned (the worker then waits for the next plan)."""
        worker = self.worker
        try:
            self._rendezvous()
            self._rebuild()
            self._restore()
            self._verify()
        except (rendezvous.Superseded, rendezvous.RendezvousFailed, RuntimeError) as err:
            joining = isinstance(err, rendezvous.Superseded | rendezvous.RendezvousFailed)
            if not joining and (isinstance(err, StateMismatch) or not (self.interrupted() or is_collective_error(err))):
                raise  # wrong state or a bug: no other plan would fix it
            if self.adopted and self.ts is not None:
                worker.held = detach_state(self.ts, worker.rank)  # a keeper keeps its state for the next plan
            elif self.kept is not None:
                worker.held = self.kept
            self.ts = None
            _abandon_join(worker, self.plan, err)
            return False
        finally:
            worker.out_of_step.set()
        assert self.ts is not None
        worker.ts = self.ts
        with worker.lock:
            worker.completed = self.ts.step
        log.info(
            "epoch %d rank %d %s: state from %s (%d bytes moved), step %d, checksum %x, in %.3fs",
            self.plan.epoch,
            worker.rank,
            self.plan.sizes.coords_of(worker.rank).model_dump(),
            self.source.kind.value,
            self.moved,
            self.ts.step,
            self.checksum,
            time.perf_counter() - self.begin,
        )
        return True

    def _rendezvous(self) -> None:
        """Join the epoch's process groups through its store; the epoch's collectives start here."""
        worker = self.worker
        t = time.perf_counter()
        worker.epoch = self.plan.epoch  # from here on teardown releases whatever the join created
        worker.store = rendezvous.join_epoch(
            self.plan,
            worker.rank,
            worker.backend,
            worker.spec.failure_detection.collective_timeout_seconds,
            self.interrupted,
        )
        pair = buddy_and_ward(self.plan, worker.rank) if worker.spec.training.optimizer.distributed else None
        if pair is not None:  # with the epoch's groups: every rank makes its links here
            limit = timedelta(seconds=worker.spec.failure_detection.collective_timeout_seconds)
            worker.copy_links = exchange_links(worker.store, worker.rank, *pair, limit)
        self.phases["rendezvous"] = time.perf_counter() - t
        worker.activity = PeerActivity(worker.store)
        worker.out_of_step.clear()  # collectives from here on: an interrupt may need to abort them

    def _rebuild(self) -> None:
        """Build model and optimizer on the epoch's groups (Megatron's modules capture them), on the
        state this worker kept when the plan says it keeps it; otherwise on new tensors, initialized
        only when the plan starts from scratch (restore fills them from peers or a checkpoint)."""
        worker, plan, kind = self.worker, self.plan, self.source.kind
        t = time.perf_counter()
        connecting = rendezvous.connect_communicators(worker.device)
        if self.moves_shards:
            self.kept, worker.held, kind = worker.held, None, StateSourceKind.PEER  # built anew, filled by the restore
        if kind is not StateSourceKind.SELF:
            # Free the warm (or stale) state first: the new build then reuses its blocks from
            # the caching allocator instead of paying for ~1000 fresh cudaMalloc calls.
            worker.held = None
        self.ts = build_train_state(
            worker.spec,
            worker.device,
            initialize=kind is StateSourceKind.INIT,
            before_collectives=connecting.join if connecting else None,
        )
        if kind is StateSourceKind.SELF:
            if worker.held is None:
                raise RuntimeError(
                    f"plan epoch {plan.epoch} says rank {worker.rank} keeps its state, but it holds none"
                )
            if worker.held.torn:  # only a restore of its shard from its snapshot mends it
                raise StateMismatch(
                    f"plan epoch {plan.epoch} says rank {worker.rank} keeps its state, but its optimizer update"
                    f" of step {worker.held.step + 1} failed half done (the parameters' all-gather): it is of no step"
                )
            adopt_state(self.ts, worker.held)
            self.adopted = True
        elif kind is StateSourceKind.INIT:
            # GPU initialization draws from per-device generators; like Megatron's own training
            # loop, make every DP replica start from DP rank 0's weights.
            sync_initial_weights(self.ts)
        worker.held = None

        def before_update(step: int) -> None:
            worker.faults.maybe_fire(plan.epoch, worker.rank, step, InjectionPoint.BEFORE_UPDATE)
            if worker.copies is not None:  # a refresh's assembly reads the state the update writes
                worker.copies.hold_update(worker.device)

        guard_commit(self.ts, worker.aborted.is_set, worker.device, before_update)
        self.phases["rebuild"] = time.perf_counter() - t
        self.phases.update({f"rebuild_{k}": v for k, v in self.ts.build_seconds.items()})

    def _restore(self) -> None:
        """The state this rank does not hold: from data-parallel peers, or the checkpoint the plan
        names."""
        worker = self.worker
        t = time.perf_counter()
        assert self.ts is not None and worker.store is not None
        if self.moves_shards:
            self.moved = shard_restore.restore_shards(
                self.ts,
                self.plan,
                worker.rank,
                self.kept,
                worker.copies,
                worker.device,
                worker.store,
                self.interrupted,
                self.phases,
            )
            self.kept = None
        else:
            self.moved = restore_from_peers(
                self.ts, self.plan, worker.device, worker.store, self.interrupted, self.phases
            )
        if StateSourceKind.CHECKPOINT in self.plan.source_kinds():
            _restore_checkpoint(worker, self.ts, self.plan, self.phases)
        if worker.device.type == "cuda":
            torch.cuda.synchronize()
        self.phases["restore"] = time.perf_counter() - t

    def _verify(self) -> None:
        """The epoch's ranks agree on the step, and each data-parallel group on its state."""
        worker = self.worker
        t = time.perf_counter()
        assert self.ts is not None and worker.store is not None
        self.checksum = verify_state(self.ts, self.plan, worker.rank, worker.store, self.interrupted)
        self.phases["verify"] = time.perf_counter() - t


def _restore_checkpoint(worker: Worker, ts: TrainState, plan: MeshPlan, phases: dict[str, float]) -> None:
    """Load the checkpoint the plan names for this rank (its resume step when it names none),
    telling the agent of every checkpoint rejected on the way."""
    if worker.spec.checkpoint is None:
        raise ValueError("plan restores from a checkpoint but the job has no spec.checkpoint")
    step = plan.source_of(worker.rank).checkpoint_step
    step = step if step is not None else plan.resume_step
    # Raises CheckpointUnusable after two checkpoints failed verification: the worker then
    # fails (reported) instead of restoring again and again.
    try:
        checkpoint.restore_checkpoint(
            ts,
            worker.spec,
            step,
            on_rejected=lambda s, why: worker.send(
                CheckpointProblem(epoch=plan.epoch, step=s, kind="rejected", detail=why[:1000])
            ),
            phases=phases,
        )
    except checkpoint.CheckpointUnusable as err:
        worker.send(CheckpointProblem(epoch=plan.epoch, step=step, kind="unusable", detail=str(err)[:1000]))
        raise


def _superseded_check(worker: Worker, epoch: int) -> rendezvous.Interrupted:
    """True once the join of ``epoch`` is moot: interrupted, or a newer plan is waiting."""

    def superseded() -> bool:
        with worker.lock:
            pending = worker.pending_plan
        return worker.aborted.is_set() or (pending is not None and pending.epoch > epoch)

    return superseded


def _abandon_join(worker: Worker, plan: MeshPlan, err: BaseException) -> None:
    """The join of ``plan`` failed or was overtaken: release what it created and, unless a
    newer plan ended it, tell the agent whom to suspect (the store's pod, or the ranks that
    never arrived), then wait for the next plan. The process lives on: a join that cannot
    complete is the epoch's failure, not this worker's."""
    worker.aborted.set()  # late commits of this epoch must refuse
    worker.teardown(aborted=True)
    with worker.lock:
        newer = worker.pending_plan is not None and worker.pending_plan.epoch > plan.epoch
    if newer or isinstance(err, rendezvous.Superseded):
        log.info("epoch %d abandoned for a newer plan: %s", plan.epoch, err)
        return
    log.warning("epoch %d could not be joined: %s", plan.epoch, err)
    for rank, pod in _suspects(plan, err)[:8] or [(None, None)]:
        worker.send(CollectiveFailed(epoch=plan.epoch, peer_rank=rank, peer_pod=pod, reason=str(err)[:1000]))
    worker.move(WorkerState.WAITING, str(err)[:200], epoch=plan.epoch)


def _suspects(plan: MeshPlan, err: BaseException) -> list[tuple[int | None, str | None]]:
    """Whom a failed rendezvous points at, as (rank, pod): the pod hosting the epoch's store when
    it could not be reached, and the pods of the ranks that never arrived; none otherwise."""
    suspects: list[tuple[int | None, str | None]] = []
    if isinstance(err, rendezvous.RendezvousFailed):
        if err.store_host is not None:
            host = next((m.pod for m in plan.members if m.address == plan.rendezvous.host), None)
            suspects.append((None, host))
        pod_of = plan.pod_of_rank()
        for absent in dict.fromkeys(pod_of[r] for r in err.missing if r in pod_of):
            suspects.append((None, absent))
    return suspects
