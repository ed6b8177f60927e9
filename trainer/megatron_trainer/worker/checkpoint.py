"""Distributed checkpoints with Megatron's ``dist_checkpointing``: the fallback when no DP peer
holds a rank's state. Checkpoints reshard (measured on megatron-core 0.19: TP2xDP2 -> TP1xDP3 and
PP2 -> TP2, next-step loss bit-identical; TP2xDP2 -> TP2xDP1 in the tests).

Saving is asynchronous, on Megatron's own path: ``dist_checkpointing.save(...,
async_sharded_save=True)`` plans the save (collective), and an ``AsyncCallsQueue`` copies the
tensors to host memory and forks a writer (Megatron's ``TemporalAsyncCaller``); the step that
triggered the save returns then, and training goes on while the writer writes (on GPUs the host
buffers of that copy are pinned ahead, in a thread, at each epoch's first step: :mod:`.host_buffers`;
otherwise the first save would pin them in its step, ~10 s for a 15 GB share). Each later step
polls the queue (one small all-reduce, on every rank, so every rank finalizes at the same step);
once every rank's writer is done, Megatron's finalization writes its metadata and rank 0 publishes
the checkpoint: manifest written, directory renamed into place (:mod:`.checkpoint_files`). Only
then is it reported. At most one save is in flight; a save due while one still runs is skipped and
reported. A save in flight when the epoch ends (a re-mesh, a failure, shutdown) is abandoned: its
writer is killed and its partial directory never becomes a checkpoint; the collectives a
finalization needs belong to the epoch being torn down.

Both directions use Megatron's fully parallel wrappers over the data-parallel group: the DP
replicas share the writing of what they all hold, and on load each reads a share of the shards
and they exchange the rest.

Loading verifies first: the manifest against the job's configuration, and every file's size and
sha256 (the files are shared out over the ranks, the verdict agreed by all; this reads the
checkpoint once more than the load itself). A checkpoint that
fails is skipped with a log line and a report to the agent, and the next older one is tried; the
second failure ends the restore with :class:`CheckpointUnusable`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_contract.job import MegatronJobSpec
from megatron_trainer.worker import checkpoint_files, host_buffers, writer_processes
from megatron_trainer.worker.checkpoint_files import (
    ManifestError,
    checkpoint_dir,
    complete_steps,
    newest_complete,
    partial_dir,
)
from megatron_trainer.worker.model import TrainState, inner_optimizers, set_scheduler_steps

__all__ = [
    "CheckpointSaver",
    "CheckpointUnusable",
    "SaveOutcome",
    "checkpoint_dir",
    "newest_complete",
    "restore_checkpoint",
]

log = logging.getLogger(__name__)

MAX_VERIFICATION_FAILURES = 2
# For tests (slow or failing storage, made deterministic): a directory; the writer of step N waits
# until a file named N exists in it before writing, and fails instead if the file says "fail".
ENV_WRITER_GATE = "MEGATRON_CHECKPOINT_WRITER_GATE"
# Megatron's DistributedOptimizer only reshards (DP change) from this format.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


class CheckpointUnusable(RuntimeError):
    """No checkpoint that passed verification could be restored; retrying would loop."""


def job_config_hash(spec: MegatronJobSpec) -> str:
    """Hash recorded in every manifest; a checkpoint with another one is not loaded."""
    return checkpoint_files.config_hash(spec.model.to_wire(), spec.training.precision.value)


# Distributed-optimizer state saved in model space, so that it loads under any data-parallel size.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded_state_dict(ts: TrainState, is_loading: bool = False) -> dict[str, object]:
    # The model inside DDP: DDP's own sharded_state_dict prefixes every key with "module.", which
    # its load_state_dict (delegating to the inner module) then does not recognise.
    model_sd = ts.model.module.sharded_state_dict()
    optimizer_sd = ts.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPTIMIZER_METADATA)
    # The scheduler's state is a plain dict: dist_checkpointing saves it once, in the common part.
    return {"model": model_sd, "optimizer": optimizer_sd, "opt_param_scheduler": ts.scheduler.state_dict()}


def _write_and_record(
    write: Callable[..., None], directory: str, rank: int, gate: str | None, *args: Any, **kwargs: Any
) -> None:
    """Runs in the forked writer: Megatron's write, then this rank's part of the manifest (the
    files it wrote, with their checksums), so the writer is done only once both are on disk."""
    if gate:
        opened = Path(gate) / str(int(Path(directory).name.rsplit("-", 1)[1]))
        while not opened.exists():
            time.sleep(0.05)
        if opened.read_text().strip() == "fail":
            raise OSError(f"write of {Path(directory).name} failed (injected through {ENV_WRITER_GATE})")
    start = time.perf_counter()
    write(*args, **kwargs)
    buckets = args[1]  # Megatron's write buckets: (path, storage key, data) per file
    checkpoint_files.write_part(Path(directory), rank, [Path(b[0]) for b in buckets])
    log.info("writer: %d files of %s written in %.2fs", len(buckets), Path(directory).name, time.perf_counter() - start)


@dataclasses.dataclass(frozen=True)
class Completed:
    """A checkpoint that became complete."""

    step: int
    blocking_seconds: float  # training-thread time of the step that started it (sync: the whole save)
    total_seconds: float  # from its start to complete
    start_phases: dict[str, float]  # where the starting step's time went: plan, host_copy (copy + fork)


@dataclasses.dataclass
class SaveOutcome:
    """What one call of :meth:`CheckpointSaver.after_step` did."""

    completed: list[Completed] = dataclasses.field(default_factory=list)  # checkpoints that became complete
    skipped: int | None = None  # step whose save was not started: the previous one still ran
    failed: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (step, why) of saves given up
    blocking_seconds: float = 0.0  # time the training thread spent in the call


@dataclasses.dataclass
class _InFlight:
    step: int
    directory: Path
    started: float
    mesh: dict[str, Any]
    epoch: int
    blocking: float = 0.0  # training-thread time of the step that started it
    phases: dict[str, float] = dataclasses.field(default_factory=dict)


class CheckpointSaver:
    """Asynchronous saves of one worker (see the module docstring). Every method is collective
    over the epoch's world except :meth:`abandon`."""

    def __init__(self, spec: MegatronJobSpec) -> None:
        assert spec.checkpoint is not None
        self.root = Path(spec.checkpoint.path)
        self.interval = spec.checkpoint.interval_steps
        self.keep = spec.checkpoint.keep
        self.asynchronous = spec.checkpoint.async_save
        self.config_hash = job_config_hash(spec)
        self._queue: Any = None  # megatron's AsyncCallsQueue, made at the first save
        self._in_flight: _InFlight | None = None
        self._last_started: int | None = None
        # Asynchronous saves on GPUs: the first save's pinned buffers, reserved ahead (see host_buffers).
        self._host_buffers = host_buffers.HostBufferReservation()
        # Not with the distributed optimizer: its fully reshardable state dict gathers every rank's
        # shard through pageable host memory (on 2xH100, a 1.1 B GPT: over a minute), which sizing
        # the reservation would add to every epoch's first step; its saves' own gather dwarfs what
        # the reservation saves.
        self._reserve_host_buffers = (
            self.asynchronous and torch.cuda.is_available() and not spec.training.optimizer.distributed
        )
        self._reserved_epoch: int | None = None
        writer_processes.install_results_queue()  # starts the writers' manager now, not at the first save

    @property
    def in_flight(self) -> int | None:
        """Step of the save being written, if any."""
        return self._in_flight.step if self._in_flight else None

    def after_step(self, ts: TrainState, epoch: int, mesh: dict[str, Any]) -> SaveOutcome:
        """Called by every rank after every completed step: finish a save whose writers are done,
        start one when due."""
        start = time.perf_counter()
        outcome = SaveOutcome()
        if self._in_flight is not None:
            self._poll(outcome, blocking=False)
        if ts.step % self.interval == 0:
            if self._in_flight is not None:
                outcome.skipped = ts.step
                log.warning(
                    "checkpoint of step %d skipped: the save of step %d is still being written",
                    ts.step,
                    self._in_flight.step,
                )
            elif self._start(ts, epoch, mesh, outcome):
                assert self._in_flight is not None
                self._in_flight.blocking = time.perf_counter() - start
                if not self.asynchronous:
                    self._poll(outcome, blocking=True)
        elif self._reserve_host_buffers and self._reserved_epoch != epoch:
            # At every epoch's first step (the same step on every rank: it is collective), since
            # the mesh decides this rank's share.
            sizes = host_buffers.write_share_bytes(_sharded_state_dict(ts), _save_strategy())
            self._host_buffers.start(sizes, mesh)
        self._reserved_epoch = epoch
        outcome.blocking_seconds = time.perf_counter() - start
        return outcome

    def finish(self, ts: TrainState, epoch: int, mesh: dict[str, Any]) -> SaveOutcome:
        """End of training: complete the save in flight, then save the final state if its save
        was due but skipped (the job's last checkpoint should be its last step)."""
        start = time.perf_counter()
        outcome = SaveOutcome()
        if self._in_flight is not None:
            self._poll(outcome, blocking=True)
        if ts.step % self.interval == 0 and self._last_started != ts.step and self._start(ts, epoch, mesh, outcome):
            self._poll(outcome, blocking=True)
        outcome.blocking_seconds = time.perf_counter() - start
        return outcome

    def save_now(self, ts: TrainState, epoch: int, mesh: dict[str, Any]) -> SaveOutcome:
        """A suspend plan's checkpoint: of ``ts.step``, written synchronously, published and then
        verified like a restore verifies (every file's checksum, shared out over the ranks), so that
        the pods, the only other holders of the state, may go. A checkpoint that fails verification
        is reported failed. Collective."""
        start = time.perf_counter()
        outcome = SaveOutcome()
        if self._in_flight is not None:  # none at an epoch's start (the last epoch's was abandoned)
            self._poll(outcome, blocking=True)
        if self._start(ts, epoch, mesh, outcome):
            self._poll(outcome, blocking=True)
        if any(done.step == ts.step for done in outcome.completed):
            reason = _verify(checkpoint_dir(self.root, ts.step), self.config_hash)
            if reason is not None:
                outcome.completed = [done for done in outcome.completed if done.step != ts.step]
                outcome.failed.append((ts.step, f"checkpoint of step {ts.step} failed verification: {reason}"))
                log.error("%s", outcome.failed[-1][1])
        outcome.blocking_seconds = time.perf_counter() - start
        return outcome

    def abandon(self) -> None:
        """Drop the save in flight without any collective: kill its writer (the epoch's groups may
        be gone). Its partial directory is deleted by a later save."""
        if self._in_flight is None:
            return
        log.warning("checkpoint of step %d abandoned (the epoch ended before it was complete)", self._in_flight.step)
        for call in list(self._queue.async_calls):
            process = getattr(call.async_caller, "process", None)
            if process is not None and process.is_alive():
                process.kill()
                process.join(10)
            call.async_caller.process = None
            call.async_caller.preloaded_holder = None
        # A writer that finished before it was killed left its results on the shared queue,
        # where the next save would read them as its own.
        writer_processes.drain_results()
        self._queue = None
        self._in_flight = None

    # -- internals ---------------------------------------------------------------------------------

    def _start(self, ts: TrainState, epoch: int, mesh: dict[str, Any], outcome: SaveOutcome) -> bool:
        """Plan the save and fork the writers; False (and ``outcome.failed``) when the directory
        cannot be made."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        writer_processes.install_results_queue()
        directory = partial_dir(self.root, ts.step)
        self._last_started = ts.step
        error: list[str | None] = [None]
        if dist.get_rank() == 0:
            try:
                shutil.rmtree(directory, ignore_errors=True)  # an earlier attempt at the same step
                directory.mkdir(parents=True)
            except OSError as err:
                error[0] = f"{type(err).__name__}: {err}"
        dist.broadcast_object_list(error, src=0)  # every rank gives up together, or none does
        if error[0]:
            outcome.failed.append((ts.step, f"checkpoint of step {ts.step} not started: {error[0]}"))
            log.error("%s", outcome.failed[-1][1])
            return False
        waited = self._host_buffers.wait()  # its buffers are the ones this save copies into
        planning = time.perf_counter()
        request = dist_checkpointing.save(
            _sharded_state_dict(ts),
            str(directory),
            sharded_strategy=_save_strategy(),
            async_sharded_save=True,
            async_strategy="mcore",
        )
        assert request is not None
        rank = dist.get_rank()
        if request.async_fn is None:  # nothing to write on this rank: record that at once
            checkpoint_files.write_part(directory, rank, [])
        else:
            request = request._replace(
                async_fn=functools.partial(
                    _write_and_record, request.async_fn, str(directory), rank, os.environ.get(ENV_WRITER_GATE)
                )
            )
        copying = time.perf_counter()
        if self._queue is None:
            self._queue = AsyncCallsQueue(persistent=False)
        with writer_processes.forking_writer():
            self._queue.schedule_async_request(request)  # the device-to-host copy, then the writer's fork
        now = time.perf_counter()
        phases = {"plan": copying - planning, "host_copy": now - copying}
        if waited > 0.001:
            phases["host_buffers_wait"] = waited
        log.info("checkpoint of step %d started: %s", ts.step, ", ".join(f"{k} {v:.3f}s" for k, v in phases.items()))
        self._in_flight = _InFlight(ts.step, directory, now, mesh, epoch, phases=phases)
        return True

    def _poll(self, outcome: SaveOutcome, blocking: bool) -> None:
        from megatron.core.dist_checkpointing.core import CheckpointingException
        from torch.distributed.checkpoint import CheckpointException  # a BaseException

        assert self._in_flight is not None
        flight = self._in_flight
        try:
            done = self._queue.maybe_finalize_async_calls(blocking=blocking)
        except (CheckpointingException, CheckpointException) as err:  # a writer failed: raised on every rank
            self._queue, self._in_flight = None, None
            outcome.failed.append((flight.step, f"checkpoint of step {flight.step} failed: {err}"))
            log.error("%s", outcome.failed[-1][1])
            return
        if not done:
            return
        # A queue per save: Megatron checks that every rank finalizes the same call index, and a
        # rank that joined in a later epoch (a promoted spare) has made fewer saves than the others.
        self._queue, self._in_flight = None, None
        error = self._publish(flight) if dist.get_rank() == 0 else ""
        errors: list[str | None] = [error]
        dist.broadcast_object_list(errors, src=0)
        if errors[0]:
            outcome.failed.append((flight.step, f"checkpoint of step {flight.step} not published: {errors[0]}"))
            log.error("%s", outcome.failed[-1][1])
            return
        total = time.perf_counter() - flight.started
        held = flight.blocking if self.asynchronous else total
        outcome.completed.append(Completed(flight.step, held, total, flight.phases))
        log.info("checkpoint of step %d complete in %.2fs (training held %.3fs)", flight.step, total, held)

    def _publish(self, flight: _InFlight) -> str:
        header = {
            "step": flight.step,
            "epoch": flight.epoch,
            "mesh": flight.mesh,
            "config_hash": self.config_hash,
        }
        try:
            checkpoint_files.publish(
                flight.directory, checkpoint_dir(self.root, flight.step), dist.get_world_size(), header
            )
            checkpoint_files.prune(self.root, self.keep)
        except (OSError, ManifestError) as err:
            return f"{type(err).__name__}: {err}"
        return ""


# -- restore -------------------------------------------------------------------------------------


def restore_checkpoint(
    ts: TrainState,
    spec: MegatronJobSpec,
    step: int,
    on_rejected: Callable[[int, str], None],
    parallel_load: bool = True,
    phases: dict[str, float] | None = None,
) -> int:
    """Load the checkpoint of ``step`` into ``ts`` (collective), or, when it fails verification,
    the next older complete one; returns the step loaded.

    ``on_rejected(step, reason)`` is called on every rank for each checkpoint that failed.
    ``phases`` receives the seconds spent verifying (``restore_verify``) and loading (``restore_load``).
    Raises :class:`CheckpointUnusable` after :data:`MAX_VERIFICATION_FAILURES` failures, or when
    no candidate is left.
    """
    assert spec.checkpoint is not None
    root = Path(spec.checkpoint.path)
    expected_hash = job_config_hash(spec)
    listing: list[list[int]] = [[step] + [s for s in complete_steps(root) if s < step]]
    dist.broadcast_object_list(listing, src=0)  # one view of the directory for every rank
    failures: list[str] = []
    phases = {} if phases is None else phases
    for candidate in listing[0]:
        start = time.perf_counter()
        reason = _verify(checkpoint_dir(root, candidate), expected_hash)
        phases["restore_verify"] = phases.get("restore_verify", 0.0) + time.perf_counter() - start
        if reason is None:
            start = time.perf_counter()
            _load(ts, checkpoint_dir(root, candidate), parallel_load)
            phases["restore_load"] = time.perf_counter() - start
            ts.step = candidate
            if failures:
                log.warning("restored the older checkpoint of step %d instead of step %d", candidate, step)
            return candidate
        failures.append(f"step {candidate}: {reason}")
        log.error("checkpoint of step %d rejected: %s", candidate, reason)
        on_rejected(candidate, reason)
        if len(failures) >= MAX_VERIFICATION_FAILURES:
            break
    raise CheckpointUnusable(
        f"no usable checkpoint at or before step {step} under {root}: " + "; ".join(failures or ["none found"])
    )


def _verify(directory: Path, expected_hash: str) -> str | None:
    """Every rank checks its share of the files; None when all agree the checkpoint is intact."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reason = ""
    try:
        manifest = checkpoint_files.read_manifest(directory, expected_hash)
        names = sorted(manifest["files"])
        checkpoint_files.verify_files(directory, manifest, names[rank::world])
    except ManifestError as err:
        reason = str(err)
    except OSError as err:
        reason = f"{type(err).__name__}: {err}"
    reasons: list[str] = [""] * world
    dist.all_gather_object(reasons, reason)
    found = [r for r in reasons if r]
    return found[0] if found else None


