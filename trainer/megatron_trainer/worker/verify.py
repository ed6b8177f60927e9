"""Check restored state before training resumes: ranks agree on the step, and ranks holding the
same model shard (a data-parallel group) hold bit-identical state.

The agreement goes through the epoch's store, not a collective: it needs no communicator (on NCCL
each new one costs an init on the recovery path) and a rank that fails the check tells its peers
instead of leaving them blocked in a collective. Each rank compares with its data-parallel group
and its model-parallel group; since those groups connect every rank, the whole world agrees.

The step may be the plan's ``resumeStep`` or one more: when a peer dies just after the last
collective of a step, the survivors commit that step before they see the new plan. Every rank then
holds that step, so it is kept (no sample is redone) rather than refused.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch.distributed as dist

from megatron_contract.mesh import MeshPlan
from megatron_trainer.worker.model import TrainState, state_checksum

log = logging.getLogger(__name__)
VERIFY_TIMEOUT = timedelta(seconds=120)


class StateMismatch(RuntimeError):
    """Restored state disagrees across the group; training must not resume on it."""


def verify_state(ts: TrainState, plan: MeshPlan, rank: int, store: dist.Store) -> int:
    """Publish (step, checksum) and compare with the DP and MP groups; returns the checksum."""
    from megatron.core import parallel_state

    checksum = state_checksum(ts)
    store.set(f"verify/{rank}", f"{ts.step},{checksum}")
    dp_peers = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
    mp_peers = dist.get_process_group_ranks(parallel_state.get_model_parallel_group())
    peers = sorted(set(dp_peers) | set(mp_peers))
    keys = [f"verify/{r}" for r in peers]
    store.wait(keys, VERIFY_TIMEOUT)
    seen = {r: tuple(int(x) for x in v.decode().split(",")) for r, v in zip(peers, store.multi_get(keys), strict=True)}
    steps = {s for s, _ in seen.values()}
    if len(steps) > 1:
        raise StateMismatch(
            f"epoch {plan.epoch}: peers of rank {rank} hold different steps { {r: s for r, (s, _) in seen.items()} }"
        )
    if ts.step not in (plan.resume_step, plan.resume_step + 1):
        raise StateMismatch(f"epoch {plan.epoch}: state is at step {ts.step}, the plan resumes at {plan.resume_step}")
    if ts.step != plan.resume_step:
        log.warning(
            "epoch %d: every peer committed step %d after the plan was made; resuming after it", plan.epoch, ts.step - 1
        )
    digests = {seen[r][1] for r in dp_peers}
    if len(digests) > 1:
        raise StateMismatch(f"epoch {plan.epoch}: DP group {dp_peers} holds {len(digests)} different states")
    return checksum
