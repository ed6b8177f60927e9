"""Entering an epoch whose plan moves the distributed optimizer's shards: restore them in memory.

The plan (``MeshPlan.optimizerState``, source ``self`` or ``reshard``) names, for every shard of the
previous epoch, the process that holds it now: on its GPU (the state it trained with) or in host
memory (its own snapshot, or the copy it keeps as its ward's buddy, worker/buddy_copies.py). A
restore then runs in four steps, every rank of the epoch taking part:

1. **Agree on the step.** The plan's resume step is the operator's estimate from lagging reports;
   each holder publishes, through the epoch's store, the steps at which it can give each shard it
   holds (its GPU state's step, its complete copies' steps). The shards of one step make one state:
   every rank takes the newest step all shards have (the survivors' step when the lost ranks'
   buddies hold it; an older one redoes the steps since).
2. **Relay** (rare): a holder whose position in the new mesh is another model-parallel position than
   the shard's (one replica spread over several pods, whose buddy is another pipeline stage) sends
   the whole shard to a process of the shard's position.
3. **Exchange.** Within each new data-parallel group, every new rank receives exactly the element
   ranges it now owns, point to point, from whoever holds them (worker/reshard.py says which ranges
   move, worker/reshard_exchange.py moves them): no full gather on one rank, nothing through
   storage.
4. **Load.** The new shards go into the optimizer (Adam's step count set to the agreed step), and
   every rank all-gathers its model parameters from the shards' fp32 main parameters, as after an
   optimizer step: a newcomer's parameters need no data-parallel peer.

Peak extra memory on a rank: the old shards it holds, as flat fp32 tensors on its device (its own,
and a buddy copy moved up from host memory), plus its new shard while they are exchanged: at most
one old shard more than a steady epoch holds per copy it gives, reported in the log.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_contract.mesh import MeshPlan, OptimizerSourceKind, OptimizerStatePlan
from megatron_trainer.worker.buddy_copies import BuddyCopies
from megatron_trainer.worker.model import HeldState, TrainState, set_scheduler_steps
from megatron_trainer.worker.optimizer_shards import (
    COLUMNS,
    columns_of,
    distributed_optimizers,
    load_flat_shards,
    materialize,
    rows_of,
)
from megatron_trainer.worker.rendezvous import Interrupted, wait_for_ranks
from megatron_trainer.worker.reshard import BufferLayout, reshard_transfers
from megatron_trainer.worker.reshard_exchange import exchange_shards
from megatron_trainer.worker.verify import StateMismatch

log = logging.getLogger(__name__)

STEPS_TIMEOUT_SECONDS = 120.0
#: Tags of the relays, past those of an exchange (one per column of each transfer, from 0).
_RELAY_TAG = 1 << 24
_MAX_BUFFERS = 64


def moves_shards(plan: MeshPlan, distributed: bool) -> bool:
    """Whether entering ``plan`` moves some distributed-optimizer shard (or rebuilds parameters from
    them): every rank then restores through :func:`restore_shards`."""
    state = plan.optimizer_state
    if not distributed or state is None or state.source not in (OptimizerSourceKind.SELF, OptimizerSourceKind.RESHARD):
        return False
    if state.previous_sizes is None:
        return False
    identity = state.holder_ranks() == list(range(plan.sizes.world))
    return state.source is OptimizerSourceKind.RESHARD or bool(state.copies) or not identity or state.params_from_shards


class _Sources:
    """The old shards this process can give, and at which steps."""

    def __init__(self, plan: MeshPlan, rank: int, held: HeldState | None, copies: BuddyCopies | None) -> None:
        state = plan.optimizer_state
        assert state is not None
        self.state: OptimizerStatePlan = state
        self.held, self.copies = held, copies
        holders = state.holder_ranks()
        copied = {c.previous_rank: c for c in state.copies}
        # Previous ranks named to this process: from its GPU unless listed among the copies.
        self.named = [p for p, h in enumerate(holders) if h == rank and p not in copied]
        self.named += [c.previous_rank for c in state.copies if c.holder_rank == rank]
        self.holder_of = [copied[p].holder_rank if p in copied else h for p, h in enumerate(holders)]

    def _on_gpu(self, previous: int) -> bool:
        """Whether this process's GPU holds ``previous``'s shard at its held step (a torn update
        left it at no step: then only its copies give it)."""
        held = self.held
        return held is not None and held.shards is not None and held.rank == previous and not held.torn

    def steps_of(self, previous: int) -> list[int]:
        """Steps at which this process can give ``previous``'s shard."""
        steps = []
        held, copies = self.held, self.copies
        if held is not None and self._on_gpu(previous):
            steps.append(held.step)
        if copies is not None and previous in (copies.rank, copies.ward):
            steps.extend(copies.complete_steps())
        return steps

    def shards_of(self, previous: int, step: int, device: torch.device) -> list[torch.Tensor]:
        """``previous``'s flat shards at ``step``, on ``device``."""
        held, copies = self.held, self.copies
        if held is not None and held.shards is not None and self._on_gpu(previous) and held.step == step:
            return materialize(held.shards)
        assert copies is not None
        host = copies.own(step) if previous == copies.rank else copies.ward_copy(step)
        return [t.to(device, non_blocking=True) for t in host]


