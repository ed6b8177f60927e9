"""The ``HostMemoryShort`` condition: whether a pod's memory request holds its buddy copies, pure.

The need is :func:`megatron_contract.host_memory.host_memory_need` (the distributed optimizer's
host copies at the smallest data-parallel size the job may run at with them). A request below it
is a warning, not a refusal (that module says why): the job runs, and the condition and a Warning
event name the bytes needed and requested. Without a memory request nothing is reserved for the
copies, and the condition says so without warning; without copies (no distributed optimizer, a
model of one's own, one pod) the condition is absent, or False once it was set.
"""

from __future__ import annotations

import functools

from megatron_contract.host_memory import HostMemoryNeed, host_memory_need
from megatron_contract.job import Condition, MegatronJobSpec
from megatron_operator.status import Reason

_WHAT = "of host memory for the distributed optimizer's buddy copies"


def host_memory_condition(
    spec: MegatronJobSpec, old: Condition | None, copies_kept: bool
) -> tuple[bool, str, str] | None:
    """(status, reason, message) of ``HostMemoryShort`` for ``spec``; None: leave it absent.
    ``copies_kept``: whether the operator asks the trainers for buddy copies
    (``optimizer_sources.in_memory_restore``); without, no pod needs memory for them."""
    try:
        need = _need(spec.model_dump_json()) if copies_kept else None
    except ValueError as exc:  # a memory quantity the API server let through but not read here
        return False, Reason.MEMORY_NOT_REQUESTED, f"the trainer container's memory request cannot be read: {exc}"
    if need is None:
        return None if old is None else (False, Reason.NO_BUDDY_COPIES, "the job keeps no buddy copies")
    wanted = f"each pod needs {_bytes(need.need)} {_WHAT} at {need.dp} data-parallel replicas"
    if need.request is None:
        return False, Reason.MEMORY_NOT_REQUESTED, f"{wanted}; the trainer container requests no memory"
    return _compare(need, wanted)


@functools.lru_cache(maxsize=1024)
def _need(spec_json: str) -> HostMemoryNeed | None:
    """Computed once per spec: every status write asks, and a large MoE spec lists millions of tensors."""
    return host_memory_need(MegatronJobSpec.model_validate_json(spec_json))


def _compare(need: HostMemoryNeed, wanted: str) -> tuple[bool, str, str]:
    assert need.request is not None
    requested = f"the trainer container requests {_bytes(need.request)}"
    if need.request < need.need:
        return True, Reason.HOST_MEMORY_SHORT, f"{wanted}; {requested}"
    return False, Reason.HOST_MEMORY_SUFFICIENT, f"{wanted}; {requested}"


def _bytes(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.1f} GiB)"
