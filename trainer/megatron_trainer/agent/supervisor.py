"""Worker processes: spawn one per local slot, read their channels, notice exits and hangs.

Each worker gets its own socketpair (a worker killed mid-write must not jam the others, as it
does a shared queue). The agent's end is read with asyncio, so a stopped or slow worker never blocks
the control port. A worker is dead when its channel hits EOF and its exit code is collected; it
is hung when it has sent nothing for longer than the hang timeout while training (or, if it
speaks Alive, while it joins an epoch or waits), and then the supervisor kills it (SIGKILL works
on a SIGSTOPped process too). A worker's watchdog thread sends
:class:`~megatron_trainer.channel.Alive` several times a second; while the last one gives a
progress limit and no data read or save, a silence of twice that limit (at least
:data:`STOPPED_MIN_SILENCE_SECONDS`) already means the process is stopped, so a stopped worker is
killed, and its pod reported, within seconds rather than after the collective timeout. What to do
about either is the agent's decision, through the callbacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence

from pydantic import TypeAdapter, ValidationError

from megatron_contract import wire
from megatron_trainer.agent.lifecycle import WorkerPhase, check_transition
from megatron_trainer.channel import Alive, Progress, ReplicaSteps, Shutdown, ToAgent, ToWorker

log = logging.getLogger(__name__)

#: A worker in a step sends Alive every ~0.25 s: this much silence (or twice its step limit, if
#: more) means it is stopped, not slow. Generous against scheduling hiccups on loaded machines.
STOPPED_MIN_SILENCE_SECONDS = 2.0
STOPPED_LIMIT_MULTIPLE = 2.0
#: How often the supervisor looks for hung workers (at most).
HANG_CHECK_SECONDS = 0.25

_TO_AGENT: TypeAdapter[ToAgent] = TypeAdapter(ToAgent)
# Worker messages are small; a line this long means a broken worker, not a big message.
MAX_WORKER_LINE = 1024 * 1024


@dataclasses.dataclass(eq=False)
class WorkerHandle:
    """One worker process and what the agent knows about it."""

    local_rank: int
    process: asyncio.subprocess.Process
    writer: asyncio.StreamWriter
    generation: int = 0  # restarts of this local slot before this process
    phase: WorkerPhase = WorkerPhase.STARTING
    hello: bool = False
    last_seen: float = dataclasses.field(default_factory=time.monotonic)
    progress: Progress | None = None
    last_alive: Alive | None = None  # the worker watchdog's last word
    replica_steps: ReplicaSteps | None = None  # the buddy copies it last said it holds
    exit_code: int | None = None
    kill_reason: str | None = None
    pump: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.process.pid

    @property
    def alive(self) -> bool:
        """Whether the process has not been reaped yet."""
        return self.exit_code is None

    def move_to(self, phase: WorkerPhase) -> None:
        """Change phase through the checked transition table."""
        self.phase = check_transition(self.phase, phase)

    def send(self, message: ToWorker) -> bool:
        """Queue a message for the worker; False when its channel is already closed.

        Never waits: a stopped worker must not block the agent, and the transport buffers.
        """
        if self.writer.is_closing() or not self.alive:
            return False
        try:
            self.writer.write((json.dumps(message.to_wire()) + "\n").encode())
        except (ConnectionError, RuntimeError) as err:
            log.warning("worker %d: cannot send %s: %s", self.local_rank, message.type, err)
            return False
        return True


def silence_allowed(
    hang_timeout_seconds: float,
    last_step: int | None,
    checkpoint_interval_steps: int | None,
    checkpoint_grace_seconds: float,
    synchronous_saves: bool = True,
    final_step: int | None = None,
) -> float:
    """How long a training worker may stay silent after its last message.

    Workers save a checkpoint right after reporting a step that is a multiple of the checkpoint
    interval. A synchronous save (``asyncSave: false``) and the final save at the end of training
    (``final_step``) wait for the write (a 1 B model took ~22 s on 4xH200); a silence then is a
    save, not a hang, and gets the save's grace on top. An asynchronous save holds the step only
    for the device-to-host copy, which the hang timeout covers: a worker stopped in one is killed
    after the hang timeout, not after the grace (a chaos run's job, both of whose workers were
    stopped in a save, waited out the 600 s grace).
    """
    saving = (
        checkpoint_interval_steps is not None
        and last_step is not None
        and last_step > 0
        and last_step % checkpoint_interval_steps == 0
        and (synchronous_saves or last_step == final_step)
    )
    return hang_timeout_seconds + (checkpoint_grace_seconds if saving else 0.0)


def stopped_silence(alive: Alive | None) -> float | None:
    """How long a worker whose last :class:`Alive` is ``alive`` may be silent before it counts as
    stopped; None when that says nothing (no Alive, no progress limit, or in a data read or a save,
    which may hold the interpreter lock for long: the hang timeout decides). Between two steps
    counts like a step: the last Alive before a stop is as likely to fall there."""
    if alive is None or alive.phase in ("data", "checkpoint") or alive.step_limit_seconds is None:
        return None
    return max(STOPPED_MIN_SILENCE_SECONDS, STOPPED_LIMIT_MULTIPLE * alive.step_limit_seconds)


MessageHandler = Callable[[WorkerHandle, ToAgent], None]
ExitHandler = Callable[[WorkerHandle], None]


class WorkerSupervisor:
    """Spawns and watches the pod's workers."""

    def __init__(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        hang_timeout_seconds: float,
        on_message: MessageHandler,
        on_exit: ExitHandler,
        checkpoint_interval_steps: int | None = None,
        checkpoint_grace_seconds: float = 0.0,
        synchronous_saves: bool = True,
        final_step: int | None = None,
    ) -> None:
        self.command = tuple(command)
        self.env = dict(env)
        self.hang_timeout_seconds = hang_timeout_seconds
        self.checkpoint_interval_steps = checkpoint_interval_steps
        self.checkpoint_grace_seconds = checkpoint_grace_seconds
        self.synchronous_saves = synchronous_saves
        self.final_step = final_step
        self._on_message = on_message
        self._on_exit = on_exit
        self.workers: dict[int, WorkerHandle] = {}
        self._watchdog: asyncio.Task[None] | None = None

    async def spawn(self, local_rank: int, generation: int = 0) -> WorkerHandle:
        """Start the worker of one local slot and begin reading its channel."""
        ours, theirs = socket.socketpair()
        try:
            fd = theirs.fileno()
            process = await asyncio.create_subprocess_exec(
                *self.command,
                "--channel-fd",
                str(fd),
                "--local-rank",
                str(local_rank),
                pass_fds=(fd,),
                env=self.env,
                stdin=asyncio.subprocess.DEVNULL,
                process_group=0,  # the worker leads a group of its own: see the module docstring
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the child holds its copy; ours must go so EOF reaches it when we die
        reader, writer = await asyncio.open_unix_connection(sock=ours, limit=MAX_WORKER_LINE)
        handle = WorkerHandle(local_rank=local_rank, process=process, writer=writer, generation=generation)
        self.workers[local_rank] = handle
        handle.pump = asyncio.create_task(self._pump(handle, reader), name=f"worker-{local_rank}")
        log.info("worker %d started (pid %d, generation %d)", local_rank, process.pid, generation)
        return handle

    async def _pump(self, handle: WorkerHandle, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    log.error(
                        "worker %d sent a line over %d bytes; closing its channel", handle.local_rank, MAX_WORKER_LINE
                    )
                    break
                except ConnectionError:
                    break
                if not line:
                    break  # EOF: the worker exited (or closed its end)
                try:
                    message = _TO_AGENT.validate_json(line)
                except ValidationError as err:
                    log.warning("worker %d: unreadable message %r: %s", handle.local_rank, line[:200], err)
                    continue
                handle.last_seen = time.monotonic()
                try:
                    self._on_message(handle, message)
                except Exception:
                    log.exception("worker %d: handling %s failed", handle.local_rank, message.type)
        finally:
            handle.exit_code = await handle.process.wait()
            signal_group(handle.pid, signal.SIGKILL)  # children the worker left behind
            handle.writer.close()
            log.log(
                logging.INFO if handle.exit_code == 0 else logging.WARNING,
                "worker %d (pid %d) exited with %d%s",
                handle.local_rank,
                handle.pid,
                handle.exit_code,
                f" ({handle.kill_reason})" if handle.kill_reason else "",
            )
            self._on_exit(handle)

    # -- hangs -----------------------------------------------------------------------------------

    def allowed_silence(self, handle: WorkerHandle) -> float:
        """Seconds ``handle`` may stay silent while training (see :func:`silence_allowed` and
        :func:`stopped_silence`)."""
        alive = handle.last_alive
        if alive is not None and alive.phase != "checkpoint":
            # A worker that speaks Alive says when it saves: the save's grace is for a save, not for
            # every silence after a step that is a multiple of the interval (a worker stopped in
            # the next step waited out the 600 s grace in a chaos run).
            allowed = self.hang_timeout_seconds
        else:
            allowed = silence_allowed(
                self.hang_timeout_seconds,
                handle.progress.step if handle.progress is not None else None,
                self.checkpoint_interval_steps,
                self.checkpoint_grace_seconds,
                self.synchronous_saves,
                self.final_step,
            )
        stopped = stopped_silence(alive)
        return allowed if stopped is None else min(allowed, stopped)

    def find_hung(self, now: float) -> list[WorkerHandle]:
        """Workers silent for longer than they may be: training ones past their allowed silence; one
        that says Alive (a real worker's watchdog does in every live state) past the hang timeout
        while it joins an epoch, waits as a spare or waits for a plan, since a worker stopped in a
        join holds up its peers' rendezvous for ever while its agent still reports."""
        return [
            h
            for h in self.workers.values()
            if h.alive
            and h.kill_reason is None
            and (
                (h.phase is WorkerPhase.TRAINING and now - h.last_seen > self.allowed_silence(h))
                or (
                    h.phase in (WorkerPhase.RECONFIGURING, WorkerPhase.SPARE)
                    and h.last_alive is not None
                    and now - h.last_seen > self.hang_timeout_seconds
                )
            )
        ]

    def kill(self, handle: WorkerHandle, reason: str) -> None:
        """SIGKILL a worker; its exit is reported through the exit callback like any other."""
        if not handle.alive:
            return
        handle.kill_reason = reason
        log.warning("killing worker %d (pid %d): %s", handle.local_rank, handle.pid, reason)
        signal_group(handle.pid, signal.SIGKILL)

    def start_watchdog(self, on_hung: Callable[[WorkerHandle, float], None]) -> None:
        """Check for hung workers several times per hang timeout."""

        async def watch() -> None:
            period = min(HANG_CHECK_SECONDS, self.hang_timeout_seconds / 5)
            while True:
                await asyncio.sleep(period)
                now = time.monotonic()
                for handle in self.find_hung(now):
                    on_hung(handle, now - handle.last_seen)

        self._watchdog = asyncio.create_task(watch(), name="hang-watchdog")

    # -- shutdown --------------------------------------------------------------------------------

    async def shutdown(self, reason: str, grace_seconds: float) -> None:
        """Ask every live worker to finish, then SIGTERM, then SIGKILL whoever is left."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        live = [h for h in self.workers.values() if h.alive]
        for handle in live:
            handle.send(Shutdown(reason=reason))
        for sig, wait in ((None, grace_seconds), (signal.SIGTERM, grace_seconds / 2), (signal.SIGKILL, 5.0)):
            live = [h for h in live if h.alive]
            if not live:
                break
            if sig is not None:
                for handle in live:
                    signal_group(handle.pid, sig)
            pumps = [h.pump for h in live if h.pump is not None]
            await asyncio.wait(pumps, timeout=wait)
        for handle in self.workers.values():
            if handle.pump is not None and not handle.pump.done():
                handle.pump.cancel()


def signal_group(leader: int, sig: int) -> None:
    """Send ``sig`` to the process group a worker leads (its pid is the group's id); nothing when
    the group is gone. The group id cannot be reused while any member lives, so this never hits a
    stranger."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, sig)


def worker_environment(base: Mapping[str, str], spec_json: str, pod_name: str) -> dict[str, str]:
    """The workers' environment: the agent's own plus the spec and pod name the worker reads.

    Like torchrun, one CPU thread per worker for torch's operators unless the pod's environment
    says otherwise (``OMP_NUM_THREADS``): by default each worker would start one per core of the
    node, and the workers of every pod on the node would then fight for the cores, stalling steps
    for seconds (long enough for the hang watchdog). The GPUs do the work."""
    env = dict(base)
    env[wire.ENV_JOB_SPEC] = spec_json
    env[wire.ENV_POD_NAME] = pod_name
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
