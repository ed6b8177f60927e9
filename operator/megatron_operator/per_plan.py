"""Values worked out from a plan, kept for the last few plans.

Every reconcile pass asks again about the plan in force (its units, its dump for the status, its
members' replicas), and a plan of thousands of members makes each answer tens of milliseconds.
Plans are not changed once made, so an answer holds as long as the plan object does. Kept by the
plan's identity, the plan itself held with it so that its id is never another's (pydantic models
are not hashable).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from megatron_contract.mesh import MeshPlan


class PerPlan[K: Hashable, V]:
    """The values of ``make(plan, key)`` for the last ``size`` (plan, key) pairs asked."""

    def __init__(self, make: Callable[[MeshPlan, K], V], size: int = 8) -> None:
        self._make = make
        self._size = size
        self._held: dict[tuple[int, K], tuple[MeshPlan, V]] = {}

    def __call__(self, plan: MeshPlan, key: K) -> V:
        held = self._held.get((id(plan), key))
        if held is not None and held[0] is plan:
            return held[1]
        value = self._make(plan, key)
        if len(self._held) >= self._size:
            del self._held[next(iter(self._held))]  # the oldest
        self._held[(id(plan), key)] = (plan, value)
        return value
