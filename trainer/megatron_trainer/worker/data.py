"""Deterministic training data and exact sample accounting.

Sample ``i`` of the job is the same token sequence on every rank, in every epoch and whatever the
mesh: mock tokens are drawn from a generator seeded by ``(seed, i)``; with a data path, sample ``i``
is read from Megatron's indexed dataset. Which samples a replica consumes at a step comes from the
plan's :class:`~megatron_contract.mesh.BatchGeometry`, so the global batch ``step`` is always samples
``[step*G, (step+1)*G)``, split over whatever replicas exist in that epoch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from megatron_contract.mesh import BatchGeometry


class MockTokens:
    """Sample ``i`` is ``seq_length + 1`` tokens drawn from a generator seeded by ``(seed, i)``."""

    def __init__(self, seed: int, vocab_size: int, seq_length: int) -> None:
        self.seed, self.vocab_size, self.seq_length = seed, vocab_size, seq_length

    def sample(self, index: int) -> torch.Tensor:
        """Tokens of one sample (int64, ``seq_length + 1`` long)."""
        if index < 0:
            raise ValueError(f"sample index {index} is negative")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=gen)


class IndexedTokens:
    """Sample ``i`` is document ``i mod N`` of a Megatron indexed dataset, cut or repeated to length."""

    def __init__(self, path_prefix: str, seq_length: int) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.dataset = IndexedDataset(path_prefix)
        if len(self.dataset) == 0:
            raise ValueError(f"indexed dataset {path_prefix} holds no documents")
        self.seq_length = seq_length

    def sample(self, index: int) -> torch.Tensor:
        """Tokens of one sample (int64, ``seq_length + 1`` long)."""
        doc = torch.tensor(self.dataset[index % len(self.dataset)], dtype=torch.int64)  # a copy: the mmap is read-only
        if doc.numel() == 0:
            raise ValueError(f"document {index % len(self.dataset)} is empty")
        repeats = -(-(self.seq_length + 1) // doc.numel())
        return doc.repeat(repeats)[: self.seq_length + 1]


TokenSource = MockTokens | IndexedTokens


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: the global sample indices and their tokens/labels."""

    indices: tuple[int, ...]
    tokens: torch.Tensor  # [micro_batch, seq]
    labels: torch.Tensor  # [micro_batch, seq]


def replica_samples(batch: BatchGeometry, dp_rank: int, step: int) -> range:
    """Global sample indices replica ``dp_rank`` consumes at ``step`` (from the plan's geometry)."""
    if not 0 <= dp_rank < len(batch.micro_batches_per_replica):
        raise ValueError(f"dp rank {dp_rank} outside 0..{len(batch.micro_batches_per_replica) - 1}")
    return batch.sample_range(dp_rank, step)


def micro_batches(
    source: TokenSource, batch: BatchGeometry, dp_rank: int, step: int, device: torch.device
) -> Iterator[MicroBatch]:
    """The micro-batches of one replica at one step, in order."""
    samples = replica_samples(batch, dp_rank, step)
    mbs = batch.micro_batch_size
    for start in range(0, len(samples), mbs):
        indices = tuple(samples[start : start + mbs])
        stacked = torch.stack([source.sample(i) for i in indices])
        yield MicroBatch(
            indices=indices,
            tokens=stacked[:, :-1].contiguous().to(device, non_blocking=True),
            labels=stacked[:, 1:].contiguous().to(device, non_blocking=True),
        )
