"""Unit tests of progress-based hang detection (worker/watchdog.py) and its fault hooks.

Scenarios: the step limit is the collective timeout until the epoch has three step times (its first
step and the step after a checkpoint save are warm-ups, never recorded), then ``multiple x median``
of the recent steps, never below the floor (at least 5 s on gloo) nor above the collective timeout,
and a new epoch forgets the old times; a multiple of 0 turns it off; a stalled step is judged at its
limit, not before, by the limit in force as it began (a warm-up judged after it ended is no hang),
and a tick acts on no phase that ended while it judged; a data read or a save is allowed the
collective timeout and announces itself to the peers through the store; a stalled rank that sees
such an announcement postpones its verdict by one limit and then decides; a store that fails counts
as nobody busy, and one whose host is stopped holds up no verdict; delay faults fire at their
injection point only; shutting down a process's TCP connections frees a gloo collective blocked on a
stopped peer (two real processes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from worker_harness import REPO, make_spec

from megatron_trainer.faults import ENV_FAULTS, Fault, FaultPlan, InjectionPoint
from megatron_trainer.worker.lifecycle import WorkerState
from megatron_trainer.worker.progress_watch import _watch_tick
from megatron_trainer.worker.watchdog import (
    STORE_CALL_SECONDS,
    HangWatch,
    PeerActivity,
    Phase,
    PhaseMark,
    ProgressMarks,
    StepLimit,
)


def limits(multiple: float = 3.0, floor: float = 1.0, timeout: float = 30.0) -> StepLimit:
    spec = make_spec(
        collective_timeout=timeout,
        detection={"hang_detection_step_multiple": multiple, "hang_detection_floor_seconds": floor},
    )
    return StepLimit(spec.failure_detection)


def warmed(lim: StepLimit, *seconds: float) -> StepLimit:
    """``lim`` after a warm-up step (never recorded) and steps of ``seconds``."""
    for s in (99.0, *seconds):
        lim.record(s)
    return lim


def mark(phase: Phase, lim: StepLimit, started: float = 100.0, serial: int = 1, step: int = 5) -> PhaseMark:
    """A phase begun at ``started`` under ``lim``'s current step limit."""
    return PhaseMark(phase=phase, step=step, started=started, serial=serial, step_limit=lim.step_limit())


def test_step_limit_follows_the_recent_median_between_floor_and_timeout() -> None:
    lim = limits()
    assert lim.step_limit() == 30.0  # no step yet: the collective timeout
    lim.record(5.0)
    assert lim.step_limit() == 30.0  # the epoch's first step is a warm-up, not recorded
    for s in (0.1, 0.2):
        lim.record(s)
    assert lim.step_limit() == 30.0  # two steps are not enough to go by
    lim.record(0.1)
    assert lim.step_limit() == 1.0  # 3 x 0.1 s is under the floor
    for s in (2.0, 2.0, 2.0, 2.0, 2.0):
        lim.record(s)
    assert lim.step_limit() == pytest.approx(6.0)  # median of the last 8: 2.0
    lim.record(50.0)
    assert lim.step_limit() == pytest.approx(6.0)  # one outlier does not move the median
    for _ in range(8):
        lim.record(20.0)
    assert lim.step_limit() == 30.0  # capped by the collective timeout
    lim.reset()
    assert lim.step_limit() == 30.0  # a new epoch starts over
    assert mark(Phase.DATA, lim).allowance(lim.ceiling) == mark(Phase.CHECKPOINT, lim).allowance(lim.ceiling) == 30.0


def test_the_step_after_a_save_is_a_warm_up() -> None:
    lim = warmed(limits(), 0.2, 0.2, 0.2)
    assert lim.step_limit() == 1.0
    lim.warm_up_next()
    assert lim.step_limit() == 30.0
    lim.record(3.0)  # the slow step after the save: allowed, and not recorded
    assert lim.step_limit() == 1.0 and lim.median() == 0.2


