"""Check restored state before training resumes: ranks holding the same model shard (a
data-parallel group) are at the same step and hold bit-identical state.

The plan's resume step comes from heartbeats, which lag: after a failure the survivors may hold a
later step than the plan names (never an earlier one that the whole old mesh completed), so the
group's agreed step wins; a difference from the plan is logged, not fatal.

The agreement goes through the epoch's store, not a collective: it needs no communicator (on NCCL
each new one costs an init on the recovery path) and a rank that fails the check tells its group
instead of leaving it blocked in a collective.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch.distributed as dist

from megatron_contract.mesh import MeshPlan
from megatron_trainer.worker.model import TrainState, state_checksum

VERIFY_TIMEOUT = timedelta(seconds=120)
log = logging.getLogger(__name__)


class StateMismatch(RuntimeError):
    """Restored state disagrees across the group; training must not resume on it."""


def verify_state(ts: TrainState, plan: MeshPlan, rank: int, store: dist.Store) -> int:
    """Publish (step, checksum), compare with the DP group; returns this rank's checksum."""
    from megatron.core import parallel_state

    checksum = state_checksum(ts)
    store.set(f"verify/{rank}", f"{ts.step},{checksum}")
    peers = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
    keys = [f"verify/{r}" for r in peers]
    store.wait(keys, VERIFY_TIMEOUT)
    seen = {r: tuple(int(x) for x in v.decode().split(",")) for r, v in zip(peers, store.multi_get(keys), strict=True)}
    steps = {s for s, _ in seen.values()}
    if len(steps) > 1:
        raise StateMismatch(f"epoch {plan.epoch}: DP group {peers} is at different steps {sorted(steps)}")
    if ts.step != plan.resume_step:
        log.info("epoch %d: the group holds step %d, the plan named %d", plan.epoch, ts.step, plan.resume_step)
    digests = {d for _, d in seen.values()}
    if len(digests) > 1:
        raise StateMismatch(f"epoch {plan.epoch}: DP group {peers} holds {len(digests)} different states")
    return checksum
