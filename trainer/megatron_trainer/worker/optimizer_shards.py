"""A Megatron distributed optimizer's shard held flat, and back: what a buddy copy and a reshard move.

For each of the optimizer's buffers, one tensor of ``(shard elements, 1 + state tensors)`` rows:
row ``i`` is element ``i`` of this rank's shard (its slice of every bucket, one after the other,
as ``BufferLayout.local_offset`` counts), column 0 its fp32 main parameter, then Adam's
``exp_avg`` and ``exp_avg_sq``. Rows of bucket padding hold zeros. In memory the columns lie one
after the other (the tensor is the transpose of a contiguous ``(columns, rows)`` one,
:func:`columns_of`): each piece's tensors are then copied as they are, contiguous into contiguous,
and a buddy copy moves the memory whole. Adam's ``step`` count is not
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

#: Columns of a flat shard: the main parameter, then the states.
COLUMNS = 1 + len(STATE_KEYS)


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

    def runs(self) -> list[_Run]:
        """The rows in runs of adjacent pieces and of padding (:func:`materialize`), found once: a
        1 B model's hundreds of pieces took the training thread ~5 ms to sort at every refresh."""
        found: list[_Run] | None = self.__dict__.get("_runs")
        if found is None:  # a frozen dataclass's own dict: no field, not compared
            found = self.__dict__["_runs"] = _runs(self)
        return found


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
    """The flat shards (copies) of pieces from :func:`shard_pieces`; padding rows zero.

    One concatenation per column of each run of adjacent pieces, straight into the column's memory:
    one pass over the state. Interleaving rows instead took a 1 B model's shard 0.03 s of GPU time
    with a strided copy per piece, 0.02 s gathered in windows and interleaved after, and the
    refresh's assembly competes with the step's kernels for the GPU."""
    out = []
    for shard in shards:
        device = shard.pieces[0][1][0].device if shard.pieces else None
        memory = torch.empty(COLUMNS, shard.rows, dtype=torch.float32, device=device)
        for run in shard.runs():
            for c in range(COLUMNS):
                target = memory[c, run.first : run.first + run.rows]
                if not run.parts:
                    target.zero_()
                else:  # cat casts nothing: a precision-aware optimizer's bf16 moments are cast first
                    torch.cat([p[c] if p[c].dtype == torch.float32 else p[c].float() for p in run.parts], out=target)
        out.append(rows_of(memory))
    return out


def columns_of(shard: torch.Tensor) -> torch.Tensor:
    """A flat shard's memory, ``(columns, rows)`` and contiguous: a view of a shard from
    :func:`materialize`, a copy of one laid out otherwise."""
    if shard.dim() != 2:
        raise ValueError(f"a flat shard has two dimensions (rows, columns), not {tuple(shard.shape)}")
    return shard.t().contiguous()


def rows_of(memory: torch.Tensor) -> torch.Tensor:
    """The flat shard whose memory is ``memory`` (:func:`columns_of`): a view."""
    return memory.t()


@dataclasses.dataclass
class _Run:
    """Adjacent rows: the columns of the pieces filling them, in order (none: padding)."""

    first: int
    rows: int
    parts: list[tuple[torch.Tensor, ...]]


def _runs(shard: ShardPieces) -> list[_Run]:
    """``shard``'s rows, all of them, in runs of adjacent pieces and of padding."""
    runs: list[_Run] = []

    def place(first: int, count: int, columns: tuple[torch.Tensor, ...] | None) -> None:
        if count <= 0:
            return
        if columns is not None and runs and runs[-1].parts:  # adjacent to the piece before
            runs[-1].parts.append(columns)
            runs[-1].rows += count
        else:
            runs.append(_Run(first, count, [columns] if columns is not None else []))

    row = 0
    for first, columns in sorted(shard.pieces, key=lambda p: p[0]):
        place(row, first - row, None)
        place(first, columns[0].numel(), columns)
        row = first + columns[0].numel()
    place(row, shard.rows - row, None)
    return runs


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