def test_a_warm_up_step_judged_after_it_ended_is_no_hang() -> None:
    """A CI run on two loaded cores found it: a peer's 8 s save kept the step after the save (a
    warm-up) waiting; the step ended, its end recorded it and cleared the warm-up, and a tick that
    had read the mark before then judged the 8 s step by the next step's 5 s limit: a false hang.
    The mark keeps the limit in force as its phase began."""
    lim = warmed(StepLimit(make_spec(collective_timeout=30.0).failure_detection, min_floor=5.0), 0.25, 0.25, 0.25)
    lim.warm_up_next()  # a save just ran
    marks = ProgressMarks(lim)
    marks.begin(Phase.STEP, 4)
    step = marks.current()
    assert step is not None and step.step_limit == 30.0
    lim.record(marks.end())  # the main thread: the step ended, the warm-up is over
    assert lim.step_limit() == 5.0
    assert HangWatch(lim).check(step, step.started + 8.22, None) is None


def test_a_tick_whose_phase_ended_while_it_judged_interrupts_nothing() -> None:
    """Whatever the verdict, a tick acts only on the phase still in progress."""
    lim = warmed(limits(), 0.2, 0.2, 0.2)
    marks = ProgressMarks(lim)

    class Verdict(HangWatch):
        def __init__(self, ends_phase: bool) -> None:
            super().__init__(lim)
            self.ends_phase = ends_phase

        def check(self, mark: PhaseMark | None, now: float, activity: PeerActivity | None) -> str | None:
            if self.ends_phase:
                marks.end()  # the main thread leaves the step while this tick judges it
            return f"hang: step {mark.step if mark else None} made no progress"

    # Not enough of a worker for an interrupt (no lock): a tick that interrupted would raise.
    worker = SimpleNamespace(
        state=WorkerState.TRAINING, aborted=threading.Event(), marks=marks, limits=lim, activity=None, send=print
    )
    marks.begin(Phase.STEP, 5)
    _watch_tick(worker, Verdict(ends_phase=True), said_alive=time.monotonic())  # type: ignore[arg-type]
    assert not worker.aborted.is_set()
    worker.lock, worker.backend, worker.epoch, worker.phases = threading.Lock(), "gloo", 0, {}
    marks.begin(Phase.STEP, 6)
    _watch_tick(worker, Verdict(ends_phase=False), said_alive=time.monotonic())  # type: ignore[arg-type]
    assert worker.abort_reason == "hang: step 6 made no progress"  # the phase in progress: acted on


def test_gloo_floor_is_at_least_five_seconds() -> None:
    spec = make_spec(collective_timeout=30.0)
    lim = warmed(StepLimit(spec.failure_detection, min_floor=5.0), 0.2, 0.2, 0.2)
    assert lim.step_limit() == 5.0


def test_multiple_zero_keeps_the_collective_timeout() -> None:
    lim = warmed(limits(multiple=0), 0.1, 0.1, 0.1)
    assert lim.step_limit() == 30.0
    assert "collective timeout" in lim.describe()


def test_stalled_step_is_a_hang_at_its_limit_not_before() -> None:
    lim = limits()
    warmed(lim, 0.2, 0.2, 0.2)
    watch = HangWatch(lim)
    store = dist.HashStore()
    activity = PeerActivity(store)
    step = mark(Phase.STEP, lim)
    assert watch.check(step, 100.4, activity) is None
    assert watch.check(step, 100.6, activity) is None  # halfway: the peers' counter is read
    assert watch.check(step, 100.95, activity) is None
    reason = watch.check(step, 101.05, activity)
    assert reason is not None and reason.startswith("hang: step 5") and "median step 0.200s" in reason


def test_first_step_of_an_epoch_waits_for_the_collective_timeout() -> None:
    lim = limits(timeout=30.0)
    watch = HangWatch(lim)  # nothing recorded: the epoch's first step
    step = mark(Phase.STEP, lim)
    assert watch.check(step, 129.0, None) is None
    reason = watch.check(step, 130.1, None)
    assert reason is not None and "collective timeout" in reason


def test_data_read_and_save_get_the_collective_timeout_and_announce_themselves() -> None:
    lim = limits()
    warmed(lim, 0.2, 0.2, 0.2)  # step limit 1 s
    store = dist.HashStore()
    for phase in (Phase.DATA, Phase.CHECKPOINT):
        watch = HangWatch(lim)
        busy = PeerActivity(store)
        before = busy.read()
        t = 100.0
        while t < 129.9:
            assert watch.check(mark(phase, lim), t, busy) is None, f"{phase} at {t - 100:.1f}s"
            t += 0.05
        assert busy.read() is not None and busy.read() > before + 100  # every 0.2 s after the first 0.2 s
        reason = watch.check(mark(phase, lim), 130.1, busy)
        assert reason is not None and phase.value in reason


