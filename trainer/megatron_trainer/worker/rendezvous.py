"""Join an epoch's process groups, or a communicator-free world while waiting as a spare.

An epoch's ranks meet at ``plan.rendezvous``: a TCPStore hosted by an agent (never by a worker,
which may die: shared/FACTS.md). Each epoch creates a fresh store client (old clients never
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
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_contract.job import MegatronJobSpec
from megatron_contract.mesh import MeshPlan

log = logging.getLogger(__name__)

STORE_CONNECT_TIMEOUT = timedelta(seconds=60)


def join_spare_world(spec: MegatronJobSpec, local_rank: int) -> None:
    """A world of one model-parallel replica on the fake backend (no communicator, no peer)."""
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = spec.model_parallel
    dist.init_process_group("fake", store=FakeStore(), rank=local_rank % world, world_size=world)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        context_parallel_size=spec.cp,
        create_gloo_process_groups=False,
    )


def join_epoch(plan: MeshPlan, rank: int, backend: str, collective_timeout_seconds: float) -> dist.Store:
    """Initialize torch.distributed and Megatron's parallel state for ``rank`` of ``plan``.

    Args:
        plan: the epoch's plan (sizes and rendezvous).
        rank: this worker's global rank in the plan.
        backend: ``nccl`` on GPU, ``gloo`` on CPU.
        collective_timeout_seconds: the groups' timeout; a gloo collective stuck this long raises.

    Returns:
        The epoch's prefixed store, for small agreements that need no communicator.
    """
    from megatron.core import parallel_state

    rdzv = plan.rendezvous
    client = dist.TCPStore(rdzv.host, rdzv.port, is_master=False, timeout=STORE_CONNECT_TIMEOUT)
    store = dist.PrefixStore(rdzv.store_prefix + "/", client)
    timeout = timedelta(seconds=collective_timeout_seconds)
    dist.init_process_group(backend, store=store, rank=rank, world_size=plan.sizes.world, timeout=timeout)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=plan.sizes.tp,
        pipeline_model_parallel_size=plan.sizes.pp,
        context_parallel_size=plan.sizes.cp,
        create_gloo_process_groups=False,
        distributed_timeout_minutes=collective_timeout_seconds / 60.0,  # type: ignore[arg-type]
    )
    if parallel_state.get_data_parallel_world_size() != plan.sizes.dp:
        built = parallel_state.get_data_parallel_world_size()
        raise RuntimeError(f"parallel_state built dp={built}, plan has {plan.sizes.dp}")
    return store


def replica_group() -> dist.ProcessGroup:
    """The data-parallel group as DDP uses it. With cp=1 Megatron's "dp" and "dp-cp" groups hold
    the same ranks but are separate communicators; using DDP's one for the trainer's own
    collectives (state broadcast, loss) saves one NCCL communicator init per epoch."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(
        with_context_parallel=parallel_state.get_context_parallel_world_size() == 1
    )


def device_for(local_rank: int) -> torch.device:
    """``cuda:<local rank>`` where a GPU exists, else the CPU."""
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