def _data_parallel_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _save_strategy() -> Any:
    """Megatron's fully parallel save: the DP replicas share the writing of what they all hold
    (without it DP rank 0 writes every replicated tensor)."""
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy(), _data_parallel_group())


class _AbsentIsNone(dict[str, Any]):
    def __missing__(self, key: str) -> None:
        return None


def _tolerate_adam_step_state() -> None:
    """megatron-core 0.19's DistributedOptimizer, loading ``fully_reshardable`` state with torch's
    Adam (no Apex/TE), copies every tensor of the live optimizer state from the loaded shard, but
    the loaded shard leaves out Adam's ``step`` tensor (restored from the param groups instead):
    ``KeyError: 'step'``. An entry absent from the shard is skipped, as the method already skips
    non-tensor entries."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "tolerates_absent_state", False):
        return

    def patched(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        original(self, model_param, _AbsentIsNone(tensors))

    patched.tolerates_absent_state = True  # type: ignore[attr-defined]
    DistributedOptimizer._set_main_param_and_optimizer_states = patched


def _unshare_adam_steps(ts: TrainState) -> None:
    """The DistributedOptimizer's loader gives every parameter's state one shared ``step`` tensor
    (built once from the param groups); torch's Adam increments ``step`` in place per parameter,
    so a shared one would advance once per parameter per step. Each gets its own copy."""
    for opt in inner_optimizers(ts.optimizer):
        for state in opt.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _load(ts: TrainState, directory: Path, parallel_load: bool) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    if ts.spec.training.optimizer.distributed:
        _tolerate_adam_step_state()
    strategy = None
    if parallel_load and dist.get_world_size() > 1:
        # Megatron's fully parallel load: each DP replica reads a share of the shards and the
        # replicas exchange the rest, instead of every replica reading everything.
        strategy = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), _data_parallel_group())
    start = time.perf_counter()
    loaded = dist_checkpointing.load(_sharded_state_dict(ts, is_loading=True), str(directory), strategy)
    ts.model.load_state_dict(loaded["model"])
    ts.optimizer.load_state_dict(loaded["optimizer"])
    _unshare_adam_steps(ts)
    set_scheduler_steps(ts, int(loaded["opt_param_scheduler"]["num_steps"]))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    log.info("checkpoint %s loaded in %.2fs", directory.name, time.perf_counter() - start)
