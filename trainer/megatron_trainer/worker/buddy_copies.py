"""Host copies of the distributed optimizer's shards: this rank's own snapshot, and the copy it keeps
for its *ward* (the rank whose buddy it is, ``MeshPlan.buddy_of``; on another pod).

A refresh copies this rank's flat shards (worker/optimizer_shards.py) to host memory and exchanges
them point to point: this rank's snapshot to its buddy, its ward's into this rank's memory. It is
started after an optimizer step and runs beside the steps that follow: on GPU the copy to pinned
host memory runs on a side stream (the shards are a copy already, so the next optimizer step need
not wait for it), and the exchange after it (below). It is finished (waited for) only when the next
refresh is due or the epoch is left; in between the training loop asks whether it is done
(:meth:`BuddyCopies.poll`). Only a finished refresh counts as a complete copy. Two generations are
kept, so while a refresh is in flight the previous complete one is still whole: a failure then goes
back to it (the plan says how many steps are redone). The host memory this takes per pod is
``megatron_contract.host_memory.pod_copy_bytes``.

The training loop (worker/training_loop.py) refreshes after every ``replicaIntervalSteps``-th step
when the plan asks for buddies. Two transports:

- **On GPU (the epoch's world group is NCCL)** the shards go GPU to GPU over NCCL, the link a job's
  collectives already use (NVLink, InfiniBand): batched sends and receives on the world group,
  enqueued on the side stream in chunks of at most :data:`CHUNK_ELEMENTS`, the ward's received into
  two GPU staging buffers of that size in turn, each chunk copied out to the ward's pinned host copy
  on a stream of its own, so a transfer waits for the copy out of the chunk two before it, not the
  last one (on one 2xH200 machine this cut what a refresh costs the step beside it from 49.5-60.0 ms
  to 14.4-48.3 ms, the two alternating; benchmarks/README.md). The flat shards are assembled on the
  side stream too (:meth:`BuddyCopies.assemble`), beside the next step's compute; that step's
  optimizer update waits for it on the GPU (:meth:`BuddyCopies.hold_update`). Nothing waits on the
  host: the refresh is done when a CUDA event at the end of the side stream is. Shards move as they
  lie in memory, column after column (``optimizer_shards.columns_of``); the host copies are laid out
  the same way. On 2xH200 with a 1.1 B-parameter GPT (6.6 GB shards, 13.4 GB into host memory per
  refresh) a refresh keeps the side stream 0.31-0.32 s (assembly 0.004 s, own snapshot 0.13-0.14 s
  at 55 GB/s, exchange and the ward's copy 0.17-0.18 s) and the training thread ~3-5 ms, whatever
  the step's length, and the step beside it slows by 22-38 ms (measured inside an epoch, with one
  staging buffer, on another machine than the figures above): +9.57-10.73 % of a 0.36 s step,
  +2.17-2.67 % of a 1.2 s step, +0.84 % of a 2.5 s step. Taken apart
  (benchmarks/refresh_interference.py): the NCCL transfers ~11 ms (on fewer CTAs they run longer and
  cost more), the copies to host memory ~6 ms, the ward's chunks each waiting for the copy out of
  one staging buffer ~8 ms (two in turn: 3-4 ms less); no setting tried brought a refresh of the
  whole shard under ~15 ms at this size. Over gloo, every 4 steps cost +269 % (2xH100). The world
  group carries no per-step collective, so the transfers wait for nothing of the step's. A sender
  ends its transfers with a token (the step); the receiver counts the copy complete only when the
  token arrived: after a communicator abort (a peer died) the pending receives end without data, and
  the token tells such a copy from a whole one.
- **On CPU, or without NCCL,** host memory moves on gloo connections of its own, one per pair of
  ranks that exchange (:func:`exchange_links`), made with the epoch's groups, on a thread of its
  own: its point-to-point traffic never interleaves with the training collectives. Pairs, not a
  world group: gloo connects every pair of a group's ranks, so a world group would hold a connection
  to every rank of the job where a rank talks to two. They are bare gloo backends on the epoch's
  store, not torch groups: ``new_group`` names a group made by its members alone from how many
  groups each member already has, which differs along a ring of buddies. The GPU transport uses them
  too, once an epoch, for the shards' shapes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megatron_contract.host_memory import BUDDY_GENERATIONS
from megatron_contract.mesh import MeshPlan
from megatron_trainer.worker.optimizer_shards import columns_of, rows_of
from megatron_trainer.worker.refresh_times import RefreshLog, RefreshTimes, Stamp, seconds

#: Generations kept: the newest complete copy survives a refresh in flight.
GENERATIONS = BUDDY_GENERATIONS

#: How often a refresh's wait looks at its stop condition.
_STOP_POLL_SECONDS = 0.01

#: Tags of the shape exchange, past those of the shards (one per shard, from 0).
_SHAPES_TAG = 1 << 20

#: Elements of one NCCL transfer of the GPU transport, and of its staging buffer (256 MiB of fp32).
CHUNK_ELEMENTS = 64 << 20

#: How often a wait for the GPU transport's end looks at its CUDA event.
_EVENT_POLL_SECONDS = 0.001

#: How long settling a refresh waits for its exchange's thread to return after it said done.
_THREAD_END_SECONDS = 5.0


#: Streams per device and role for the process's life: the caching allocator keeps a stream's freed
#: blocks for that stream, so a stream per epoch would strand a staging buffer at every re-mesh.
_STREAMS: dict[tuple[torch.device, str], Any] = {}


def _side_stream(device: torch.device, role: str = "side") -> Any:
    """The refresh's side stream (``side``), or the one that copies received chunks out (``out``)."""
    if (device, role) not in _STREAMS:
        _STREAMS[device, role] = torch.cuda.Stream(device=device)
    return _STREAMS[device, role]


