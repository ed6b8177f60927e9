"""Distributed checkpoints with Megatron's ``dist_checkpointing``: the fallback when no DP peer
holds a rank's state. Save and load are collective over the epoch's world; a checkpoint is
complete once its ``done`` marker exists, so a save cut short by a failure is never loaded.
Checkpoints reshard: one saved under TP2xDP2 loads under TP2xDP1 (shared/FACTS.md).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_trainer.worker import writer_processes
from megatron_trainer.worker.model import TrainState

log = logging.getLogger(__name__)
DONE_MARKER = "done"


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """Directory of the checkpoint taken after ``step`` completed steps."""
    return Path(root) / f"step-{step:09d}"


def newest_complete(root: str | Path) -> int | None:
    """Step of the newest complete checkpoint under ``root``, or None."""
    steps = [int(p.name.split("-")[1]) for p in Path(root).glob("step-*") if (p / DONE_MARKER).exists()]
    return max(steps, default=None)


def _sharded_state_dict(ts: TrainState) -> dict[str, object]:
    # The model inside DDP: DDP's own sharded_state_dict prefixes every key with "module.", which
    # its load_state_dict (delegating to the inner module) then does not recognise.
    model_sd = ts.model.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": ts.optimizer.sharded_state_dict(model_sd)}


def save_checkpoint(ts: TrainState, root: str | Path) -> Path:
    """Save model and optimizer after ``ts.step`` steps (collective); returns the directory."""
    from megatron.core import dist_checkpointing

    start = time.perf_counter()
    writer_processes.install_results_queue()  # its manager dies with this process
    target = checkpoint_dir(root, ts.step)
    if dist.get_rank() == 0:
        if target.exists():
            shutil.rmtree(target)  # an incomplete earlier attempt at the same step
        target.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(ts), str(target))
    dist.barrier()
    if dist.get_rank() == 0:
        (target / DONE_MARKER).write_text(str(ts.step))
    dist.barrier()  # every rank returns only once the checkpoint is complete, so any may report it
    log.info("checkpoint of step %d saved to %s in %.2fs", ts.step, target, time.perf_counter() - start)
    return target


def load_checkpoint(ts: TrainState, root: str | Path, step: int) -> None:
    """Load the complete checkpoint of ``step`` into ``ts`` (collective)."""
    from megatron.core import dist_checkpointing

    source = checkpoint_dir(root, step)
    if not (source / DONE_MARKER).exists():
        raise FileNotFoundError(f"no complete checkpoint of step {step} under {root}")
    loaded = dist_checkpointing.load(_sharded_state_dict(ts), str(source))
    ts.model.load_state_dict(loaded["model"])
    ts.optimizer.load_state_dict(loaded["optimizer"])
    ts.step = step
    if torch.cuda.is_available():
        torch.cuda.synchronize()