def test_a_busy_peer_postpones_the_verdict_by_one_limit() -> None:
    lim = limits()
    warmed(lim, 0.2, 0.2, 0.2)  # step limit 1 s
    store = dist.HashStore()
    stalled, peer = HangWatch(lim), HangWatch(lim)
    mine, theirs = PeerActivity(store), PeerActivity(store)
    step, reading = mark(Phase.STEP, lim), mark(Phase.DATA, lim)
    t = 100.0
    while t < 104.0:  # the peer reads data for 4 s; this rank waits for it in a collective
        assert peer.check(reading, t, theirs) is None
        assert stalled.check(step, t, mine) is None, f"false hang at {t - 100:.2f}s"
        t += 0.05
    # The peer's read is over; it computes and joins within a limit, or this rank decides.
    while t < 104.9:
        assert stalled.check(step, t, mine) is None
        t += 0.05
    reason = stalled.check(step, 105.2, mine)
    assert reason is not None and "no progress" in reason


class BrokenStore:
    def add(self, key: str, value: int) -> int:
        raise RuntimeError("connection reset")


def test_an_unreadable_store_counts_as_nobody_busy() -> None:
    lim = limits()
    warmed(lim, 0.2, 0.2, 0.2)
    watch = HangWatch(lim)
    broken = PeerActivity(BrokenStore())  # type: ignore[arg-type]
    broken.announce()  # logged, not raised
    assert watch.check(mark(Phase.STEP, lim), 100.6, broken) is None
    assert watch.check(mark(Phase.STEP, lim), 101.1, broken) is not None


STORE_HOST = """
import sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(60)
def test_a_stopped_store_host_does_not_hold_up_the_verdict() -> None:
    """The store's host (an agent) stopped: a TCPStore request would block past its timeout; the
    watchdog's requests give up after STORE_CALL_SECONDS and it judges the stall on time."""
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        activity = PeerActivity(client)
        assert activity.read() == 0
        host.send_signal(signal.SIGSTOP)
        lim = warmed(limits(), 0.2, 0.2, 0.2)  # limit 1 s
        watch = HangWatch(lim)
        start = time.monotonic()
        assert watch.check(mark(Phase.STEP, lim), 100.6, activity) is None  # halfway: the baseline, unanswered
        verdict = watch.check(mark(Phase.STEP, lim), 101.1, activity)  # at the limit: a verdict at once
        took = time.monotonic() - start
        assert verdict is not None and "no progress" in verdict, verdict
        assert took < STORE_CALL_SECONDS + 1.0, f"the watchdog waited {took:.1f}s for a stopped store"
        activity.announce()  # returns at once while the earlier request is still blocked
        assert time.monotonic() - start < STORE_CALL_SECONDS + 1.0
    finally:
        host.kill()
        host.wait(10)


def test_delay_faults_fire_at_their_point_only() -> None:
    plan = FaultPlan().fail_at(rank=1, step=2, fault=Fault.DELAY, seconds=0.3, point=InjectionPoint.DATA_READ)
    back = FaultPlan.from_env({ENV_FAULTS: plan.to_env()})
    assert back.specs == plan.specs
    assert back.due(epoch=1, rank=1, step=2) is None  # mid-step is another point
    start = time.monotonic()
    back.maybe_fire(1, 1, 2, InjectionPoint.CHECKPOINT)
    assert time.monotonic() - start < 0.1
    back.maybe_fire(1, 1, 2, InjectionPoint.DATA_READ)
    assert time.monotonic() - start >= 0.3


BLOCKED_RANK = """
import os, signal, sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist
from megatron_trainer.worker.abort import close_gloo_connections
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
t = torch.ones(8)
dist.all_reduce(t)
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
threading.Timer(0.5, close_gloo_connections).start()
start = time.monotonic()
try:
    dist.all_reduce(t)
    print("completed", time.monotonic() - start, flush=True)
except RuntimeError as err:
    print(repr(str(err)), time.monotonic() - start, flush=True)
os._exit(0)
"""


