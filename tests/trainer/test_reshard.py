"""Resharding the distributed optimizer's state between data-parallel sizes (worker/reshard.py), a
pure function checked against megatron-core's own layout.

- the layout is megatron-core's: parameters aligned to 64 elements, bucket ends padded to
  lcm(dp, 128), a shared embedding in a bucket of its own; the slice each dp rank owns is the one
  megatron-core's ``_build_model_gbuf_range`` gives it, parameter by parameter;
- property (hypothesis): for any parameter sizes, bucket size and old and new dp, moving the old
  shards' elements by the transfers rebuilds every new shard exactly: each parameter element
  received exactly once, from the old rank that owned it, into the new rank that owns it, padding
  untouched; no rank receives more than its own new shard, and its peak extra memory is at most
  one shard;
- layouts that cannot be resharded (a bucket not split evenly, other parameters) are refused.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_contract.host_memory import ADAM_BYTES_PER_ELEMENT
from megatron_trainer.worker.reshard import (
    BufferLayout,
    _SizedParam,
    reshard_cost,
    reshard_transfers,
)


def test_the_layout_is_megatron_cores() -> None:
    layout = BufferLayout.of_megatron([10, 100, 3], dp=3, bucket_size=None)
    # Backprop order: the last parameter first; starts aligned to 64; one bucket padded to lcm(3, 128).
    assert layout.params == ((192, 202), (64, 164), (0, 3))
    assert layout.buckets == ((0, 384),)
    assert layout.shard(1) == [(128, 256)] and layout.shard_numel == 128
    split = BufferLayout.of_megatron([10, 100, 3], dp=2, bucket_size=50, shared_embedding={0})
    assert len(split.buckets) == 2 and split.buckets[1][0] == split.buckets[0][1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 700), min_size=1, max_size=12), st.integers(1, 6), st.sampled_from([None, 200, 1000]))
def test_each_rank_owns_what_megatron_core_gives_it(numels: list[int], dp: int, bucket_size: int | None) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    params = [_SizedParam(n, False) for n in numels]
    config = SimpleNamespace(pad_buckets_for_high_nccl_busbw=False)
    megatron = DistributedOptimizer._compute_per_buffer_param_layout(params, bucket_size, dp, config)
    layout = BufferLayout.of_megatron(numels, dp, bucket_size)
    buckets = [
        SimpleNamespace(grad_data=SimpleNamespace(numel=lambda s=s, e=e: e - s), offset=s) for s, e in layout.buckets
    ]
    for rank in range(dp):
        buffer = SimpleNamespace(
            data_parallel_group=SimpleNamespace(rank=lambda rank=rank: rank, size=lambda: dp),
            num_optimizer_shards=dp,
            buckets=buckets,
            param_index_map=megatron.param_index_map,
        )
        owned = set()
        for index in range(len(buckets)):
            for param, ranges in DistributedOptimizer._build_model_gbuf_range(buffer, index)["param_map"].items():
                world = ranges["gbuf_world"]
                owned.add((params.index(param), world.start, world.end))
        ours = set()
        for i, (start, end) in enumerate(layout.params):
            for s, e in layout.shard(rank):
                if max(start, s) < min(end, e):
                    ours.add((i, max(start, s), min(end, e)))
        assert ours == owned


@settings(max_examples=300, deadline=None)
@given(
    numels=st.lists(st.integers(1, 3000), min_size=1, max_size=16),
    old_dp=st.integers(1, 8),
    new_dp=st.integers(1, 8),
    bucket_size=st.sampled_from([None, 500, 2000, 10_000]),
    shared=st.booleans(),
    stayed=st.integers(0, 8),
)
def test_transfers_rebuild_every_new_shard_exactly(
    numels: list[int], old_dp: int, new_dp: int, bucket_size: int | None, shared: bool, stayed: int
) -> None:
    embedding = {0} if shared else set()
    old = BufferLayout.of_megatron(numels, old_dp, bucket_size, embedding)
    new = BufferLayout.of_megatron(numels, new_dp, bucket_size, embedding)
    # Every parameter element gets a unique value; padding is -1 in the old buffer.
    old_buffer = np.full(old.buckets[-1][1], -1, dtype=np.int64)
    new_expected = np.full(new.buckets[-1][1], -2, dtype=np.int64)
    first = 0
    for (os_, oe), (ns, ne) in zip(old.params, new.params, strict=True):
        old_buffer[os_:oe] = np.arange(first, first + oe - os_)
        new_expected[ns:ne] = np.arange(first, first + ne - ns)
        first += oe - os_
    old_shards = [_mask(old, r) for r in range(old_dp)]
    new_shards = [_mask(new, r) for r in range(new_dp)]

    transfers = reshard_transfers(old, new)
    rebuilt = np.full_like(new_expected, -2)
    received = np.zeros_like(new_expected)
    for t in transfers:
        assert t.numel > 0
        source = slice(t.source_start, t.source_start + t.numel)
        dest = slice(t.dest_start, t.dest_start + t.numel)
        assert old_shards[t.source][source].all(), "a range is taken from a rank that did not own it"
        assert new_shards[t.dest][dest].all(), "a range is sent to a rank that does not own it"
        assert (old_buffer[source] >= 0).all(), "padding is sent"
        rebuilt[dest] = old_buffer[source]
        received[dest] += 1
    assert np.array_equal(rebuilt, new_expected)  # every element where it belongs, padding untouched
    is_param = new_expected >= 0
    assert (received[is_param] == 1).all() and (received[~is_param] == 0).all()

    # The processes that stayed keep their old dp rank when the new mesh has it.
    same = {r: r for r in range(min(stayed, old_dp, new_dp))}
    cost = reshard_cost(transfers, old, new, same)
    shard_bytes = new.shard_numel * ADAM_BYTES_PER_ELEMENT
    for rank in range(new_dp):
        param_bytes = int(is_param[new_shards[rank]].sum()) * ADAM_BYTES_PER_ELEMENT
        assert cost.received[rank] + cost.kept_local[rank] == param_bytes <= shard_bytes
        assert cost.peak_extra[rank] <= shard_bytes
        if rank not in same.values():
            assert cost.kept_local[rank] == 0 and cost.peak_extra[rank] == 0


def _mask(layout: BufferLayout, rank: int) -> np.ndarray:
    mask = np.zeros(layout.buckets[-1][1], dtype=bool)
    for s, e in layout.shard(rank):
        mask[s:e] = True
    return mask


def test_layouts_that_cannot_be_resharded_are_refused() -> None:
    with pytest.raises(ValueError, match="equal shards"):
        BufferLayout(dp=3, params=((0, 10),), buckets=((0, 128),))
    with pytest.raises(ValueError, match="parameters"):
        reshard_transfers(BufferLayout.of_megatron([5, 5], 2, None), BufferLayout.of_megatron([5], 2, None))
    with pytest.raises(ValueError, match="elements"):
        reshard_transfers(BufferLayout.of_megatron([5], 2, None), BufferLayout.of_megatron([6], 2, None))
    with pytest.raises(ValueError, match="dp rank"):
        BufferLayout.of_megatron([5], 2, None).shard(2)
