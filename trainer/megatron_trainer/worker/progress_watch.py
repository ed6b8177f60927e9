"""Watching the main thread from the worker's other threads: the watchdog's ticks, and the
interrupt that the watchdog (a hang) and the channel reader (a newer plan, shutdown) raise.

Each watchdog tick tells the agent this worker is alive (a stopped process cannot) and judges the
step in progress (worker/watchdog.py): a step that stalls past its limit is a hung peer.

Who aborts the NCCL communicators: the main thread, once it has left the step (worker/abort.py
explains why it does not wait for them). An abort holds each group's lock for its whole duration
(~1 s), and a collective launched meanwhile would block on that lock, so aborting while the main
thread still launches the step's collectives cost the survivors up to a second. Only if the main
thread has not left the step after :data:`ABORT_GRACE_SECONDS` (blocked somewhere no flag reaches)
does the interrupting thread abort the communicators itself, which frees any blocked call. On gloo,
where ``abort()`` frees nothing (pytorch#130345), a hang found by the watchdog shuts down the
process's gloo connections instead (:func:`abort.close_gloo_connections`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from megatron_trainer.channel import Alive
from megatron_trainer.worker import abort
from megatron_trainer.worker.lifecycle import WorkerState
from megatron_trainer.worker.watchdog import HangWatch

if TYPE_CHECKING:
    from megatron_trainer.worker.runtime import Worker

log = logging.getLogger("megatron_trainer.worker")

ABORT_GRACE_SECONDS = 0.5

#: How often the watchdog thread looks at the main thread's progress.
WATCHDOG_TICK_SECONDS = 0.05
#: How often a training worker tells its agent it is alive (a stopped process cannot).
ALIVE_SECONDS = 0.25
#: Worker states in which the watchdog tells the agent it is alive.
_SAYS_ALIVE = frozenset({WorkerState.SPARE, WorkerState.RECONFIGURING, WorkerState.TRAINING, WorkerState.WAITING})


def interrupt(worker: Worker, reason: str, now: bool = False, hung: bool = False) -> None:
    """Mark the epoch aborted; abort its communicators here only if the main thread does not
    leave its step within the grace (or at once when ``now``). ``hung`` (the watchdog's verdict)
    also unblocks a gloo collective, which no flag reaches."""
    with worker.lock:
        if worker.aborted.is_set():
            return
        worker.abort_reason = reason
        worker.detected_at = time.monotonic()
        worker.detected_wall = time.time()
        worker.aborted.set()
        phases = worker.phases  # this epoch's: the main thread may enter the next one meanwhile
    if worker.backend == "nccl" and worker.epoch and (now or not worker.out_of_step.wait(ABORT_GRACE_SECONDS)):
        # Still in the step after the grace: blocked where the flag is not seen (a kernel launch
        # behind a full queue, a host sync inside Megatron). Aborting frees it.
        took = abort.abort_communicators()
        phases["abort_nccl"] = took
        thread = threading.current_thread().name
        log.info("communicators aborted in %.3fs by the %s thread (%s)", took, thread, reason)
    elif worker.backend == "gloo" and hung and worker.epoch and not worker.out_of_step.wait(ABORT_GRACE_SECONDS):
        closed = abort.close_gloo_connections()
        log.info("%d gloo connections shut down by the %s thread (%s)", closed, threading.current_thread().name, reason)


def watch_progress(worker: Worker) -> None:
    """The watchdog thread: judge the main thread's progress every tick (worker/watchdog.py); abort
    on a hang. A bug in one tick is logged, never the end of the watchdog."""
    watch = HangWatch(worker.limits)
    said_alive = 0.0
    while True:
        time.sleep(WATCHDOG_TICK_SECONDS)
        try:
            said_alive = _watch_tick(worker, watch, said_alive)
        except Exception:
            log.exception("watchdog tick failed")


def _watch_tick(worker: Worker, watch: HangWatch, said_alive: float) -> float:
    """One watchdog tick; returns when the agent last heard that this worker is alive."""
    training = worker.state is WorkerState.TRAINING and not worker.aborted.is_set()
    mark = worker.marks.current() if training else None
    now = time.monotonic()
    # In every live state: while training (with the step's limit), and while an aborted step
    # unwinds, a join runs (rendezvous, rebuild, restore, verify) or the worker waits as a spare
    # or for a plan, without one: then the agent allows the hang timeout. A worker stopped in a
    # join would otherwise hold up its peers' rendezvous for ever, its agent still reporting.
    if worker.state in _SAYS_ALIVE and now - said_alive >= ALIVE_SECONDS:
        limit = worker.limits.step_limit()
        worker.send(
            Alive(
                epoch=worker.epoch,
                phase=mark.phase.value if mark is not None else None,
                step_limit_seconds=limit if training and limit < worker.limits.ceiling else None,
            )
        )
        said_alive = now
    hang = watch.check(mark, time.monotonic(), worker.activity if mark is not None else None)
    # The main thread may have left the phase while the tick judged it (a loaded host can hold this
    # thread between its reading of the mark and the verdict): a phase that ended was no hang.
    if hang is not None and worker.marks.current() is mark:
        log.warning("%s", hang)
        interrupt(worker, hang, hung=True)
    return said_alive
