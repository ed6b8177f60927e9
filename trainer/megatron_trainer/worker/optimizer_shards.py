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

    def windows(self, window_rows: int) -> list[tuple[int, int, list[_Run]]]:
        """The rows in windows of at most ``window_rows`` (:func:`materialize`), cut once per size: a
        1 B model's hundreds of pieces took the training thread ~5 ms to cut at every refresh."""
        cut: dict[int, list[tuple[int, int, list[_Run]]]] = self.__dict__.setdefault("_windows", {})
        if window_rows not in cut:  # a frozen dataclass's own dict: no field, not compared
            cut[window_rows] = _windows(self, window_rows)
        return cut[window_rows]


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


#: Rows :func:`materialize` assembles at once: each column of a window is gathered into a staging
#: buffer of this many elements, then the columns are interleaved into the rows (3 x 16 Mi fp32 = 192 MiB).
WINDOW_ROWS = 16 << 20


def materialize(shards: list[ShardPieces], window_rows: int = WINDOW_ROWS) -> list[torch.Tensor]:
    """The flat shards (copies) of pieces from :func:`shard_pieces`; padding rows zero.

    A few kernels a window instead of one for every column of every piece (hundreds of launches,
    each writing every third element): a 1 B model's shard took 0.03 s of GPU time and ~0.01 s of
    the training thread at every buddy refresh that way."""
    out = []
    for shard in shards:
        device = shard.pieces[0][1][0].device if shard.pieces else None
        columns = 1 + len(STATE_KEYS)
        rows = torch.empty(shard.rows, columns, dtype=torch.float32, device=device)
        staging = torch.empty(columns, min(window_rows, shard.rows), dtype=torch.float32, device=device)
        for start, end, runs in shard.windows(window_rows):
            for c in range(columns):
                for run in runs:
                    target = staging[c, run.first - start : run.first - start + run.rows]
                    if not run.parts:
                        target.zero_()
                    else:  # cat casts nothing: a precision-aware optimizer's bf16 moments are cast first
                        torch.cat(
                            [p[c] if p[c].dtype == torch.float32 else p[c].float() for p in run.parts], out=target
                        )
            rows[start:end].copy_(staging[:, : end - start].t())
        out.append(rows)
    return out


@dataclasses.dataclass
class _Run:
    """Adjacent rows of a window: the columns of the pieces filling them, in order (none: padding)."""

    first: int
    rows: int
    parts: list[tuple[torch.Tensor, ...]]


def _windows(shard: ShardPieces, window_rows: int) -> list[tuple[int, int, list[_Run]]]:
    """``shard``'s rows, all of them, in windows of at most ``window_rows``: (start, end, runs)."""
    windows: list[tuple[int, int, list[_Run]]] = []

    def place(first: int, count: int, columns: tuple[torch.Tensor, ...] | None) -> None:
        while count > 0:
            if not windows or first >= windows[-1][1]:
                windows.append((first, min(first + window_rows, shard.rows), []))
            _, end, runs = windows[-1]
            take = min(count, end - first)
            part = None if columns is None else tuple(t[:take] for t in columns)
            if part is not None and runs and runs[-1].parts and runs[-1].first + runs[-1].rows == first:
                runs[-1].parts.append(part)
                runs[-1].rows += take
            else:
                runs.append(_Run(first, take, [part] if part is not None else []))
            first, count = first + take, count - take
            columns = None if columns is None else tuple(t[take:] for t in columns)

    row = 0
    for first, columns in sorted(shard.pieces, key=lambda p: p[0]):
        place(row, first - row, None)
        place(first, columns[0].numel(), columns)
        row = first + columns[0].numel()
    place(row, shard.rows - row, None)
    return windows


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
