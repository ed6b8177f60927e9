"""The checkpoint writer's helper processes, tied to the worker's life.

Megatron's ``dist_checkpointing`` save runs two kinds of helper processes: a multiprocessing
manager (spawned once) whose queue carries the write results back, and, for an asynchronous save,
a writer forked per save. Both are children of the worker,
and a SIGKILLed worker would leave them running, reparented to init. The agent ends the worker's
whole process group, but a worker can also die where nobody does that (it exits when the agent's
channel closes), so each helper also asks the kernel to SIGKILL it when its parent dies
(``PR_SET_PDEATHSIG``).

A forked writer also lets go of the sockets it inherited: a copy of the agent channel or of a gloo or
NCCL bootstrap connection held by the writer would hide the worker's death (no EOF) from the
agent and from its peers until the write ended.

The queue handed to Megatron carries the results pickled to bytes, so the manager never unpickles
a torch object: it does not import torch (Megatron's own manager did, on the first save: ~500 MB
and seconds of a save's time). torch-free: the spawned manager imports this module.

The manager listens on a Linux abstract socket, which is no file: by default it would make a
``pymp-*`` folder in the temporary directory for its socket, and a manager killed with its worker
never removes it (a SIGKILLed worker left one each, in the pod's ``/tmp``). Connections are
authenticated with the worker's authkey, as with the default address.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import queue
import secrets
import signal
import stat
from collections.abc import Iterator
from multiprocessing import get_context
from multiprocessing.managers import SyncManager
from typing import Any

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_forking_writer = False  # set around a writer fork: other forks (none today) are left alone
_manager: SyncManager | None = None
_queue: Any = None


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the thread that started it exits (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    # The parent may have died before prctl took effect: then we are init's already.
    if os.getppid() == 1:
        os._exit(1)


def results_queue() -> Any:
    """The manager-backed queue on which writers return their results; started once per worker.

    Call it from the main thread: the death signal fires when the *thread* that started the
    manager exits.
    """
    global _manager, _queue
    if _manager is None:
        address = f"\0megatron-writer-results-{os.getpid()}-{secrets.token_hex(8)}"  # abstract: no file
        _manager = SyncManager(address=address, ctx=get_context("spawn"))
        _manager.start(initializer=die_with_parent)
        _queue = BytesQueue(_manager.Queue())
    return _queue


class BytesQueue:
    """The part of a queue Megatron's writer uses (``put``, ``get``, ``get_nowait``), carrying
    pickled bytes through a manager's queue (see the module docstring)."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue

    def put(self, item: object) -> None:
        self._queue.put(pickle.dumps(item))

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return pickle.loads(self._queue.get(*args, **kwargs))

    def get_nowait(self) -> Any:
        return pickle.loads(self._queue.get_nowait())

    def drain(self) -> int:
        """Drop every result waiting (an abandoned save's); returns how many."""
        dropped = 0
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return dropped
            dropped += 1


def drain_results() -> int:
    """Drop results an abandoned save's writers left: the next save reads its own from the queue."""
    return _queue.drain() if _queue is not None else 0


def install_results_queue() -> None:
    """Make Megatron's writers use :func:`results_queue` instead of starting a manager of their
    own (``filesystem_async.get_write_results_queue`` keeps one in a module global)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = results_queue()


def _inherited_sockets() -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                fds.append(fd)
        except OSError:
            continue  # the listing's own descriptor, already closed
    return fds


def _after_fork_in_child() -> None:
    if not _forking_writer:
        return
    die_with_parent()
    # /dev/null over each socket rather than close(): the descriptor numbers stay taken, so the
    # Python objects that still name them (closed later, e.g. a manager connection dropped after
    # the fork) never close a descriptor the writer has opened since.
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in _inherited_sockets():
            with contextlib.suppress(OSError):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def forking_writer() -> Iterator[None]:
    """Context in which a fork creates a checkpoint writer (see the module docstring)."""
    global _forking_writer
    _forking_writer = True
    try:
        yield
    finally:
        _forking_writer = False
