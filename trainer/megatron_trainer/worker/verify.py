"""Check restored state before training resumes: every rank is at the plan's resume step, and
ranks holding the same model shard (its data-parallel group) hold bit-identical state.

The agreement goes through the epoch's store, not a collective: it needs no communicator (on NCCL
each new one costs an init on the recovery path) and a rank that fails the check tells its group
instead of leaving it blocked in a collective.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from megatron_contract.mesh import MeshPlan
from megatron_trainer.worker.model import TrainState, state_checksum

VERIFY_TIMEOUT = timedelta(seconds=120)


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
    wrong_step = {r: s for r, (s, _) in seen.items() if s != plan.resume_step}
    if wrong_step:
        raise StateMismatch(f"epoch {plan.epoch}: ranks at steps {wrong_step}, the plan resumes at {plan.resume_step}")
    digests = {d for _, d in seen.values()}
    if len(digests) > 1:
        raise StateMismatch(f"epoch {plan.epoch}: DP group {peers} holds {len(digests)} different states")
    return checksum
