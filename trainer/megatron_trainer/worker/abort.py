"""Abort the communicators of an epoch and release every process group.

Two halves, because they run on different threads:

- :func:`abort_communicators` may run on any thread while the main thread is blocked in a
  collective. On NCCL it aborts every communicator at once, one thread each (a serial abort, or
  ``c10d._abort_process_group``, can hang with Megatron's many groups: shared/FACTS.md), which makes
  the blocked collective return. On gloo there is nothing to call: ``abort()`` does not unblock a
  gloo collective (pytorch#130345); the collective ends with the gloo timeout or when a peer frees
  its groups.
- :func:`release_process_groups` runs on the main thread once nothing uses the groups: it destroys
  Megatron's parallel state and every torch process group, then collects garbage, because gloo
  closes its sockets only when the group objects are freed, and that close is what tells the
  other survivors quickly (FACTS.md: 0.03-0.9 s instead of the full timeout).
"""

from __future__ import annotations

import gc
import logging
import threading
import time

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def _all_groups() -> list[dist.ProcessGroup]:
    if not dist.is_initialized():
        return []
    return list(dist.distributed_c10d._world.pg_map.keys())


def abort_communicators(timeout_seconds: float = 10.0) -> float:
    """Abort every NCCL communicator of this process concurrently; returns seconds spent.

    Safe to call from a side thread and more than once. A no-op for gloo groups.
    """
    start = time.monotonic()
    backends = []
    for pg in _all_groups():
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except (RuntimeError, ValueError):
            continue  # a group without a CUDA backend (gloo or fake): nothing to abort
        if hasattr(backend, "abort"):
            backends.append(backend)
    threads = [threading.Thread(target=_abort_one, args=(b,), daemon=True, name="nccl-abort") for b in backends]
    for t in threads:
        t.start()
    deadline = start + timeout_seconds
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(t.is_alive() for t in threads)
    if stuck:
        log.error("%d of %d communicator aborts did not return within %.1fs", stuck, len(threads), timeout_seconds)
    return time.monotonic() - start


def _abort_one(backend: object) -> None:
    try:
        backend.abort()  # type: ignore[attr-defined]
    except Exception as err:  # an already-aborted or never-initialized communicator
        log.debug("abort: %s", err)


def release_process_groups() -> None:
    """Destroy Megatron's parallel state and every process group, then free them (main thread)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