def _fits(
    buffers: tuple[list[torch.Tensor], list[torch.Tensor]],
    shards: Sequence[torch.Tensor],
    ward_shapes: list[torch.Size],
    pinned: bool,
) -> bool:
    """Whether host ``buffers`` (own, ward) can take a refresh of ``shards`` and the ward's (all
    of them the shards' memory, ``optimizer_shards.columns_of``)."""
    own, ward = buffers
    return (
        [t.shape for t in own] == [s.shape for s in shards]
        and [t.shape for t in ward] == list(ward_shapes)
        and all(t.dtype == s.dtype for t, s in zip(own, shards, strict=True))
        and all(t.is_pinned() == pinned for t in (*own, *ward))
    )


def _chunks(flat: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``flat`` of at most :data:`CHUNK_ELEMENTS` each, in order."""
    return [flat[i : i + CHUNK_ELEMENTS] for i in range(0, flat.numel(), CHUNK_ELEMENTS)]


@dataclasses.dataclass
class _Generation:
    step: int
    own: list[torch.Tensor]  # this rank's shards' memory (optimizer_shards.columns_of), on the host
    ward: list[torch.Tensor]  # the ward's
    complete: bool = False


@dataclasses.dataclass
class _Exchange:
    """The transfers of the refresh in flight, run by a thread of their own: gloo's works do not say
    when they completed, and a wait with a timeout closes the connection when it expires."""

    received: threading.Event = dataclasses.field(default_factory=threading.Event)  # the ward's copy arrived
    done: threading.Event = dataclasses.field(default_factory=threading.Event)  # every transfer ended
    errors: list[RuntimeError] = dataclasses.field(default_factory=list)
    exchange_s: float | None = None  # the transfers' time, once done
    thread: threading.Thread | None = None


class _Ended:
    """``threading.Event``'s ``is_set``/``wait`` over a CUDA event (polled: a blocking
    synchronize could not be given up, and would spin a core)."""

    def __init__(self, event: Any, whole: Callable[[], bool] = lambda: True) -> None:
        self._event, self._whole = event, whole

    def is_set(self) -> bool:
        return bool(self._event.query()) and self._whole()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._event.query():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(_EVENT_POLL_SECONDS)
        return self._whole()


class _DeviceExchange:
    """The GPU transport's refresh in flight: its transfers and copies are queued on the side
    stream; ``done`` when they all ended, ``received`` when the ward's copy is whole (its token came:
    see the module's docstring)."""

    def __init__(self, step: int, end: Any, token: torch.Tensor, keep: list[Any]) -> None:
        self.step, self._token, self._keep = step, token, keep  # keep: the transfers' tensors, until done
        self.end = end
        self.done = _Ended(end)
        # No reference back to self (a bound method would make a cycle, which only the cyclic
        # collector frees: the shards' GPU memory then outlived the refresh, ~a copy each refresh).
        self.received = _Ended(end, partial(_token_is, token, step))

    @property
    def errors(self) -> list[RuntimeError]:
        if not self.done.is_set() or _token_is(self._token, self.step):
            return []
        got = int(self._token.item())
        return [RuntimeError(f"the ward's copy of step {self.step} did not arrive whole (token {got}): aborted")]


