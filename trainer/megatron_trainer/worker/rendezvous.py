"""Join an epoch's process groups, or a communicator-free world while waiting as a spare.

An epoch's ranks meet at ``plan.rendezvous``: a TCPStore hosted by an agent (never by a worker,
which may die and take the store with it). Each epoch creates a fresh store client (old clients never
reconnect) wrapped in a ``PrefixStore`` with the epoch's unique prefix, so no key of an old epoch
is ever read. Megatron's ``parallel_state`` is then built on top. NCCL communicators are created
lazily, on a group's first collective, so groups Megatron creates but this trainer never uses
cost nothing.

A spare builds its model inside a *fake* world (torch's ``fake`` backend: groups without any
communicator) of one model-parallel replica, so its modules have the right shapes before it knows
its rank, and it holds no NCCL group until it is promoted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_contract.job import MegatronJobSpec
from megatron_contract.mesh import MeshPlan

log = logging.getLogger(__name__)

# Every wait of a join is cut into slices this long, so that a newer plan stops it promptly: a
# worker blocked for a minute connecting to a store that died with its pod would miss the plan
# that replaced it, and its peers would wait for it.
POLL = timedelta(seconds=0.25)


class Superseded(RuntimeError):
    """A newer plan arrived while this epoch was being joined: the join is abandoned."""


class RendezvousFailed(RuntimeError):
    """The epoch could not be joined. ``store_host`` is set when its store was unreachable,
    ``missing`` holds the ranks that never arrived: whom to suspect, for the operator."""

    def __init__(self, message: str, *, store_host: str | None = None, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.store_host = store_host
        self.missing = tuple(missing)


Interrupted = Callable[[], bool]


def _connect_store(host: str, port: int, deadline_seconds: float, interrupted: Interrupted) -> dist.TCPStore:
    deadline = time.monotonic() + deadline_seconds
    while True:
        if interrupted():
            raise Superseded(f"a newer plan arrived while connecting to the store at {host}:{port}")
        try:
            return dist.TCPStore(host, port, is_master=False, timeout=POLL)
        except (dist.DistError, RuntimeError) as err:
            if time.monotonic() > deadline:
                raise RendezvousFailed(
                    f"the rendezvous store at {host}:{port} was unreachable for {deadline_seconds:.0f}s: {err}",
                    store_host=host,
                ) from err


def wait_for_ranks(
    store: dist.Store, prefix: str, ranks: Sequence[int], deadline_seconds: float, interrupted: Interrupted, what: str
) -> None:
    """Wait until the key ``{prefix}/{rank}`` of every rank exists, in short slices that check
    ``interrupted``.

    Raises:
        Superseded: ``interrupted()`` became true.
        RendezvousFailed: the deadline passed (``missing``: the ranks whose key is absent), or the
            store went away (``store_host`` is set to ``"store"``).
    """
    keys = [f"{prefix}/{r}" for r in ranks]
    deadline = time.monotonic() + deadline_seconds
    while True:
        if interrupted():
            raise Superseded(f"a newer plan arrived while waiting for {what}")
        try:
            store.wait(list(keys), POLL)
            return
        except dist.DistNetworkError as err:
            raise RendezvousFailed(
                f"the rendezvous store went away while waiting for {what}: {err}", store_host="store"
            ) from err
        except (dist.DistError, RuntimeError) as err:
            if time.monotonic() <= deadline:
                continue
            missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
            raise RendezvousFailed(
                f"{len(missing)} of {len(keys)} ranks missing after {deadline_seconds:.0f}s waiting for {what}",
                missing=missing,
            ) from err


def join_spare_world(spec: MegatronJobSpec, local_rank: int) -> None:
    """A world of one model-parallel replica on the fake backend (no communicator, no peer)."""
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = spec.model_parallel * spec.ep  # ep replicas: the expert layers get their share of experts
    dist.init_process_group("fake", store=FakeStore(), rank=local_rank % world, world_size=world)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        context_parallel_size=spec.cp,
        expert_model_parallel_size=spec.ep,
        create_gloo_process_groups=False,
    )


def warm_up_nccl(device: torch.device) -> float:
    """Initialize NCCL in this process once, on a one-rank communicator that is then shut down;
    returns the seconds it took.

    A process pays for its first NCCL communicator once: NCCL's one-time set-up (network
    interfaces and plugins probed, NVML, its kernels loaded) comes on top of the communicator. A
    spare that holds no NCCL group until it is promoted paid it inside its first epoch, where the
    survivors waited for it: the growth's two-rank communicators took 0.4-0.5 s to create on
    2xH200 against well under 0.15 s for a survivor's one-rank ones. A communicator of one rank on a
    private store needs no peer; shutting down a healthy one is quick (the spare must hold none).
    """
    start = time.perf_counter()
    # Any: torch's stubs leave out the backend's collectives.
    pg: Any = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1, dist.ProcessGroupNCCL.Options())
    try:
        t = torch.ones(1024, device=device)
        pg.allreduce([t]).wait()
        pg.broadcast([t]).wait()
        out = torch.empty(1024, device=device)
        pg._allgather_base(out, t).wait()
        pg._reduce_scatter_base(out, t).wait()
        torch.cuda.synchronize(device)
    finally:
        pg.shutdown()
    return time.perf_counter() - start


def join_epoch(
    plan: MeshPlan, rank: int, backend: str, collective_timeout_seconds: float, interrupted: Interrupted
) -> dist.Store:
    """Initialize torch.distributed and Megatron's parallel state for ``rank`` of ``plan``.

    The ranks first meet in the store (each sets its key, then waits for all): only when every
    rank arrived do they create groups, whose creation blocks without a way out. Until then every
    wait is sliced, so a newer plan (``interrupted``) ends the join within :data:`POLL`.

    Args:
        plan: the epoch's plan (sizes and rendezvous).
        rank: this worker's global rank in the plan.
        backend: ``nccl`` on GPU, ``gloo`` on CPU.
        collective_timeout_seconds: how long to wait for the store and for the other ranks; on
            gloo also the groups' timeout (a collective stuck this long raises). On NCCL the
            worker's own watchdog acts at this limit, so torch's timeout is set well past it:
            torch's watchdog reacting first starts its debug dump across ranks, which left a rank
            that survived a hung peer stuck at its next teardown.
        interrupted: true once a newer plan makes this one moot.

    Returns:
        The epoch's prefixed store, for small agreements that need no communicator.

    Raises:
        Superseded: a newer plan arrived.
        RendezvousFailed: the store was unreachable, or some ranks never arrived.
    """
    from megatron.core import parallel_state

    rdzv = plan.rendezvous
    limit = collective_timeout_seconds
    client = _connect_store(rdzv.host, rdzv.port, limit, interrupted)
    store = dist.PrefixStore(rdzv.store_prefix + "/", client)
    store.set(f"arrived/{rank}", "1")
    # A survivor may reach the join only after its failed step's collective timed out (up to the
    # limit): wait well past that before suspecting the ranks that did not come.
    wait_for_ranks(
        store,
        "arrived",
        range(plan.sizes.world),
        2 * limit + 10,
        interrupted,
        f"the {plan.sizes.world} ranks of epoch {plan.epoch}",
    )
    client.set_timeout(timedelta(seconds=limit))  # from here on the store serves group creation
    timeout = timedelta(seconds=limit if backend == "gloo" else max(2 * limit, limit + 60))
    dist.init_process_group(backend, store=store, rank=rank, world_size=plan.sizes.world, timeout=timeout)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=plan.sizes.tp,
        pipeline_model_parallel_size=plan.sizes.pp,
        context_parallel_size=plan.sizes.cp,
        expert_model_parallel_size=plan.sizes.ep,
        create_gloo_process_groups=False,
        distributed_timeout_minutes=timeout.total_seconds() / 60.0,  # declared int; used as timedelta(minutes=)
    )
    if parallel_state.get_data_parallel_world_size() != plan.sizes.dp:
        built = parallel_state.get_data_parallel_world_size()
        raise RuntimeError(f"parallel_state built dp={built}, plan has {plan.sizes.dp}")
    share_communicators()
    return store


def share_communicators() -> dict[str, str]:
    """Point each of Megatron's groups whose ranks (in order) equal an earlier group's at that group,
    so that groups of the same ranks use one communicator.

    Megatron makes a group per parallelism whether or not it differs from another: with TP 1 and
    CP 1 the data-parallel group holds every rank (the world's), with TP 1 the model-parallel
    group is the pipeline group, and after a shrink to one rank all of them are that rank. Each
    used group costs an NCCL communicator: its creation, which is on every epoch's critical path
    (the creations contend with each other), its connections on its first collectives, and its
    buffers. Sharing is safe because every member issues the collectives of both groups in the
    same program order, on the training thread; the rank order is part of the comparison, so a
    group's ranks keep their numbers. The world comes first, so the groups that span it use it.

    Returns:
        ``{attribute: the attribute (or "WORLD") it now shares}``, for the log and the tests.
    """
    from megatron.core import parallel_state as ps

    world = dist.group.WORLD
    assert world is not None
    by_ranks: dict[tuple[int, ...], tuple[str, dist.ProcessGroup]] = {
        tuple(range(dist.get_world_size())): ("WORLD", world)
    }
    shared: dict[str, str] = {}
    for name in sorted(vars(ps)):
        group = getattr(ps, name)
        if not (name.startswith("_") and "GROUP" in name and isinstance(group, dist.ProcessGroup)):
            continue
        if "GLOO" in name or group is world:
            continue
        ranks = tuple(dist.get_process_group_ranks(group))
        first = by_ranks.setdefault(ranks, (name, group))
        if first[1] is not group:
            setattr(ps, name, first[1])
            shared[name] = first[0]
    if shared:
        log.debug("groups sharing a communicator: %s", shared)
    return shared


def replica_group() -> dist.ProcessGroup:
    """The data-parallel group, for the trainer's own collectives (state broadcast, loss). With
    CP 1 it is the group DDP uses (Megatron's "dp-cp"): :func:`share_communicators` made the two
    one group, as they hold the same ranks."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


def communicator_groups() -> list[dist.ProcessGroup]:
    """The groups whose communicators a training rank uses every epoch, each once: the world
    (Megatron's optimizer gathers its param-group keys over it), the replica group (gradients, loss,
    state restore), the model-parallel group (grad norm) and the pipeline group (token count), plus
    the tensor-, context-parallel and embedding groups where they hold more than this rank (size-1
    TP/CP groups are skipped by Megatron's layers), and with expert parallelism the expert-parallel
    and expert-data-parallel groups."""
    from megatron.core import parallel_state as ps

    groups = [dist.group.WORLD, replica_group(), ps.get_model_parallel_group(), ps.get_pipeline_model_parallel_group()]
    if ps.get_tensor_model_parallel_world_size() > 1:
        groups.append(ps.get_tensor_model_parallel_group())
    if ps.get_context_parallel_world_size() > 1:
        groups.append(ps.get_context_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group(ignore_virtual=True):
        groups.append(ps.get_embedding_group())
    if ps.get_expert_model_parallel_world_size() > 1:  # token dispatch, and the experts' gradients
        groups.extend([ps.get_expert_model_parallel_group(), ps.get_expert_data_parallel_group()])
    unique: dict[int, dist.ProcessGroup] = {}
    for g in groups:
        if g is not None:
            unique.setdefault(id(g), g)
    return list(unique.values())


class Connecting:
    """NCCL communicators of an epoch being created concurrently, one thread per group.

    torch creates a group's communicator on its first collective, so an epoch would pay one init
    after another (world in the optimizer build, replica group in the restore, two more in the
    first step). Started right after the groups exist, the inits overlap each other and the model
    build. :meth:`join` must return before any collective runs: a collective on a group whose init
    is still in flight would start a second init of the same group.
    """

    def __init__(self, groups: list[dist.ProcessGroup], device: torch.device) -> None:
        self._errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._connect, args=(g, device), daemon=True, name="nccl-connect") for g in groups
        ]
        for t in self._threads:
            t.start()

    def _connect(self, group: dist.ProcessGroup, device: torch.device) -> None:
        try:
            group._get_backend(device).eager_connect_single_device(device)
        except BaseException as err:  # re-raised on the main thread by join()
            self._errors.append(err)

    def join(self) -> float:
        """Wait for every init; returns the seconds waited. Raises the first init's error."""
        start = time.perf_counter()
        for t in self._threads:
            t.join()
        if self._errors:
            raise self._errors[0]
        return time.perf_counter() - start


def connect_communicators(device: torch.device) -> Connecting | None:
    """Start creating this epoch's communicators (NCCL only; gloo connects when a group is made)."""
    if device.type != "cuda":
        return None
    return Connecting(communicator_groups(), device)


def device_for(local_rank: int) -> torch.device:
    """``cuda:<local rank>`` where a GPU exists, else the CPU."""
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
