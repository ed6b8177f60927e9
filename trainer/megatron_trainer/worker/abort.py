"""Abort the communicators of an epoch and release every process group.

Two halves, because they run on different threads:

- :func:`start_abort` / :func:`abort_communicators` may run on any thread while the main thread
  is blocked in a collective. On NCCL they abort every communicator at once, one thread each (a
  serial abort, or ``c10d._abort_process_group``, hung with Megatron's
  21 groups on 4xH200), which makes the blocked collective return. On gloo there is nothing to call:
  ``abort()`` does not unblock a gloo collective (pytorch#130345); the collective ends with the
  gloo timeout, when a peer frees its groups, or when :func:`close_gloo_connections` shuts this
  process's connections down (what the watchdog does on a hang).
- :func:`forget_process_groups` (NCCL, after an abort) and :func:`release_process_groups` (gloo,
  or a clean stop) run on the main thread once nothing uses the groups.

Why forgetting instead of destroying after an NCCL abort: ``abort()`` takes 0.8-1.2 s on H200
(benchmarks/results/trainer_recovery_4xH200.json), most of it NCCL freeing the communicator after
the kernels have already stopped, and it holds the group's lock all along: ``destroy_process_group()``
and any collective launched on that group wait for it. The abort threads own the old communicators
until they are freed; the main thread only clears torch's group registry and goes on to the next
epoch, whose work queues behind the (already stopped) kernels of the old one on the same stream.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import stat
import threading
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    # What ProcessGroup._get_backend returns: the C++ communicator, not dist.Backend (a name).
    from torch._C._distributed_c10d import Backend as Communicator

log = logging.getLogger(__name__)

_lock = threading.Lock()
_current: tuple[dist.ProcessGroup, Abort] | None = None  # (world group, its abort) once started


class Abort:
    """The aborts of one epoch's NCCL communicators, running concurrently on daemon threads."""

    def __init__(self, backends: list[Communicator]) -> None:
        self.started = time.monotonic()
        self.finished: float | None = None
        self._threads = [
            threading.Thread(target=_abort_one, args=(b,), daemon=True, name="nccl-abort") for b in backends
        ]
        for t in self._threads:
            t.start()
        threading.Thread(target=self._note_finish, daemon=True, name="nccl-abort-wait").start()

    def _note_finish(self) -> None:
        for t in self._threads:
            t.join()
        self.finished = time.monotonic()

    @property
    def count(self) -> int:
        return len(self._threads)

    def wait(self, timeout_seconds: float) -> float:
        """Wait up to ``timeout_seconds`` for every abort; returns seconds since they started."""
        deadline = self.started + timeout_seconds
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = sum(t.is_alive() for t in self._threads)
        if stuck:
            log.error("%d of %d communicator aborts did not return within %.1fs", stuck, self.count, timeout_seconds)
        return time.monotonic() - self.started


def _all_groups() -> list[dist.ProcessGroup]:
    if not dist.is_initialized():
        return []
    return list(dist.distributed_c10d._world.pg_map.keys())


def _nccl_backends() -> list[Communicator]:
    backends: list[Communicator] = []
    for pg in _all_groups():
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except (RuntimeError, ValueError):
            continue  # a group without a CUDA backend (fake): nothing to abort
        if backend.name() == "nccl":  # gloo also serves CUDA tensors, but its abort frees nothing
            backends.append(backend)
    return backends


def start_abort() -> Abort:
    """Start aborting every NCCL communicator registered now, unless that already started.

    Safe to call from any thread and more than once per epoch; returns at once.
    """
    global _current
    with _lock:
        world = dist.group.WORLD if dist.is_initialized() else None
        if world is None:
            return Abort([])
        if _current is None or _current[0] is not world:
            _current = (world, Abort(_nccl_backends()))
        return _current[1]


def abort_communicators(timeout_seconds: float = 10.0) -> float:
    """Abort every NCCL communicator of this process concurrently and wait up to
    ``timeout_seconds`` for them; returns seconds since the aborts started. A no-op for gloo."""
    return start_abort().wait(timeout_seconds)


def forget_process_groups() -> None:
    """After :func:`start_abort`: drop Megatron's parallel state and torch's registry of groups
    without shutting them down (the abort threads hold and free the communicators), then collect
    the objects of the epoch. Returns without waiting for any abort."""
    global _current
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    c10d = dist.distributed_c10d
    with _lock:
        # What destroy_process_group() / c10d._abort_process_group() clear for the world, minus
        # the shutdown of each backend (torch 2.11, distributed_c10d.py).
        world = c10d._world
        c10d._update_default_pg(None)
        world.pg_map.clear()
        world.pg_names.clear()
        world.pg_group_ranks.clear()
        world.pg_backend_config.clear()
        world.pg_to_tag.clear()
        world.tags_to_pg.clear()
        world.pg_coalesce_state.clear()
        c10d._unregister_all_process_groups()
        world.group_count = 0
        _current = None
    gc.collect()


def release_process_groups() -> None:
    """Destroy Megatron's parallel state and every process group, then free them (main thread).

    On gloo the collection matters: gloo closes its sockets only when the group objects are freed,
    and that close is what tells the other survivors quickly (measured: 0.03-0.9 s instead of the
    full timeout).
    """
    global _current
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    with _lock:
        if dist.is_initialized():
            dist.destroy_process_group()
        else:
            # An init_process_group that failed (a store wait timed out) has already taken a group
            # name from torch's counter; destroy_process_group would reset it but needs a default
            # group. Left advanced, the next epoch's groups get other names than the other ranks'
            # and their rendezvous keys never meet.
            dist.distributed_c10d._world.group_count = 0
        _current = None
    gc.collect()


def close_gloo_connections() -> int:
    """Shut down every connected TCP socket of this process; returns how many. Any thread.

    The gloo stand-in for an NCCL abort: a gloo collective blocked on a peer that never answers
    returns at once with "Connection closed by peer", and the peers at the other end of each
    connection see it closed too (measured on CPU: a survivor blocked on a SIGSTOPped rank came
    back in 1.00 s with the gloo timeout at 30 s). A worker's only TCP connections are its epoch's:
    gloo's pairs and its client of the epoch's store, which the next epoch replaces; the channel to
    the agent is a Unix socket. Listening sockets are left alone: shutting gloo's listener down
    makes gloo's accept loop abort the process.
    """
    closed = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue  # closed meanwhile, or not a socket Python can wrap
        try:
            inet = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
            if inet and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
                closed += 1
        except OSError as err:
            log.debug("shutdown of fd %d: %s", fd, err)
        finally:
            sock.detach()  # the descriptor stays gloo's; only the connection is shut down
    return closed


def _abort_one(backend: Communicator) -> None:
    try:
        backend.abort()
    except Exception as err:  # an already-aborted or never-initialized communicator
        log.debug("abort: %s", err)
