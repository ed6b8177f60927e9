"""Host copies of the distributed optimizer's shards: this rank's own snapshot, and the copy it keeps
for its *ward* (the rank whose buddy it is, ``MeshPlan.buddy_of``; on another pod).

A refresh copies this rank's flat shards (worker/optimizer_shards.py) to host memory and exchanges
them point to point: this rank's snapshot to its buddy, its ward's into this rank's memory. It is
started after an optimizer step and finished later (the next step's compute runs meanwhile); only
a finished refresh counts as a complete copy. Two generations are kept, so while a refresh is in
flight the previous complete one is still whole: a failure then goes back to it (the plan says how
many steps are redone). The host memory this takes per pod is
``megatron_contract.host_memory.pod_copy_bytes``. Not yet wired into the training loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_contract.host_memory import BUDDY_GENERATIONS


@dataclasses.dataclass
class _Generation:
    step: int
    own: list[torch.Tensor]  # this rank's shards, flat, in host memory
    ward: list[torch.Tensor]  # the ward's
    complete: bool = False


class BuddyCopies:
    """This rank's generations of host copies, and the refresh in flight."""

    def __init__(self, rank: int, buddy: int, ward: int, generations: int = BUDDY_GENERATIONS) -> None:
        if rank in (buddy, ward):
            raise ValueError(f"rank {rank} cannot keep its own copy (buddy {buddy}, ward {ward})")
        if generations < 2:
            raise ValueError("two generations at least: the previous copy must survive a refresh in flight")
        self.rank, self.buddy, self.ward = rank, buddy, ward
        self._limit = generations
        self._generations: list[_Generation] = []  # oldest first
        self._requests: list[dist.Work] = []

    def start_refresh(self, step: int, shards: Sequence[torch.Tensor]) -> None:
        """Copy ``shards`` (this rank's, after ``step`` steps) to host memory and start exchanging:
        every rank of the world calls this for the same step (sends and receives pair up)."""
        if self._requests:
            raise RuntimeError(f"rank {self.rank}: a refresh is still in flight")
        if self._generations and step <= self._generations[-1].step:
            raise ValueError(f"refresh of step {step} after one of step {self._generations[-1].step}")
        reuse = self._generations.pop(0) if len(self._generations) >= self._limit else None
        pin = torch.cuda.is_available() and any(s.is_cuda for s in shards)
        own, ward = [], []
        for i, shard in enumerate(shards):
            if reuse is not None and reuse.own[i].shape == shard.shape:
                host_own, host_ward = reuse.own[i], reuse.ward[i]
            else:
                host_own = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=pin)
                host_ward = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=pin)
            host_own.copy_(shard, non_blocking=pin)
            own.append(host_own)
            ward.append(host_ward)
        if pin:
            torch.cuda.current_stream().synchronize()  # the snapshot is whole before it is sent
        self._generations.append(_Generation(step, own, ward))
        ops = [dist.P2POp(dist.isend, t, self.buddy, tag=i) for i, t in enumerate(own)]
        ops += [dist.P2POp(dist.irecv, t, self.ward, tag=i) for i, t in enumerate(ward)]
        self._requests = list(dist.batch_isend_irecv(ops))

    def finish_refresh(self) -> None:
        """Wait for the exchange in flight; its generation is then complete."""
        for request in self._requests:
            request.wait()
        self._requests = []
        if self._generations:
            self._generations[-1].complete = True

    def host_bytes(self) -> int:
        """Bytes of host memory the copies hold (every generation, own and ward's)."""
        return sum(t.numel() * t.element_size() for g in self._generations for t in (*g.own, *g.ward))

    @property
    def in_flight(self) -> bool:
        return bool(self._requests)

    def complete_steps(self) -> list[int]:
        """Steps of the complete copies this rank holds, newest first (what its agent reports)."""
        return [g.step for g in reversed(self._generations) if g.complete]

    def own(self, step: int) -> list[torch.Tensor]:
        """This rank's complete snapshot of ``step``."""
        return self._complete(step).own

    def ward_copy(self, step: int) -> list[torch.Tensor]:
        """The ward's complete copy of ``step``."""
        return self._complete(step).ward

    def _complete(self, step: int) -> _Generation:
        for g in self._generations:
            if g.step == step and g.complete:
                return g
        raise KeyError(f"rank {self.rank} holds no complete copy of step {step} (it has {self.complete_steps()})")


def ward_of(buddies: Sequence[int]) -> list[int]:
    """By rank, the rank whose buddy it is (the inverse of the buddy permutation)."""
    ward = [-1] * len(buddies)
    for rank, buddy in enumerate(buddies):
        if not 0 <= buddy < len(buddies) or ward[buddy] != -1:
            raise ValueError(f"the buddies are not a permutation of the ranks: {list(buddies)}")
        ward[buddy] = rank
    return ward
