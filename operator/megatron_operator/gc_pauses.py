"""Long garbage collections, said in the log; the young generation collected between failures.

A collection stops every thread of the operator while it walks a generation of the heap, and the
oldest generation of a job of thousands of pods is hundreds of MB of objects: at Python's default
thresholds a full collection took up to 0.78 s at 4096 pods (``settings.GC_THRESHOLDS`` makes them
rare). One that lands between a pod's failure and its plan delays the plan by as much, and nothing
else would say why: each collection of at least ``threshold`` seconds is logged. A pass that pushed
a new plan collects the young generation as it ends (``collect_young``), when no plan waits on it.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

#: Collections at least this long are logged.
LONG_COLLECTION_SECONDS = 0.05


class _Timer:
    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.started: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        if self.started is None:
            return
        took, self.started = time.perf_counter() - self.started, None
        if took >= self.threshold:
            log.warning(
                "garbage collection of generation %d stopped the operator for %.0f ms (%d objects freed)",
                info.get("generation", -1),
                took * 1000,
                info.get("collected", 0),
            )


def collect_young() -> None:
    """Collect the young generation now, once a pass has stored and pushed a new plan.

    A failure's pass and the echo of its status write (kopf's objects around the job's body, 0.5 MB
    at 4096 pods, hold reference cycles) leave tens of thousands of objects to the collector. Left
    there, every few failures they filled the young generation to its threshold inside a later
    failure's pass, and that collection (50-80 ms at 4096 pods) held its plan. Collected here, when
    the members already hold the plan, they no longer count toward the next failure's."""
    gc.collect(0)


def log_long_collections(threshold: float = LONG_COLLECTION_SECONDS) -> None:
    """Log every garbage collection from now on that takes at least ``threshold`` seconds."""
    if not any(isinstance(cb, _Timer) for cb in gc.callbacks):
        gc.callbacks.append(_Timer(threshold))