@pytest.mark.timeout(120)
def test_closing_connections_frees_a_gloo_collective_blocked_on_a_stopped_peer() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BLOCKED_RANK, str(rank), str(store.port)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "trainer"), str(REPO / "contract")])},
        )
        for rank in (0, 1)
    ]
    try:
        out, _ = procs[0].communicate(timeout=90)
        error, seconds = out.strip().rsplit(" ", 1)
        assert "closed" in error.lower(), error
        assert float(seconds) < 5, f"the blocked collective returned after {seconds}s (gloo timeout 30 s)"
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_a_worker_stopped_while_joining_or_waiting_is_hung_after_the_hang_timeout() -> None:
    """A worker SIGSTOPped during a join (rendezvous, restore) holds up its peers for ever while its
    agent still reports; a chaos run found it. One that speaks Alive is hung when silent past the
    hang timeout in a join or as a spare; one that never said Alive (an older worker) is not."""
    from megatron_trainer.agent.lifecycle import WorkerPhase
    from megatron_trainer.agent.supervisor import WorkerHandle, WorkerSupervisor
    from megatron_trainer.channel import Alive

    sup = WorkerSupervisor(["true"], {}, hang_timeout_seconds=20.0, on_message=lambda *_: None, on_exit=lambda _: None)
    now = time.monotonic()

    def handle(rank: int, phase: WorkerPhase, silent: float, alive: bool) -> WorkerHandle:
        h = WorkerHandle(rank, process=None, writer=None, phase=phase, last_seen=now - silent)  # type: ignore[arg-type]
        h.last_alive = Alive(epoch=2) if alive else None
        h.exit_code = None
        return h

    sup.workers = {
        0: handle(0, WorkerPhase.RECONFIGURING, 25.0, alive=True),  # stopped in a join: hung
        1: handle(1, WorkerPhase.RECONFIGURING, 15.0, alive=True),  # silent, but within the timeout
        2: handle(2, WorkerPhase.SPARE, 25.0, alive=True),  # a stopped spare: hung
        3: handle(3, WorkerPhase.RECONFIGURING, 25.0, alive=False),  # never spoke Alive: not judged
        4: handle(4, WorkerPhase.STARTING, 99.0, alive=True),  # imports: not judged here
    }
    assert sorted(h.local_rank for h in sup.find_hung(now)) == [0, 2]


def test_the_save_grace_applies_to_a_worker_saving_not_to_one_stopped_after_a_save_step() -> None:
    """A worker stopped in the step after a checkpoint step (a multiple of the interval) was allowed
    the save's 600 s grace: a chaos run waited ten minutes. A worker that speaks Alive gets the
    grace only while its last Alive says it is in a save."""
    from megatron_trainer.agent.lifecycle import WorkerPhase
    from megatron_trainer.agent.supervisor import WorkerHandle, WorkerSupervisor
    from megatron_trainer.channel import Alive, Progress

    sup = WorkerSupervisor(
        ["true"],
        {},
        hang_timeout_seconds=20.0,
        on_message=lambda *_: None,
        on_exit=lambda _: None,
        checkpoint_interval_steps=10,
        checkpoint_grace_seconds=600.0,
    )
    h = WorkerHandle(0, process=None, writer=None, phase=WorkerPhase.TRAINING)  # type: ignore[arg-type]
    h.progress = Progress(epoch=1, step=20, consumed_samples=80, loss=1.0, step_time_seconds=0.1, tokens_per_second=1.0)
    assert sup.allowed_silence(h) == 620.0  # no Alive (an older worker): the step decides
    h.last_alive = Alive(epoch=1, phase="checkpoint")
    assert sup.allowed_silence(h) == 620.0  # saving
    h.last_alive = Alive(epoch=1, phase="step")  # in the next step, no step limit yet
    assert sup.allowed_silence(h) == 20.0
    sup.synchronous_saves = False  # an asynchronous save's blocking part is a copy: no grace
    h.last_alive = Alive(epoch=1, phase="checkpoint")
    assert sup.allowed_silence(h) == 20.0
