"""Which steps of an epoch of rare refreshes ran beside one and which ran clear of one: the split that
``distributed_optimizer.py`` (the worker's steps) and ``refresh_interference.py`` (an emulated step)
both charge a refresh's cost by. Steps a second apart share the host's state; epochs minutes apart
did not, on any of the shared machines measured."""

from __future__ import annotations


def split_by_refresh(times: dict[int, float], interval: int) -> tuple[list[float], list[float]]:
    """``times`` (step time by step count) as (beside, clear): a refresh starts once the step count
    reaches a multiple of ``interval`` and runs beside the next step; a step at least two after one
    is clear of it (a refresh that outlasts its step slows the next, which is in neither)."""
    beside = [t for step, t in times.items() if (step - 1) % interval == 0]
    clear = [t for step, t in times.items() if (step - 1) % interval >= 2]
    return beside, clear
