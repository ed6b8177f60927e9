"""Check restored state before training resumes: ranks agree on the step, and ranks holding the
same model shard (a data-parallel group; with expert parallelism, its ranks of one expert-parallel
rank) hold bit-identical state.

The agreement goes through the epoch's store, not a collective: it needs no communicator (on NCCL
each new one costs an init on the recovery path) and a rank that fails the check tells its peers
instead of leaving them blocked in a collective. Each rank compares with its data-parallel group
and its model-parallel group; since those groups connect every rank, the whole world agrees.

Which step wins: a plan that starts from scratch or from a checkpoint fixes the step, and every
rank must hold exactly the plan's ``resumeStep``. A plan whose state comes from survivors (kept or
broadcast from a DP peer) cannot know it: the operator learns steps from heartbeats, which lag
training by up to an interval (many steps on a fast model), and survivors may commit or discard the
step in flight when the fault hits. There the step the survivors hold is the truth: model state,
optimizer state and the sample cursor (a function of the step) travel together, so resuming from it
drops and repeats no sample. It is kept, with a warning when it differs from the plan's estimate.
Survivors of one data-parallel group that disagree (one committed the step in flight, a peer's was
aborted before its optimizer update) were already brought to the newest step by the restore
(worker/peer_restore.py). A disagreement left here is between model-parallel peers: no rank of
some data-parallel group holds the newest step, which no broadcast within a group repairs, so it
is refused.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from megatron_contract.mesh import MeshPlan, StateSourceKind
from megatron_trainer.worker.model import TrainState, state_checksum
from megatron_trainer.worker.rendezvous import Interrupted, wait_for_ranks

log = logging.getLogger(__name__)
VERIFY_TIMEOUT_SECONDS = 120.0


class StateMismatch(RuntimeError):
    """Restored state disagrees across the group; training must not resume on it."""


def verify_state(ts: TrainState, plan: MeshPlan, rank: int, store: dist.Store, interrupted: Interrupted) -> int:
    """Publish (step, checksum) and compare with the DP and MP groups; returns the checksum, or 0
    when no data-parallel peer holds this rank's shard (a mesh shrunk to one replica): there is
    nothing to compare it with, and reading every byte of the state costs the first step ~0.07 s
    on a 1 B model.

    Raises:
        StateMismatch: the group disagrees.
        Superseded, RendezvousFailed: a newer plan arrived, or peers never published.
    """
    from megatron.core import parallel_state

    if ts.scheduler.num_steps != ts.step:
        raise StateMismatch(
            f"epoch {plan.epoch}: the learning-rate scheduler is at step {ts.scheduler.num_steps}, "
            f"the state at step {ts.step}"
        )
    dp_peers = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
    mp_peers = dist.get_process_group_ranks(parallel_state.get_model_parallel_group())
    # With expert parallelism a DP group holds ep shards of the experts: compare within a shard.
    same_shard = [r for r in dp_peers if plan.sizes.shard_key(r) == plan.sizes.shard_key(rank)]
    checksum = state_checksum(ts) if len(same_shard) > 1 else 0
    store.set(f"verify/{rank}", f"{ts.step},{checksum}")
    peers = sorted(set(dp_peers) | set(mp_peers))
    keys = [f"verify/{r}" for r in peers]
    wait_for_ranks(store, "verify", peers, VERIFY_TIMEOUT_SECONDS, interrupted, "the peers' restored state")
    seen = {r: tuple(int(x) for x in v.decode().split(",")) for r, v in zip(peers, store.multi_get(keys), strict=True)}
    steps = {s for s, _ in seen.values()}
    if len(steps) > 1:
        behind = "model-parallel" if len({seen[r][0] for r in dp_peers}) == 1 else "data-parallel"
        raise StateMismatch(
            f"epoch {plan.epoch}: peers of rank {rank} hold different steps { {r: s for r, (s, _) in seen.items()} }"
            f" ({behind} peers disagree)"
        )
    check_step(plan, ts.step)
    digests = {seen[r][1] for r in same_shard}
    if len(digests) > 1:
        raise StateMismatch(f"epoch {plan.epoch}: DP group {same_shard} holds {len(digests)} different states")
    return checksum


def check_step(plan: MeshPlan, step: int) -> None:
    """Refuse a step the plan does not allow (see the module's docstring); warn when survivors
    hold another step than the plan's estimate."""
    if step == plan.resume_step:
        return
    if StateSourceKind.CHECKPOINT in plan.source_kinds() and step < plan.resume_step:
        # The plan's checkpoint failed verification and every rank restored the next older one
        # (worker/checkpoint.py): the older step is the truth, as for survivors.
        log.warning(
            "epoch %d: restored the checkpoint of step %d, the plan named %d", plan.epoch, step, plan.resume_step
        )
        return
    if not plan.source_kinds() <= {StateSourceKind.SELF, StateSourceKind.PEER}:
        raise StateMismatch(f"epoch {plan.epoch}: state is at step {step}, the plan restores step {plan.resume_step}")
    log.warning(
        "epoch %d: survivors hold step %d, the plan estimated %d; resuming at %d",
        plan.epoch,
        step,
        plan.resume_step,
        step,
    )