def _token_is(token: torch.Tensor, step: int) -> bool:
    return int(token.item()) == step


class BuddyCopies:
    """This rank's generations of host copies, and the refresh in flight."""

    def __init__(
        self,
        rank: int,
        buddy: int,
        ward: int,
        generations: int = GENERATIONS,
        links: tuple[PairLink, PairLink] | None = None,
        over_nccl: bool = True,
        recycled: Sequence[tuple[list[torch.Tensor], list[torch.Tensor]]] = (),
    ) -> None:
        """``links``: the connections to the buddy and from the ward (None: the default group);
        ``over_nccl``: send GPU shards over the world group where it is NCCL (False: over the links);
        ``recycled``: host buffers (own, ward) of the previous epoch's copies (:meth:`buffers`), used
        by the first refreshes where their shapes fit: pinning a 1 B model's shards anew takes the
        main thread seconds at every re-mesh."""
        if rank in (buddy, ward):
            raise ValueError(f"rank {rank} cannot keep its own copy (buddy {buddy}, ward {ward})")
        if generations < 2:
            raise ValueError("two generations at least: the previous copy must survive a refresh in flight")
        self.rank, self.buddy, self.ward = rank, buddy, ward
        self._links = links
        self._over_nccl = over_nccl
        self._limit = generations
        self._recycled = list(recycled)
        self._generations: list[_Generation] = []  # oldest first
        self._exchange: _Exchange | _DeviceExchange | None = None
        self._lock = threading.Lock()  # the links against abandon(), for the exchange's thread
        self._closed = False
        self._ward_shapes: list[torch.Size] | None = None  # learnt at the first refresh
        self._stream: Any = None  # the side stream of the copies to host memory (GPU shards)
        self.times = RefreshLog()  # the finished refreshes' times
        self._timing: tuple[RefreshTimes, list[Any]] | None = None  # the refresh in flight's, its events
        self._reads: Any = None  # the side stream's event after its assembly read the optimizer's state
        self._assembled = 0.0  # when the training thread had queued the assembly (perf_counter)

    def assemble(self, make: Callable[[], Sequence[torch.Tensor]], device: torch.device) -> Sequence[torch.Tensor]:
        """The shards of the next refresh, from ``make`` (which reads the optimizer's state). On GPU it
        runs on the side stream, after what the current stream has queued, so the next step's compute
        need not wait for it; the optimizer's next update must then wait (:meth:`hold_update`)."""
        if device.type != "cuda":
            shards = make()
        else:
            self._stream = self._stream or _side_stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                shards = make()
            self._reads = torch.cuda.Event(enable_timing=True)
            self._reads.record(self._stream)
        self._assembled = time.perf_counter()
        return shards

    def hold_update(self, device: torch.device) -> None:
        """Before the optimizer updates its state: the current stream waits (on the GPU, the host does
        not) until the assembly of :meth:`assemble` has read it."""
        if self._reads is not None and device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(self._reads)
        self._reads = None

    def start_refresh(self, step: int, shards: Sequence[torch.Tensor], began: Stamp | None = None) -> None:
        """Copy ``shards`` (this rank's, after ``step`` steps; the caller's to give up, the copy may
        still read them) to host memory and start exchanging: every rank of the world calls this for
        the same step (sends and receives pair up). ``began``: when the caller started assembling
        ``shards`` (for :attr:`times`)."""
        if self._exchange is not None:
            raise RuntimeError(f"rank {self.rank}: a refresh is still in flight")
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: the copies were abandoned with their epoch")
        if self._generations and step <= self._generations[-1].step:
            raise ValueError(f"refresh of step {step} after one of step {self._generations[-1].step}")
        shards = [columns_of(s) for s in shards]  # moved whole as they lie in memory (views of materialize's)
        if self._ward_shapes is None:
            self._ward_shapes = self._exchange_shapes(shards)
        if len(self._generations) >= self._limit:
            oldest = self._generations.pop(0)
            reuse: tuple[list[torch.Tensor], list[torch.Tensor]] | None = (oldest.own, oldest.ward)
        else:
            reuse = self._recycled.pop() if self._recycled else None
        pin = torch.cuda.is_available() and any(s.is_cuda for s in shards)
        device = next((s.device for s in shards if s.is_cuda), None) if pin else None
        began = began or Stamp(device)
        assembled = self._reads if self._reads is not None else Stamp(device).event
        if reuse is not None and _fits(reuse, shards, self._ward_shapes, pin):
            own, ward = reuse
        else:
            self._recycled.clear()  # another layout: none of them fits
            own = [torch.empty(s.shape, dtype=s.dtype, pin_memory=pin) for s in shards]
            dtype = shards[0].dtype if shards else torch.float32
            ward = [torch.empty(shape, dtype=dtype, pin_memory=pin) for shape in self._ward_shapes]
        copied = self._copy_to_host(own, shards) if pin else None
        if not pin:
            for host, shard in zip(own, shards, strict=True):
                host.copy_(shard)
        self._generations.append(_Generation(step, own, ward))
        end = None  # the GPU transport's last event; the gloo thread times its exchange itself
        if pin and self._over_nccl and dist.is_initialized() and dist.get_backend() == "nccl":
            device_exchange = self._send_on_device(step, shards, ward)
            self._exchange, end = device_exchange, device_exchange.end
        else:
            self._exchange = exchange = _Exchange()
            exchange.thread = threading.Thread(
                target=self._transfer, args=(exchange, copied, own, ward), name="buddy-copies", daemon=True
            )
            exchange.thread.start()
        to_host = sum(t.numel() * t.element_size() for t in (*own, *ward))
        now = time.perf_counter()
        queued = now - max(self._assembled, began.host)
        times = RefreshTimes(step=step, bytes_to_host=to_host, host_s=now - began.host, queue_s=queued)
        self._timing = (times, [began.event, assembled, copied, end])

    def _send_on_device(self, step: int, shards: Sequence[torch.Tensor], ward: list[torch.Tensor]) -> _DeviceExchange:
        """Queue the GPU transport's refresh on the side stream, after the snapshot's copy to host
        memory: this rank's ``shards`` to its buddy and its ward's into ``ward`` (pinned), chunk by
        chunk into two staging buffers in turn, then the tokens. Each received chunk is copied out to
        ``ward`` on a stream of its own (:func:`_side_stream`), so the next transfer waits only for
        the copy out of the chunk two before it (in the same buffer), not of the last one. Called on the main
        thread, so that every rank queues its transfers on the world group in the same order as its
        other work there."""
        sends = [piece for s in shards for piece in _chunks(s.view(-1))]
        lands = [piece for t in ward for piece in _chunks(t.view(-1))]
        device = next(s.device for s in shards if s.is_cuda)
        outs = _side_stream(device, "out")
        token = torch.full((1,), -1, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(self._stream):  # the transfers start after what it holds, and it waits for them
            size = max((p.numel() for p in lands), default=0)
            dtype = ward[0].dtype if ward else torch.float32
            stagings = [torch.empty(size, dtype=dtype, device=device) for _ in range(min(2, len(lands)))]
            freed: list[Any] = [None] * len(stagings)  # each buffer's last copy out
            for staging in stagings:
                staging.record_stream(outs)  # not reused before the copies out of it are done
            for i in range(max(len(sends), len(lands))):
                ops = [dist.P2POp(dist.isend, sends[i], self.buddy)] if i < len(sends) else []
                if i < len(lands):
                    into = stagings[i % 2][: lands[i].numel()]
                    if freed[i % 2] is not None:
                        self._stream.wait_event(freed[i % 2])
                    ops.append(dist.P2POp(dist.irecv, into, self.ward))
                for work in dist.batch_isend_irecv(ops):
                    work.wait()  # the side stream waits for NCCL's; the host does not
                if i < len(lands):
                    outs.wait_stream(self._stream)
                    with torch.cuda.stream(outs):
                        lands[i].copy_(into, non_blocking=True)
                        freed[i % 2] = torch.cuda.Event()
                        freed[i % 2].record(outs)
            self._stream.wait_stream(outs)  # the end below covers the copies out
            mine = torch.full((1,), step, dtype=torch.int64, device=device)
            theirs = torch.full((1,), -1, dtype=torch.int64, device=device)
            ops = [dist.P2POp(dist.isend, mine, self.buddy), dist.P2POp(dist.irecv, theirs, self.ward)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            token.copy_(theirs, non_blocking=True)
            end = torch.cuda.Event(enable_timing=True)
            end.record(self._stream)
        return _DeviceExchange(step, end, token, [sends, stagings, mine, theirs])

    def _copy_to_host(self, own: list[torch.Tensor], shards: Sequence[torch.Tensor]) -> Any:
        """Start copying GPU ``shards`` into pinned ``own`` on the side stream, after what the
        current stream has queued (the step that made them); returns the event of its end."""
        device = next(s.device for s in shards if s.is_cuda)
        if self._stream is None:
            self._stream = _side_stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            for host, shard in zip(own, shards, strict=True):
                host.copy_(shard, non_blocking=True)
                shard.record_stream(self._stream)  # its memory is not reused before the copy is done
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return event

    def _transfer(self, exchange: _Exchange, copied: Any, own: list[torch.Tensor], ward: list[torch.Tensor]) -> None:
        """The exchange's thread: once the snapshot is in host memory, send it and receive the
        ward's; ends when every transfer did or one failed (a dead peer, or links let go).

        Its gloo works are freed here, before ``done`` is set: a work freed later, while the
        process group is destroyed or the interpreter exits, ended the process with ``terminate``."""
        receives: list[dist.Work] = []
        sends: list[dist.Work] = []
        try:
            if copied is not None:
                copied.synchronize()  # the snapshot is whole before it is sent
            began = time.perf_counter()
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"rank {self.rank}: the copies were abandoned with their epoch")
                receives = [self._recv(t, i) for i, t in enumerate(ward)]
                sends = [self._send(t, i) for i, t in enumerate(own)]
            while receives:  # popped: no variable keeps a work past its wait
                receives.pop(0).wait()
            exchange.received.set()
            while sends:
                sends.pop(0).wait()
            exchange.exchange_s = time.perf_counter() - began
        except RuntimeError as err:
            exchange.errors.append(err)
        finally:
            receives.clear()  # after a failure: the works not waited for
            sends.clear()
            exchange.done.set()

    def _exchange_shapes(self, shards: Sequence[torch.Tensor]) -> list[torch.Size]:
        """Send the buddy the shapes of this rank's shards and receive the ward's (once per epoch,
        blocking): a ward at another model-parallel position (one replica over several pods) has
        shards of other sizes, and maybe another number of them."""
        mine = torch.tensor([len(shards), *(n for s in shards for n in s.shape)], dtype=torch.int64)
        count = torch.zeros(1, dtype=torch.int64)
        sent = [self._send(mine[:1].clone(), _SHAPES_TAG), self._recv(count, _SHAPES_TAG)]
        for request in sent:
            request.wait()
        dims = torch.zeros(2 * int(count.item()), dtype=torch.int64)
        sent = [self._send(mine[1:].clone(), _SHAPES_TAG + 1), self._recv(dims, _SHAPES_TAG + 1)]
        for request in sent:
            request.wait()
        return [torch.Size(pair) for pair in dims.view(-1, 2).tolist()]

    def _send(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        work = self._links[0].send(tensor, tag) if self._links else dist.isend(tensor, self.buddy, tag=tag)
        assert work is not None  # None only for a rank outside the group, never the world's
        return work

    def _recv(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        work = self._links[1].recv(tensor, tag) if self._links else dist.irecv(tensor, self.ward, tag=tag)
        assert work is not None
        return work

    def finish_refresh(self, stop: Callable[[], bool] | None = None) -> None:
        """Wait for the refresh in flight; its generation is then complete. Raises the exchange's
        error (RuntimeError) when it failed; the refresh then stays in flight (for :meth:`salvage`).

        ``stop``: polled while waiting; once true the wait ends with RuntimeError (a newer plan
        interrupted the epoch, whose buddy may be dead: gloo would wait out its timeout). The
        exchange's thread ends when the links are let go (:meth:`abandon`) or gloo times out."""
        exchange = self._exchange
        if exchange is None:
            return
        began = time.perf_counter()
        while not exchange.done.wait(_STOP_POLL_SECONDS):
            if stop is not None and stop():
                raise RuntimeError(f"rank {self.rank}: refresh of step {self._generations[-1].step} interrupted")
        if self._timing is not None:
            self._timing[0].waited_s = time.perf_counter() - began
        self._settle(exchange)

    def poll(self) -> bool:
        """Without waiting: True when the refresh in flight has just finished (it is then complete).
        Raises like :meth:`finish_refresh` when its exchange failed."""
        exchange = self._exchange
        if exchange is None or not exchange.done.is_set():
            return False
        self._settle(exchange)
        return True

    def _settle(self, exchange: _Exchange | _DeviceExchange) -> None:
        if isinstance(exchange, _Exchange) and exchange.thread is not None:
            exchange.thread.join(_THREAD_END_SECONDS)  # done is set: it is returning, its works freed
        if exchange.errors:
            raise exchange.errors[0]
        self._exchange = None
        self._generations[-1].complete = True
        if self._timing is not None:
            times, (began, assembled, copied, end) = self._timing
            self._timing = None
            times.assemble_s = seconds(began, assembled)
            times.own_copy_s = seconds(assembled, copied)
            if isinstance(exchange, _Exchange):
                times.exchange_s = exchange.exchange_s
            else:
                times.exchange_s = seconds(copied, end)
                times.total_s = seconds(began, end)
            self.times.add(times)

    def agree(self, value: int, stop: Callable[[], bool]) -> int:
        """The largest ``value`` of every rank of the world (each calls this after the same step): an
        all-reduce on the epoch's world group. Where that is NCCL it is queued on the side stream,
        after the refreshes queued there, so that every rank's work on the world group keeps one
        order; the host waits for it, polling ``stop`` (RuntimeError once true: a peer may be dead)."""
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: the copies were abandoned with their epoch")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            self._stream = self._stream or _side_stream(device)
            found = torch.empty(1, dtype=torch.int64, pin_memory=True)
            with torch.cuda.stream(self._stream):
                largest = torch.full((1,), value, dtype=torch.int64, device=device)
                dist.all_reduce(largest, op=dist.ReduceOp.MAX)
                found.copy_(largest, non_blocking=True)
                end = torch.cuda.Event()
                end.record(self._stream)
            done: Callable[[float], bool] = _Ended(end).wait
        else:
            found = torch.full((1,), value, dtype=torch.int64)
            work = dist.all_reduce(found, op=dist.ReduceOp.MAX, async_op=True)
            assert work is not None

            def done(timeout: float) -> bool:
                if not work.is_completed():
                    time.sleep(timeout)
                    return False
                work.wait()  # raises the collective's error
                return True

        while not done(_STOP_POLL_SECONDS):
            if stop():
                raise RuntimeError(f"rank {self.rank}: agreeing on the refresh interval interrupted")
        agreed = int(found.item())
        if stop() or agreed < value:  # an abort ends the collective with whatever its buffer held
            raise RuntimeError(f"rank {self.rank}: agreeing on the refresh interval aborted (got {agreed})")
        return agreed

    def buffers(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """The host buffers (own, ward) of the complete copies, for the next epoch's copies to fill
        (``recycled``) once nothing reads these any more: no copy is in flight into them."""
        return [(g.own, g.ward) for g in self._generations if g.complete]

    def host_bytes(self) -> int:
        """Bytes of host memory the copies hold (every generation, own and ward's)."""
        return sum(t.numel() * t.element_size() for g in self._generations for t in (*g.own, *g.ward))

    def salvage(self, timeout: timedelta) -> bool:
        """After a failure, before :meth:`abandon`: the refresh in flight is complete for this rank
        if its ward's copy arrives within ``timeout`` (its own snapshot is whole once it was sent;
        what its buddy received is the buddy's to say). A ward that died after sending, in the step
        after the refresh, was usually received long before: with one step between refreshes no
        completed step is lost. Never raises; True when the refresh completed."""
        exchange = self._exchange
        if exchange is None or not exchange.received.wait(timeout.total_seconds()):
            return False  # none in flight, or not all arrived: the ward died or hung before sending
        self._exchange = self._timing = None
        self._generations[-1].complete = True
        return True

    def abandon(self) -> None:
        """Give up the refresh in flight (its exchange failed, or the epoch is left): its generation
        is dropped, the complete ones stay. The links are let go (freeing them closes their
        connections): no refresh can start after this."""
        with self._lock:
            self._links = None
            self._closed = True
        self._exchange = self._timing = None
        if self._generations and not self._generations[-1].complete:
            self._generations.pop()

    @property
    def in_flight(self) -> bool:
        return self._exchange is not None

    def complete_steps(self) -> list[int]:
        """Steps of the complete copies this rank holds, newest first (what its agent reports)."""
        return [g.step for g in reversed(self._generations) if g.complete]

    def own(self, step: int) -> list[torch.Tensor]:
        """This rank's complete snapshot of ``step``: its flat shards (views of host memory)."""
        return [rows_of(t) for t in self._complete(step).own]

    def ward_copy(self, step: int) -> list[torch.Tensor]:
        """The ward's complete copy of ``step``: its flat shards (views of host memory)."""
        return [rows_of(t) for t in self._complete(step).ward]

    def _complete(self, step: int) -> _Generation:
        for g in self._generations:
            if g.step == step and g.complete:
                return g
        raise KeyError(f"rank {self.rank} holds no complete copy of step {step} (it has {self.complete_steps()})")


def ward_of(buddies: Sequence[int]) -> list[int]:
    """By rank, the rank whose buddy it is (the inverse of the buddy permutation)."""
    ward = [-1] * len(buddies)
    for rank, buddy in enumerate(buddies):
        if not 0 <= buddy < len(buddies) or ward[buddy] != -1:
            raise ValueError(f"the buddies are not a permutation of the ranks: {list(buddies)}")
        ward[buddy] = rank
    return ward


@dataclasses.dataclass(frozen=True)
class PairLink:
    """A gloo connection between two ranks: this rank's end."""

    backend: Any  # a dist.ProcessGroupGloo; torch's stubs omit the send and recv it binds
    peer: int  # the other rank's index in the pair (0 or 1)

    def send(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        return self.backend.send([tensor], self.peer, tag)

    def recv(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        return self.backend.recv([tensor], self.peer, tag)


def exchange_links(
    store: dist.Store, rank: int, buddy: int, ward: int, timeout: timedelta
) -> tuple[PairLink, PairLink]:
    """Connections to ``buddy`` and from ``ward`` (one when they are the same rank), through the
    epoch's ``store``. Making one waits for its other rank, so every rank makes its pairs in the order
    of the pairs' ranks, the same on every rank: no ring of ranks waits for each other."""
    to_buddy, from_ward = (min(rank, buddy), max(rank, buddy)), (min(ward, rank), max(ward, rank))
    made = {}
    for pair in sorted({to_buddy, from_ward}):
        prefixed = dist.PrefixStore(f"buddy-copies/{pair[0]}-{pair[1]}/", store)
        made[pair] = PairLink(dist.ProcessGroupGloo(prefixed, pair.index(rank), 2, timeout), 1 - pair.index(rank))
    return made[to_buddy], made[from_ward]


def buddy_and_ward(plan: MeshPlan, rank: int) -> tuple[int, int] | None:
    """``rank``'s buddy and ward in ``plan``; None when the plan keeps no buddy copies."""
    state = plan.optimizer_state
    if state is None or not state.buddies:
        return None
    buddies: list[int] = []
    for r in range(plan.sizes.world):
        buddy = plan.buddy_of(r)
        if buddy is None:
            return None  # one pod: no buddy (a valid plan then says buddies false)
        buddies.append(buddy)
    return buddies[rank], ward_of(buddies)[rank]
