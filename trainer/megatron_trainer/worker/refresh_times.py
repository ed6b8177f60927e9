"""Where a buddy-copy refresh's time goes (worker/buddy_copies.py), measured without waiting for it:
host clocks for what the training thread spends, CUDA events (read once the refresh has ended) for
what the GPU streams do.

A refresh blocks training only where the training thread runs it (assembling the flat shards and
queueing the transfers: ``host_s``) or waits for it (``waited_s``: it was due again, or the epoch
was left, before it ended). The rest runs beside the steps; where it takes longer than the steps
between refreshes it turns into ``waited_s``. On GPU the side stream copies this rank's snapshot to
host memory (``own_copy_s``), then sends it and receives the ward's, chunk by chunk into host memory
(``exchange_s``): ``bytes_to_host`` over their sum is the side stream's rate, the host link's where
the sends (over NVLink) take little of it. The training loop logs one line per epoch
(:data:`LOG_LINE`, :func:`summary`); :func:`logged` reads them back.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from collections import deque
from typing import Any

import torch

#: Refreshes whose times a rank keeps per epoch (the first and the newest): a week at one refresh a
#: step would otherwise hold millions.
KEPT = 1000

#: The training loop's line of an epoch's refreshes: epoch, rank, :func:`summary`.
LOG_LINE = "epoch %d rank %d: buddy copies: %s"

_LOGGED = re.compile(
    r"epoch (\d+) rank (\d+): buddy copies: (\d+) refreshes; the first \(step (\d+)\): ([^;\n]*)"
    r"(?:; the others' medians \(newest \d+\): ([^;\n]*))?"
)


@dataclasses.dataclass
class RefreshTimes:
    step: int
    bytes_to_host: int  # this rank's snapshot and its ward's copy, into host memory
    host_s: float  # the training thread's time to assemble the shards and queue the refresh
    queue_s: float | None = None  # the part of host_s after the assembly: queueing the copies and transfers
    waited_s: float = 0.0  # the training thread's wait for its end
    assemble_s: float | None = None  # GPU: the flat shards' assembly (side stream, BuddyCopies.assemble)
    own_copy_s: float | None = None  # GPU: this rank's snapshot to host memory (side stream)
    exchange_s: float | None = None  # the sends and receives, with the ward's copy to host memory
    total_s: float | None = None  # from the assembly's start to the refresh's end


class Stamp:
    """A moment on the host clock and, on GPU, on ``device``'s current stream."""

    def __init__(self, device: torch.device | None) -> None:
        self.host = time.perf_counter()
        self.event = _event(device)


def _event(device: torch.device | None) -> Any:
    if device is None or device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def seconds(start: Any, end: Any) -> float | None:
    """Seconds between two completed CUDA events; None where either is missing."""
    if start is None or end is None:
        return None
    return float(start.elapsed_time(end)) / 1000.0


class RefreshLog:
    """The times of an epoch's refreshes: the first (which also sets up the pair's transfers) and
    the newest :data:`KEPT`."""

    def __init__(self) -> None:
        self.first: RefreshTimes | None = None
        self.rest: deque[RefreshTimes] = deque(maxlen=KEPT)
        self.count = 0

    def add(self, times: RefreshTimes) -> None:
        if self.first is None:
            self.first = times
        else:
            self.rest.append(times)
        self.count += 1


def summary(log: RefreshLog) -> str | None:
    """One line: the first refresh's times, and the median of each of the others'; None when no
    refresh ended."""
    if log.first is None:
        return None
    text = f"{log.count} refreshes; the first (step {log.first.step}): {_fields([log.first])}"
    if log.rest:
        text += f"; the others' medians (newest {len(log.rest)}): {_fields(list(log.rest))}"
    return text


def _fields(times: list[RefreshTimes]) -> str:
    names = ("host_s", "queue_s", "waited_s", "assemble_s", "own_copy_s", "exchange_s", "total_s")
    parts = []
    for name in names:
        values = [v for t in times if (v := getattr(t, name)) is not None]
        if values:
            parts.append(f"{name}={statistics.median(values):.4f}")
    host_copy = [
        t.bytes_to_host / (t.own_copy_s + t.exchange_s)
        for t in times
        if t.own_copy_s is not None and t.exchange_s is not None and t.own_copy_s + t.exchange_s > 0
    ]
    parts.append(f"bytes_to_host={times[-1].bytes_to_host}")
    if host_copy:
        parts.append(f"side_stream_gb_per_s={statistics.median(host_copy) / 1e9:.2f}")
    return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Logged:
    """One :data:`LOG_LINE`, read back: the first refresh's fields and the others' medians."""

    epoch: int
    rank: int
    refreshes: int
    first_step: int
    first: dict[str, float]
    others: dict[str, float]  # empty when the epoch refreshed once


def logged(text: str) -> list[Logged]:
    """Every :data:`LOG_LINE` of a worker's log ``text``, in order."""

    def fields(part: str | None) -> dict[str, float]:
        return {k: float(v) for k, _, v in (kv.partition("=") for kv in (part or "").split())}

    return [
        Logged(int(m[1]), int(m[2]), int(m[3]), int(m[4]), fields(m[5]), fields(m[6])) for m in _LOGGED.finditer(text)
    ]
