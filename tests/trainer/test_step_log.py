"""worker/step_log.py on a bare torch AdamW: what a log replays, what it leaves as it was, and what
it refuses (Megatron's distributed optimizer: test_step_replay_benchmark.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatron_trainer.worker.step_log import StepLog, replay


def _adamw(params: list[torch.nn.Parameter]) -> Any:
    # Shaped as a Megatron optimizer for ``inner_optimizers``: the torch optimizer as ``.optimizer``.
    return SimpleNamespace(optimizer=torch.optim.AdamW(params, lr=0.1, weight_decay=0.1))


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, generator=gen)), torch.nn.Parameter(torch.randn(3, 2, generator=gen))]


def _train(opt: Any, params: list[torch.nn.Parameter], steps: int) -> None:
    for step in range(steps):
        opt.optimizer.param_groups[0]["lr"] = 0.1 / (step + 1)  # as a scheduler sets it
        for p in params:
            p.grad = torch.randn_like(p)
        opt.optimizer.step()


def _logged_run(seed: int, steps: int) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter], Any, Any, StepLog]:
    """Parameters trained ``steps`` steps with the log on, a copy of them as they started, both
    optimizers, and the (closed) log."""
    live, copy = _params(seed), _params(seed)
    a, b = _adamw(live), _adamw(copy)
    log = StepLog(a)
    _train(a, live, steps)
    log.close()
    return live, copy, a, b, log


def test_a_logged_run_replays_bitwise_onto_a_copy_with_each_steps_learning_rate() -> None:
    live, copy, a, b, log = _logged_run(0, 3)
    b.optimizer.param_groups[0]["lr"] = 7.0
    replay(b, log.updates)
    assert all(torch.equal(x, y) for x, y in zip(live, copy, strict=True))
    moments = [
        (a.optimizer.state[x]["exp_avg_sq"], b.optimizer.state[y]["exp_avg_sq"])
        for x, y in zip(live, copy, strict=True)
    ]
    assert all(torch.equal(x, y) for x, y in moments)
    # The group's own learning rate is back, the gradients are gone.
    assert b.optimizer.param_groups[0]["lr"] == 7.0 and all(p.grad is None for p in copy)
    # Without the learning rates logged the replay would differ: the log carries them.
    assert [u.groups[0]["lr"] for u in log.updates] == [0.1, 0.05, 0.1 / 3]
    _train(a, live, 1)
    assert len(log.updates) == 3  # closed: nothing more logged


def test_a_parameter_left_out_of_a_replay_keeps_its_state() -> None:
    live, copy, _, b, log = _logged_run(1, 2)
    before = copy[1].detach().clone()
    replay(b, log.updates, only=lambda p: p is copy[0])
    assert torch.equal(copy[0], live[0]) and torch.equal(copy[1], before)
    replay(b, log.updates, only=lambda p: p is copy[1])  # the rest, from its own older copy
    assert torch.equal(copy[1], live[1])


def test_a_log_that_does_not_fit_the_optimizer_is_refused() -> None:
    live = _params(2)
    a = _adamw(live)
    log = StepLog(a)
    _train(a, live, 1)
    log.close()
    [update] = log.updates
    with pytest.raises(ValueError, match="2 gradients in 1 groups, the optimizer has 1 parameters"):
        replay(_adamw(_params(2)[:1]), [update])
    with pytest.raises(ValueError, match=r"a gradient of shape \(5,\) for \(4,\)"):
        replay(_adamw([torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3, 2))]), [update])
    with pytest.raises(ValueError, match="update 0 is for optimizer 1; there are 1"):
        replay(_adamw(_params(2)), [dataclasses.replace(update, optimizer=1)])
