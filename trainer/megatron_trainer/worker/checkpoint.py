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
from typing import Any

import torch
import torch.distributed as dist

from megatron_trainer.worker.model import TrainState, inner_optimizers, set_scheduler_steps

log = logging.getLogger(__name__)
DONE_MARKER = "done"


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """Directory of the checkpoint taken after ``step`` completed steps."""
    return Path(root) / f"step-{step:09d}"


def newest_complete(root: str | Path) -> int | None:
    """Step of the newest complete checkpoint under ``root``, or None."""
    steps = [int(p.name.split("-")[1]) for p in Path(root).glob("step-*") if (p / DONE_MARKER).exists()]
    return max(steps, default=None)


# Distributed-optimizer state saved in model space, so that it loads under any data-parallel size.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded_state_dict(ts: TrainState, is_loading: bool = False) -> dict[str, object]:
    # The model inside DDP: DDP's own sharded_state_dict prefixes every key with "module.", which
    # its load_state_dict (delegating to the inner module) then does not recognise.
    model_sd = ts.model.module.sharded_state_dict()
    optimizer_sd = ts.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_OPTIMIZER_METADATA)
    # The scheduler's state is a plain dict: dist_checkpointing saves it once, in the common part.
    return {"model": model_sd, "optimizer": optimizer_sd, "opt_param_scheduler": ts.scheduler.state_dict()}


def save_checkpoint(ts: TrainState, root: str | Path) -> Path:
    """Save model and optimizer after ``ts.step`` steps (collective); returns the directory."""
    from megatron.core import dist_checkpointing

    start = time.perf_counter()
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
    DistributedOptimizer._set_main_param_and_optimizer_states = patched  # type: ignore[method-assign]


def _unshare_adam_steps(ts: TrainState) -> None:
    """The DistributedOptimizer's loader gives every parameter's state one shared ``step`` tensor
    (built once from the param groups); torch's Adam increments ``step`` in place per parameter,
    so a shared one would advance once per parameter per step. Each gets its own copy."""
    for opt in inner_optimizers(ts.optimizer):
        for state in opt.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def load_checkpoint(ts: TrainState, root: str | Path, step: int) -> None:
    """Load the complete checkpoint of ``step`` into ``ts`` (collective)."""
    from megatron.core import dist_checkpointing

    if ts.spec.training.optimizer.distributed:
        _tolerate_adam_step_state()

    source = checkpoint_dir(root, step)
    if not (source / DONE_MARKER).exists():
        raise FileNotFoundError(f"no complete checkpoint of step {step} under {root}")
    loaded = dist_checkpointing.load(_sharded_state_dict(ts, is_loading=True), str(source))
    ts.model.load_state_dict(loaded["model"])
    ts.optimizer.load_state_dict(loaded["optimizer"])
    _unshare_adam_steps(ts)
    ts.step = step
    set_scheduler_steps(ts, int(loaded["opt_param_scheduler"]["num_steps"]))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
