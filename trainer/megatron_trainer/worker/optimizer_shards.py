"""A Megatron distributed optimizer's shard held flat, and back: what a buddy copy and a reshard move.

For each of the optimizer's buffers, one tensor of ``(shard elements, 1 + state tensors)`` rows:
row ``i`` is element ``i`` of this rank's shard (its slice of every bucket, one after the other,
as ``BufferLayout.local_offset`` counts), column 0 its fp32 main parameter, then Adam's
``exp_avg`` and ``exp_avg_sq``. Rows of bucket padding hold zeros. Adam's ``step`` count is not
in it: every rank has the same, set from the step training resumes at. megatron-core's own
``_get_main_param_and_optimizer_states`` / ``_set_main_param_and_optimizer_states`` give and take
the tensors of each parameter's piece (``gbuf_local``: its range in this rank's slice), so nothing
here depends on how the optimizer stores them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_trainer.worker.reshard import BufferLayout

#: The columns after the main parameter, in order.
STATE_KEYS = ("exp_avg", "exp_avg_sq")


def distributed_optimizers(optimizer: Any) -> list[Any]:
    """The DistributedOptimizers inside Megatron's (possibly chained) optimizer, in order."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    found = [o for o in chained if hasattr(o, "gbuf_ranges")]
    if not found:
        raise ValueError("the optimizer is not Megatron's distributed optimizer")
    return found


def buffer_layouts(optimizer: Any) -> list[BufferLayout]:
    """The layout of every buffer of every distributed optimizer, in the order of :func:`flat_shards`."""
    return [BufferLayout.of_buffer(b) for o in distributed_optimizers(optimizer) for b in o.buffers]


@dataclasses.dataclass(frozen=True)
class ShardPieces:
    """Where one buffer's flat shard lies in an optimizer's own tensors, without copying them: what
    a worker keeps of the state it held in its last epoch, to give its shard to a reshard later."""

    rows: int  # shard elements
    pieces: tuple[tuple[int, tuple[torch.Tensor, ...]], ...]  # (first row, [main param, *states] flat)


def shard_pieces(optimizer: Any) -> list[ShardPieces]:
    """This rank's shard of every buffer, as references to the optimizer's tensors."""
    out = []
    for opt in distributed_optimizers(optimizer):
        for buffer, ranges in zip(opt.buffers, opt.gbuf_ranges, strict=True):
            layout = BufferLayout.of_buffer(buffer)
            pieces = []
            for _, buckets in ranges.items():
                for first, param, piece in _pieces(layout, buckets):
                    tensors = opt._get_main_param_and_optimizer_states(param)
                    columns = (tensors["param"], *(tensors[k] for k in STATE_KEYS))
                    pieces.append((first + piece.start, tuple(t.detach().reshape(-1) for t in columns)))
            out.append(ShardPieces(layout.shard_numel, tuple(pieces)))
    return out


def materialize(shards: list[ShardPieces]) -> list[torch.Tensor]:
    """The flat shards (copies) of pieces from :func:`shard_pieces`; padding rows zero."""
    out = []
    for shard in shards:
        device = shard.pieces[0][1][0].device if shard.pieces else None
        rows = torch.zeros(shard.rows, 1 + len(STATE_KEYS), dtype=torch.float32, device=device)
        for first, columns in shard.pieces:
            for c, t in enumerate(columns):
                rows[first : first + t.numel(), c] = t
        out.append(rows)
    return out


def flat_shards(optimizer: Any) -> list[torch.Tensor]:
    """This rank's shard of every buffer, flat (a copy)."""
    return materialize(shard_pieces(optimizer))


@torch.no_grad()  # main parameters of fp32 models are views of the model's parameters (leaves)
def load_flat_shards(optimizer: Any, shards: list[torch.Tensor], step: int | None = None) -> None:
    """Set this rank's optimizer state from flat shards (as :func:`flat_shards` gives them) of its
    own layout, and Adam's step count to ``step`` (None: left as it is); the model's parameters
    follow from the main parameters at the next all-gather."""
    layouts = buffer_layouts(optimizer)
    if len(shards) != len(layouts):
        raise ValueError(f"{len(shards)} flat shards for {len(layouts)} buffers")
    index = 0
    for opt in distributed_optimizers(optimizer):
        for ranges in opt.gbuf_ranges:
            layout, rows = layouts[index], shards[index]
            if rows.shape[0] != layout.shard_numel:
                raise ValueError(f"buffer {index}: {rows.shape[0]} rows, the shard has {layout.shard_numel} elements")
            for _, buckets in ranges.items():
                for first, param, piece in _pieces(layout, buckets):
                    current = opt._get_main_param_and_optimizer_states(param)
                    block = rows[first + piece.start : first + piece.end]
                    tensors = {"param": block[:, 0]} | {k: block[:, 1 + i] for i, k in enumerate(STATE_KEYS)}
                    moved = {k: v.reshape(current[k].shape).to(current[k].dtype) for k, v in tensors.items()}
                    if step is not None and isinstance(current.get("step"), torch.Tensor):
                        current["step"].fill_(step)  # one optimizer step per training step
                    opt._set_main_param_and_optimizer_states(param, current | moved)
            index += 1


def _pieces(layout: BufferLayout, buckets: list[dict[str, Any]]) -> list[tuple[int, Any, Any]]:
    """(first row of the bucket's slice, model parameter, its ``gbuf_local`` range) of every piece."""
    out = []
    first = 0
    for bucket, (start, end) in zip(buckets, layout.buckets, strict=True):
        for param, ranges in bucket["param_map"].items():
            out.append((first, param, ranges["gbuf_local"]))
        first += (end - start) // layout.dp
    return out
