"""The inputs of this rank's optimizer updates, logged, and replayed onto an older copy of its shard.

An Adam update of a shard needs the shard's state (main parameters and moments, 12 bytes a
parameter) and, beyond it, only the step's gradients of the shard (4 bytes a parameter, fp32, after
clipping) and the hyperparameters of each parameter group (learning rate and weight decay as the
scheduler set them, betas, eps). So a copy of a shard from step ``s`` plus the logged inputs of
steps ``s+1 .. t`` give the shard at step ``t``, with the same optimizer and kernels: bitwise.
This is what a buddy copy refreshed with a third of the bytes would carry each step (the
gradients; the whole state only now and then); the buddy copies do not use it yet, and
benchmarks/step_replay.py measures it on the GPUs (whether the replay is bitwise and what it costs).

The log is taken where the update consumes its inputs: a step pre-hook on each torch optimizer
inside Megatron's (``register_step_pre_hook``). Megatron calls it in ``step_with_ready_grads``,
after the gradients were copied to the main parameters, unscaled and clipped, and after the worker's
commit guard (worker/step.py): an update refused there is not logged. Each torch optimizer's step
is one :class:`LoggedUpdate`; a chained optimizer's steps are logged in the order they ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_trainer.worker.model import inner_optimizers


@dataclasses.dataclass(frozen=True)
class LoggedUpdate:
    """One torch optimizer's step: the gradient of each of its parameters (``None`` where it had
    none, and the update skipped it) in the order of its parameter groups, and each group's
    hyperparameters (everything but ``params``)."""

    optimizer: int  # index in ``inner_optimizers``
    grads: tuple[torch.Tensor | None, ...]
    groups: tuple[dict[str, Any], ...]

    @property
    def nbytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grads if g is not None)


class StepLog:
    """Logs every update of ``optimizer``'s torch optimizers from now until :meth:`close`.

    Gradients are copied into ``device`` memory (host memory by default, pinned where CUDA is
    there), on the stream of the update, so a copy is ordered before the next step overwrites the
    gradient buffer; read a logged gradient on the host only after that stream is synchronized
    (:func:`replay` copies them back on the same stream, which orders itself).
    """

    def __init__(self, optimizer: Any, device: torch.device | str = "cpu") -> None:
        self.updates: list[LoggedUpdate] = []
        self._device = torch.device(device)
        self._handles = [
            opt.register_step_pre_hook(self._hook(index)) for index, opt in enumerate(inner_optimizers(optimizer))
        ]

    def _hook(self, index: int) -> Callable[[Any, Any, Any], None]:
        def record(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
            grads = tuple(self._copy(p.grad) for group in opt.param_groups for p in group["params"])
            groups = tuple({k: v for k, v in group.items() if k != "params"} for group in opt.param_groups)
            self.updates.append(LoggedUpdate(index, grads, groups))

        return record

    def _copy(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        if grad is None:
            return None
        pin = self._device.type == "cpu" and grad.is_cuda
        out = torch.empty(grad.shape, dtype=grad.dtype, device=self._device, pin_memory=pin)
        return out.copy_(grad.detach(), non_blocking=pin)

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.updates)

    def close(self) -> None:
        """Stop logging (the updates logged so far stay)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


@torch.no_grad()
def replay(
    optimizer: Any,
    updates: Sequence[LoggedUpdate],
    only: Callable[[torch.Tensor], bool] = lambda param: True,
) -> None:
    """Apply ``updates`` to ``optimizer``'s current state, in order, as the logged steps did: each
    torch optimizer's parameters get the logged gradients (those that ``only`` refuses get none, so
    the update leaves them as they are: a part of the shard can be brought forward from a copy of
    another step than the rest), its groups the logged hyperparameters, and it steps. The groups'
    hyperparameters are put back afterwards and the gradients dropped. The model's own parameters
    are not touched: Megatron copies the main parameters into them (and all-gathers them) at its
    next step, or the caller does. A :class:`StepLog` open on ``optimizer`` would log the replayed
    updates too: close it first.

    Raises:
        ValueError: an update does not fit the optimizer (another model, parallelism or grouping).
    """
    opts = inner_optimizers(optimizer)
    for number, update in enumerate(updates):
        if not 0 <= update.optimizer < len(opts):
            raise ValueError(f"update {number} is for optimizer {update.optimizer}; there are {len(opts)}")
        opt = opts[update.optimizer]
        params = [p for group in opt.param_groups for p in group["params"]]
        if len(update.grads) != len(params) or len(update.groups) != len(opt.param_groups):
            raise ValueError(
                f"update {number}: {len(update.grads)} gradients in {len(update.groups)} groups, the optimizer "
                f"has {len(params)} parameters in {len(opt.param_groups)} groups"
            )
        kept = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
        try:
            for param, grad in zip(params, update.grads, strict=True):
                if grad is not None and grad.shape != param.shape:
                    raise ValueError(
                        f"update {number}: a gradient of shape {tuple(grad.shape)} for {tuple(param.shape)}"
                    )
                use = grad is not None and only(param)
                param.grad = grad.to(param.device, non_blocking=True) if use else None  # type: ignore[union-attr]
            for group, logged in zip(opt.param_groups, update.groups, strict=True):
                group.update(logged)
            opt.step()
        finally:
            for group, values in zip(opt.param_groups, kept, strict=True):
                group.update(values)
            for param in params:
                param.grad = None
