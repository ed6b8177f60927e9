"""Moving distributed-optimizer shards between processes, point to point, as a reshard's transfers
(worker/reshard.py) say: each process sends the ranges it holds (its own old shard, or the host
copies it keeps for its buddies) and receives into its new shard exactly the ranges it now owns.
No process gathers more than its own shard, and nothing goes through storage.

A shard is held flat, one row per element of the shard (its bucket slices one after the other) and
one column per state tensor (fp32 main parameter, Adam's two moments); in memory its columns lie one
after the other (worker/optimizer_shards.py), so a range of elements is one contiguous piece of each
column: sent and received column by column, as is, without a copy. The new shard is laid out the
same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_trainer.worker.optimizer_shards import rows_of
from megatron_trainer.worker.reshard import BufferLayout, Transfer


def exchange_shards(
    transfers: Sequence[Transfer],
    old: BufferLayout,
    new: BufferLayout,
    held: Mapping[int, torch.Tensor],
    holder_of_old: Sequence[int],
    process_of_new: Sequence[int],
    me: int,
    *,
    columns: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> torch.Tensor | None:
    """This process's new shard, ``(new.shard_numel, columns)`` with its columns apart in memory
    (None when it owns none), its padding rows zero. A held shard laid out otherwise is sent
    column by column too, each column of a range copied first.

    Args:
        transfers: ``reshard_transfers(old, new)``.
        held: by old dp rank, the old shards this process holds, ``(old.shard_numel, columns)``.
        holder_of_old: by old dp rank, the (global) rank of the process holding that old shard.
        process_of_new: by new dp rank, the (global) rank of its process.
        me: this process's global rank.

    Raises:
        ValueError: a shard this process should hold is missing or has the wrong shape.
    """
    if len(holder_of_old) != old.dp or len(process_of_new) != new.dp:
        raise ValueError(f"holders for {len(holder_of_old)} old and {len(process_of_new)} new dp ranks")
    for rank, holder in enumerate(holder_of_old):
        if holder == me:
            shard = held.get(rank)
            if shard is None or tuple(shard.shape) != (old.shard_numel, columns):
                raise ValueError(f"old shard {rank} is to come from this process, which holds none of that shape")
    mine = [r for r, p in enumerate(process_of_new) if p == me]
    if len(mine) > 1:
        raise ValueError(f"process {me} is given new dp ranks {mine}")
    result = rows_of(torch.zeros(columns, new.shard_numel, dtype=dtype, device=device)) if mine else None
    ops: list[dist.P2POp] = []
    for tag, t in enumerate(transfers):
        source, dest = holder_of_old[t.source], process_of_new[t.dest]
        if me not in (source, dest):
            continue
        rows = old.local_offset(t.source, t.source_start)
        into = new.local_offset(t.dest, t.dest_start)
        if source == dest:
            assert result is not None
            result[into : into + t.numel] = held[t.source][rows : rows + t.numel]
        elif source == me:
            block = held[t.source][rows : rows + t.numel]
            for c in range(columns):
                ops.append(dist.P2POp(dist.isend, block[:, c].contiguous(), dest, tag=tag * columns + c))
        else:
            assert result is not None
            for c in range(columns):
                ops.append(dist.P2POp(dist.irecv, result[into : into + t.numel, c], source, tag=tag * columns + c))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return result
