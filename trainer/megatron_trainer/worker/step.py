"""One training step: Megatron's forward-backward schedule over this replica's micro-batches, the
global loss, and Megatron's optimizer step, committed only if nothing aborted the epoch.

A step is all-or-nothing for a rank: every collective of the step (TP, DP gradient all-reduce,
loss all-reduce, grad-norm all-reduce) runs before the optimizer's local update, and the update is
guarded by :class:`StepAborted`, so an aborted step leaves parameters and optimizer state untouched.
The distributed optimizer's update ends with the parameters' all-gather; a step that fails there
leaves the rank's state *torn* (of no step), and its shard comes back from its host snapshot.

On GPU the host waits for the step's collectives by polling an event (:func:`wait_for_stream`), not
with a blocking synchronize: when the epoch is aborted the main thread gives the step up at once and
aborts the communicators itself, before it would launch anything more on them
(worker/progress_watch.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_contract.mesh import BatchGeometry
from megatron_trainer.worker.data import TokenSource, micro_batches
from megatron_trainer.worker.model import TrainState, seed_dropout
from megatron_trainer.worker.rendezvous import replica_group


class StepAborted(RuntimeError):
    """The epoch was aborted while the step ran; the step is discarded."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a completed step reports."""

    loss: float  # mean per-token loss over the global batch
    samples: tuple[int, ...]  # global sample indices this replica consumed
    seconds: float
    tokens: int  # tokens of the global batch