def agree_step(
    plan: MeshPlan, rank: int, sources: _Sources, store: dist.Store, interrupted: Interrupted
) -> tuple[int, int]:
    """(the step every shard is restored at, the newest step some holder has): the newest step at
    which every previous shard has its named holder able to give it.

    Raises:
        StateMismatch: no step has every shard (a holder lost its copies, or holds another rank's).
        Superseded, RendezvousFailed: a newer plan arrived, or a holder never published.
    """
    offers = {str(p): sources.steps_of(p) for p in sources.named}
    store.set(f"shard-steps/{rank}", json.dumps(offers))
    world = list(range(plan.sizes.world))
    wait_for_ranks(store, "shard-steps", world, STEPS_TIMEOUT_SECONDS, interrupted, "the shards' steps")
    published = [json.loads(v.decode()) for v in store.multi_get([f"shard-steps/{r}" for r in world])]
    steps: dict[int, set[int]] = {}
    for offered in published:
        for previous, held in offered.items():
            steps[int(previous)] = set(held)
    prev_world = len(sources.holder_of)
    missing = [p for p in range(prev_world) if p not in steps]
    common = set.intersection(*(steps[p] for p in range(prev_world))) if not missing else set()
    if not common:
        raise StateMismatch(
            f"epoch {plan.epoch}: no step at which every previous optimizer shard is held"
            f" (steps by previous rank: { {p: sorted(s) for p, s in sorted(steps.items())} }, unclaimed {missing})"
        )
    return max(common), max(max(s, default=0) for s in steps.values())


def _buffers(ts: TrainState) -> list[Any]:
    return [b for o in distributed_optimizers(ts.optimizer) for b in o.buffers]


def _old_layout(ts: TrainState, buffer: Any, dp: int) -> BufferLayout:
    """The layout the buffer's parameters had at data-parallel size ``dp``. Megatron sizes buckets
    from the dp group unless overlapped reduction is off, when a buffer is one bucket."""
    bucket = None if ts.model.bucket_size is None else max(40_000_000, 1_000_000 * dp)
    return BufferLayout.of_buffer_for_dp(buffer, dp, bucket)


