"""Long garbage collections are logged (``megatron_operator.gc_pauses``): a real full collection of
a heap with cyclic garbage, at a threshold it exceeds; none at a threshold it cannot reach."""

from __future__ import annotations

import gc

import pytest

from megatron_operator import gc_pauses


def _collect_cycles(count: int) -> None:
    for _ in range(count):
        a: list[object] = []
        a.append(a)
    gc.collect()


def test_a_collection_over_the_threshold_is_logged_and_one_under_it_is_not(caplog: pytest.LogCaptureFixture) -> None:
    saved = list(gc.callbacks)
    try:
        gc.callbacks[:] = [cb for cb in gc.callbacks if not isinstance(cb, gc_pauses._Timer)]
        gc_pauses.log_long_collections(threshold=3600.0)
        gc_pauses.log_long_collections(threshold=0.0)  # one timer only: the first stays
        assert sum(isinstance(cb, gc_pauses._Timer) for cb in gc.callbacks) == 1
        with caplog.at_level("WARNING", logger=gc_pauses.__name__):
            _collect_cycles(1000)
        assert not caplog.records
        gc.callbacks[:] = [cb for cb in gc.callbacks if not isinstance(cb, gc_pauses._Timer)]
        gc_pauses.log_long_collections(threshold=0.0)
        with caplog.at_level("WARNING", logger=gc_pauses.__name__):
            _collect_cycles(1000)
        messages = [r.getMessage() for r in caplog.records]
        assert any("garbage collection of generation 2 stopped the operator" in m for m in messages), messages
        assert any("objects freed" in m and "(0 objects" not in m for m in messages), messages
    finally:
        gc.callbacks[:] = saved