class UpdateRefused(StepAborted):
    """The epoch was aborted after every collective of the step, just before this rank's optimizer
    update. Its data-parallel peers may have committed the step, this rank's gradients included:
    ``trained`` (set by :func:`train_step`) is what this rank contributed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.trained: StepResult | None = None


@dataclasses.dataclass(frozen=True)
class RefusedStep:
    """A step this rank trained up to its update and then discarded (:class:`UpdateRefused`), as
    the epoch it ran in numbered it."""

    epoch: int
    rank: int
    dp_rank: int
    step: int
    trained: StepResult


def wait_for_stream(device: torch.device, aborted: Callable[[], bool]) -> None:
    """Wait for the work queued on this thread's stream; raise :class:`StepAborted` as soon as the
    epoch is aborted. No-op on CPU, where collectives block the host themselves."""
    if device.type != "cuda":
        return
    done = torch.cuda.Event()
    done.record()
    while not done.query():
        if aborted():
            raise StepAborted("epoch aborted while the step's collectives were in flight")
        time.sleep(0.0001)


def guard_commit(
    ts: TrainState,
    aborted: Callable[[], bool],
    device: torch.device,
    update_hook: Callable[[int], None] = lambda step: None,
) -> Callable[[], None]:
    """Make the optimizer's local update refuse to run once the epoch is aborted; returns what
    removes the guard again.

    Megatron's ``step()`` runs its collectives (grad norm) and then ``step_with_ready_grads()``,
    the local update; checking just before it makes the commit point explicit. With the
    distributed optimizer the update ends with one more collective, the parameters' all-gather: a
    peer that dies before joining it fails it after this rank's shard was written. Such a state is
    of no step (``ts.torn``, kept in its HeldState): a restore takes this rank's shard from its host
    snapshot instead (worker/shard_restore.py). ``update_hook`` is called with the step in progress
    once its collectives are done, just before the check (fault injection point).
    """
    inner = ts.optimizer.step_with_ready_grads

    def guarded() -> Any:
        wait_for_stream(device, aborted)  # the step's collectives have really finished (or were aborted)
        update_hook(ts.step)
        if aborted():
            raise UpdateRefused("epoch aborted before the optimizer update")
        ts.torn = True
        done = inner()
        ts.torn = False
        return done

    ts.optimizer.step_with_ready_grads = guarded

    def unguard() -> None:
        ts.optimizer.step_with_ready_grads = inner

    return unguard


def train_step(
    ts: TrainState,
    source: TokenSource,
    batch: BatchGeometry,
    dp_rank: int,
    device: torch.device,
    mid_step_hook: Callable[[], None],
    commit: bool = True,
    aborted: Callable[[], bool] = lambda: False,
    data_hook: Callable[[], None] = lambda: None,
    data_read: Callable[[], None] = lambda: None,
) -> StepResult:
    """Run step ``ts.step``; on success ``ts.step`` is incremented.

    Args:
        ts: model, optimizer and the number of completed steps.
        source: the job's deterministic samples.
        batch: the epoch's batch geometry (which samples this replica takes).
        dp_rank: this rank's data-parallel rank.
        device: where tensors live.
        mid_step_hook: called after the first micro-batch's forward pass (fault injection point).
        commit: False discards the gradients and steps the optimizer on zeros (a spare's warm-up:
            kernels, cuBLAS handles and allocator pools are ready before promotion).
        aborted: whether the epoch was aborted; checked while waiting for the step's collectives.
        data_hook: called while the step's samples are read (fault injection point).
        data_read: called once every sample of the step is read, before the step's first collective
            (the watchdog times the data read apart from the rest of the step).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    start = time.perf_counter()
    data_hook()
    mbs = list(micro_batches(source, batch, dp_rank, ts.step, device))
    data_read()
    seq = mbs[0].tokens.shape[1]
    positions = torch.arange(seq, device=device).unsqueeze(0)
    fired = False

    def forward_step(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
        nonlocal fired
        if aborted():  # each micro-batch is a point where an aborted step can stop early
            raise StepAborted("epoch aborted during the forward passes")
        mb = next(data_iterator)
        seed_dropout(ts.spec, mb.indices[0])
        batch = {
            "tokens": mb.tokens,
            "labels": mb.labels,
            "position_ids": positions,
            "loss_mask": torch.ones_like(mb.labels, dtype=torch.float),
        }
        output, loss_func = ts.forward_step(iter([batch]), model)  # the job's (worker/providers.py)
        if not fired:
            fired = True
            mid_step_hook()
        return output, loss_func

    ts.model.zero_grad_buffer()
    ts.optimizer.zero_grad()
    reported = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mbs),
        model=[ts.model],
        num_microbatches=len(mbs),
        seq_length=seq,
        micro_batch_size=batch.micro_batch_size,
        forward_only=False,
    )
    if not commit:
        # The optimizer still runs once, on zeroed gradients: its kernels are loaded before the
        # first real step too (the state it changes is a spare's placeholder, replaced later).
        ts.model.zero_grad_buffer()
        ts.optimizer.step()
        return StepResult(loss=float("nan"), samples=(), seconds=time.perf_counter() - start, tokens=0)
    loss = _global_loss(reported, device, parallel_state, aborted)
    samples = tuple(i for mb in mbs for i in mb.indices)
    tokens = batch.global_batch_size * seq
    try:
        ok, _grad_norm, _ = ts.optimizer.step()
    except UpdateRefused as refused:
        refused.trained = StepResult(loss=loss, samples=samples, seconds=time.perf_counter() - start, tokens=tokens)
        raise
    if not ok:
        raise RuntimeError(f"optimizer skipped step {ts.step} (non-finite gradients)")
    ts.step += 1
    ts.scheduler.step(1)
    return StepResult(loss=loss, samples=samples, seconds=time.perf_counter() - start, tokens=tokens)


def _global_loss(
    reported: list[dict[str, torch.Tensor]], device: torch.device, parallel_state: Any, aborted: Callable[[], bool]
) -> float:
    """Mean per-token loss over the global batch: sum over micro-batches, then over replicas."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    if parallel_state.is_pipeline_last_stage():
        for r in reported:
            totals += r["lm loss"].to(device)
    dist.all_reduce(totals, group=replica_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(totals, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    # Gradient and loss reductions are queued; this is where the host would block on a dead peer.
    wait_for_stream(device, aborted)
    return float(totals[0].item() / totals[1].item())