def restore_shards(
    ts: TrainState,
    plan: MeshPlan,
    rank: int,
    held: HeldState | None,
    copies: BuddyCopies | None,
    device: torch.device,
    store: dist.Store,
    interrupted: Interrupted,
    phases: dict[str, float],
) -> int:
    """Restore this rank's optimizer shard and parameters as the plan's ``optimizerState`` says;
    returns the bytes this rank received. ``held``: the state this process trained with in the
    previous epoch (None: a newcomer); ``copies``: its host copies of that epoch."""
    start = time.perf_counter()
    sources = _Sources(plan, rank, held, copies)
    step, newest = agree_step(plan, rank, sources, store, interrupted)
    phases["restore_agree"] = time.perf_counter() - start
    state = sources.state
    prev = state.previous_sizes
    assert prev is not None
    sizes = plan.sizes
    buffers = _buffers(ts)
    coords = sizes.coords_of(rank)

    def position(r: int, s: Any) -> tuple[int, int]:
        c = s.coords_of(r)
        return c.tp, c.pp

    def old_group(tp_pp: tuple[int, int]) -> list[int]:
        return [r for r in range(prev.world) if position(r, prev) == tp_pp]

    def new_group(tp_pp: tuple[int, int]) -> list[int]:
        return [r for r in range(sizes.world) if position(r, sizes) == tp_pp]

    mine: dict[int, list[torch.Tensor]] = {p: sources.shards_of(p, step, device) for p in sources.named}
    holder = list(sources.holder_of)
    # Relay shards held at another model-parallel position to a process of theirs.
    relays: list[dist.P2POp] = []
    received: dict[int, list[torch.Tensor]] = {}
    for p in range(prev.world):
        at = position(p, prev)
        if position(holder[p], sizes) == at:
            continue
        group = old_group(at)
        target = new_group(at)[group.index(p) % len(new_group(at))]
        if holder[p] == rank:  # a shard's memory, columns apart: a view, no copy (optimizer_shards.columns_of)
            for b, t in enumerate(mine.pop(p)):
                relays.append(dist.P2POp(dist.isend, columns_of(t), target, tag=_RELAY_TAG + p * _MAX_BUFFERS + b))
        if target == rank:
            received[p] = []
            for b, buffer in enumerate(buffers):
                rows = _old_layout(ts, buffer, len(group)).shard_numel
                memory = torch.empty(COLUMNS, rows, dtype=torch.float32, device=device)
                received[p].append(rows_of(memory))
                relays.append(dist.P2POp(dist.irecv, memory, holder[p], tag=_RELAY_TAG + p * _MAX_BUFFERS + b))
        holder[p] = target
    if relays:
        for request in dist.batch_isend_irecv(relays):
            request.wait()
    mine.update(received)

    # Exchange within this rank's new data-parallel group, buffer by buffer.
    here = (coords.tp, coords.pp)
    olds = old_group(here)
    moved = 0
    peak = sum(t.numel() * t.element_size() for ts_ in mine.values() for t in ts_)
    shards = []
    for b, buffer in enumerate(buffers):
        new = BufferLayout.of_buffer(buffer)
        old = _old_layout(ts, buffer, len(olds))
        transfers = reshard_transfers(old, new)
        process_of_new = dist.get_process_group_ranks(buffer.data_parallel_group)
        given = {d: mine[p][b] for d, p in enumerate(olds) if holder[p] == rank}
        shard = exchange_shards(
            transfers,
            old,
            new,
            given,
            [holder[p] for p in olds],
            process_of_new,
            rank,
            columns=COLUMNS,
            device=device,
        )
        assert shard is not None  # every rank of the group owns a new shard
        shards.append(shard)
        moved += (
            COLUMNS
            * 4
            * sum(t.numel for t in transfers if process_of_new[t.dest] == rank and holder[olds[t.source]] != rank)
        )
    peak += sum(t.numel() * t.element_size() for t in shards)
    mine.clear()
    load_flat_shards(ts.optimizer, shards, step=step)
    del shards
    _parameters_from_shards(ts)
    ts.step = step
    set_scheduler_steps(ts, step)
    phases["restore_shards"] = time.perf_counter() - start
    log.info(
        "epoch %d rank %d: optimizer shards of step %d restored in memory (%s, %d steps redone): %d bytes"
        " received, peak extra memory %d bytes",
        plan.epoch,
        rank,
        step,
        state.source.value,
        newest - step,
        moved,
        peak,
    )
    return moved


@torch.no_grad()
def _parameters_from_shards(ts: TrainState) -> None:
    """Every rank's model parameters from the fp32 main parameters of the shards, as an optimizer
    step leaves them: each rank casts its shard into the parameter buffer, then the data-parallel
    group all-gathers the buffers."""
    for opt in distributed_optimizers(ts.optimizer):
        opt._copy_main_params_to_model_params()
    ts.model.start_param_sync(force_sync=True)
