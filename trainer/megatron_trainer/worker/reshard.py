"""Resharding the distributed optimizer's state to another data-parallel size: which ranges move.

Megatron's distributed optimizer lays each buffer's parameters out in backprop order, every start
aligned to 64 elements, in buckets of about ``bucket_size`` elements whose ends are padded to a
multiple of lcm(dp, 128) (``DistributedOptimizer._compute_per_buffer_param_layout``); dp rank ``r``
owns the ``r``-th of ``dp`` equal slices of every bucket (``_build_model_gbuf_range``). The padding
depends on ``dp``, so a parameter's offset in the buffer moves with it: ranges are matched through
the parameters' elements, never through buffer offsets. Padding is owned but holds nothing, and
receives nothing.

Each new rank receives exactly the elements it now owns, from the old rank that owned them (or the
host copy of that old shard, which the plan names): no rank gathers more than its own new shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from megatron_contract.host_memory import ADAM_BYTES_PER_ELEMENT


@dataclasses.dataclass(frozen=True)
class BufferLayout:
    """One buffer of a model chunk laid out for a data-parallel size."""

    dp: int
    params: tuple[tuple[int, int], ...]  # [start, end) of each parameter in the buffer, by parameter
    buckets: tuple[tuple[int, int], ...]  # [start, end) of each bucket, padding included

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise ValueError(f"dp must be at least 1, not {self.dp}")
        for start, end in self.buckets:
            if (end - start) % self.dp:
                raise ValueError(f"bucket [{start}, {end}) does not split into {self.dp} equal shards")

    @classmethod
    def of_megatron(
        cls,
        numels: Sequence[int],
        dp: int,
        bucket_size: int | None,
        shared_embedding: Collection[int] = (),
        pad_for_high_nccl_busbw: bool = False,
    ) -> BufferLayout:
        """The layout megatron-core computes for parameters of these sizes (in model order, as
        DDP passes them; ``shared_embedding``: indices of parameters that get a bucket of their own)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        params = [_SizedParam(n, i in shared_embedding) for i, n in enumerate(numels)]
        config = SimpleNamespace(pad_buckets_for_high_nccl_busbw=pad_for_high_nccl_busbw)
        layout = DistributedOptimizer._compute_per_buffer_param_layout(params, bucket_size, dp, config)
        spans = tuple((layout.param_index_map[p][0], layout.param_index_map[p][1]) for p in params)
        return cls(dp=dp, params=spans, buckets=tuple(layout.bucket_indices))

    @classmethod
    def of_buffer(cls, buffer: Any) -> BufferLayout:
        """The layout of a live megatron-core ``_ParamAndGradBuffer`` (parameters in its order)."""
        spans = tuple((buffer.param_index_map[p][0], buffer.param_index_map[p][1]) for p in buffer.params)
        return cls(dp=buffer.data_parallel_world_size, params=spans, buckets=tuple(buffer.bucket_indices))

    @classmethod
    def of_buffer_for_dp(cls, buffer: Any, dp: int, bucket_size: int | None) -> BufferLayout:
        """The layout the same parameters had (or will have) at another data-parallel size: the old
        layout a new build's shards come from."""
        params = buffer.params
        return cls.of_megatron(
            [p.numel() for p in params],
            dp,
            bucket_size,
            {i for i, p in enumerate(params) if getattr(p, "shared_embedding", False)},
            buffer.ddp_config.pad_buckets_for_high_nccl_busbw,
        )

    def shard(self, dp_rank: int) -> list[tuple[int, int]]:
        """The buffer ranges ``dp_rank`` owns: its slice of every bucket."""
        if not 0 <= dp_rank < self.dp:
            raise ValueError(f"dp rank {dp_rank} outside 0..{self.dp - 1}")
        return [(s + dp_rank * (e - s) // self.dp, s + (dp_rank + 1) * (e - s) // self.dp) for s, e in self.buckets]

    @property
    def shard_numel(self) -> int:
        """Elements each rank owns (equal for all: buckets split evenly)."""
        return sum(e - s for s, e in self.buckets) // self.dp

    def local_offset(self, dp_rank: int, offset: int) -> int:
        """Where the buffer element at ``offset`` (owned by ``dp_rank``) lies in that rank's shard held
        flat: its bucket slices one after the other."""
        before = 0
        for start, end in self.shard(dp_rank):
            if start <= offset < end:
                return before + offset - start
            before += end - start
        raise ValueError(f"offset {offset} is not in dp rank {dp_rank}'s shard")

    def owner(self, offset: int) -> tuple[int, int]:
        """(dp rank owning the buffer element at ``offset``, end of that rank's slice)."""
        for start, end in self.buckets:
            if start <= offset < end:
                size = (end - start) // self.dp
                rank = (offset - start) // size
                return rank, start + (rank + 1) * size
        raise ValueError(f"offset {offset} is in no bucket")


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Elements ``[source_start, source_start + numel)`` of the old buffer, owned by old dp rank
    ``source``, become elements ``[dest_start, dest_start + numel)`` of the new buffer, owned by new
    dp rank ``dest``."""

    source: int
    source_start: int
    dest: int
    dest_start: int
    numel: int


def reshard_transfers(old: BufferLayout, new: BufferLayout) -> list[Transfer]:
    """Every range that moves from the old layout to the new one, parameter by parameter; adjacent
    ranges between the same two ranks that are contiguous on both sides are merged."""
    if len(old.params) != len(new.params):
        raise ValueError(f"the layouts hold {len(old.params)} and {len(new.params)} parameters")
    transfers: list[Transfer] = []
    for index, ((old_start, old_end), (new_start, new_end)) in enumerate(zip(old.params, new.params, strict=True)):
        numel = old_end - old_start
        if new_end - new_start != numel:
            raise ValueError(f"parameter {index} has {numel} elements before, {new_end - new_start} after")
        done = 0
        while done < numel:
            source, source_end = old.owner(old_start + done)
            dest, dest_end = new.owner(new_start + done)
            count = min(source_end - (old_start + done), dest_end - (new_start + done), numel - done)
            _append(transfers, Transfer(source, old_start + done, dest, new_start + done, count))
            done += count
    return transfers


def _append(transfers: list[Transfer], t: Transfer) -> None:
    last = transfers[-1] if transfers else None
    if (
        last is not None
        and (last.source, last.dest) == (t.source, t.dest)
        and last.source_start + last.numel == t.source_start
        and last.dest_start + last.numel == t.dest_start
    ):
        transfers[-1] = dataclasses.replace(last, numel=last.numel + t.numel)
    else:
        transfers.append(t)


@dataclasses.dataclass(frozen=True)
class ReshardCost:
    """What a reshard moves and holds, in bytes, by new dp rank."""

    received: dict[int, int]  # from another process (a local copy is not counted)
    kept_local: dict[int, int]  # already held by the same process (its old shard)
    peak_extra: dict[int, int]  # above the larger of its old and new shard while both exist


def reshard_cost(
    transfers: Sequence[Transfer],
    old: BufferLayout,
    new: BufferLayout,
    same_process: Mapping[int, int],
    bytes_per_element: int = ADAM_BYTES_PER_ELEMENT,
) -> ReshardCost:
    """Bytes each new rank receives and keeps; ``same_process`` maps an old dp rank to the new dp
    rank of the same process (ranks that stayed). A rank builds its new shard beside its old one,
    freed once sent, so at its peak it holds both: the smaller of the two above its steady footprint,
    never more than one shard."""
    received = {r: 0 for r in range(new.dp)}
    local = {r: 0 for r in range(new.dp)}
    for t in transfers:
        into = local if same_process.get(t.source) == t.dest else received
        into[t.dest] += t.numel * bytes_per_element
    held_old = {same_process[o]: old.shard_numel * bytes_per_element for o in same_process}
    new_bytes = new.shard_numel * bytes_per_element
    peak = {r: min(held_old.get(r, 0), new_bytes) for r in range(new.dp)}
    return ReshardCost(received=received, kept_local=local, peak_extra=peak)


class _SizedParam:
    """What megatron-core's layout function reads of a parameter: its size, and whether it is a
    shared embedding (which gets a bucket of its own)."""

    def __init__(self, numel: int, shared_embedding: bool) -> None:
        self.data = SimpleNamespace(nelement=lambda: numel)
        self.shared_embedding = shared_embedding
