"""Where the distributed optimizer's shards come from in a new epoch (``MeshPlan.optimizerState``).

Each rank's shard exists on its GPU and, with buddies, as host copies: the owner's own snapshot
and the copy its buddy (``MeshPlan.buddy_of``, on another pod) keeps, both refreshed every
``replicaIntervalSteps``. A previous shard is *live* at step ``s`` when a member of the new plan
holds it at ``s``: its owner's GPU (at the survivors' step), or a host copy of step ``s`` on the
owner's or the buddy's pod. Shards of one step make one state, so the planner takes the newest step
at which every previous shard is live: the survivors' step (nothing redone) when the GPUs and the
lost ranks' buddy copies hold it, else the newest step all copies hold (its later steps redone,
every rank restoring from a copy). With no such step every rank reloads the newest checkpoint.

The trainers consume these sources (worker/shard_restore.py) for dense models without context
parallelism (:func:`in_memory_restore`); for the others (``in_memory`` false) any shard that would
move reloads the checkpoint for everyone, and no copies are kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from megatron_contract.job import MegatronJobSpec
from megatron_contract.mesh import (
    HolderRun,
    MeshPlan,
    MeshSizes,
    OptimizerSourceKind,
    OptimizerStatePlan,
    PlanMember,
    ShardCopy,
    StateSourceKind,
)

#: Whether the trainers restore distributed-optimizer shards from host copies and reshard them in
#: memory (worker/shard_restore.py). Off, the operator asks them for no copies (a refresh moves every
#: shard to another pod each ``replicaIntervalSteps`` and holds ~4 x 12 bytes per shard element of
#: host memory) and a shard that moves reloads the checkpoint.
IN_MEMORY_RESTORE = True


def in_memory_restore(spec: MegatronJobSpec) -> bool:
    """Whether this job's shards are restored in memory and backed by buddy copies: dense models
    without context parallelism. Expert-parallel buffers shard over another group than the dense
    ones, and context parallelism shards over data x context, which the trainers' reshard does not
    lay out yet: those jobs reload the checkpoint when a shard moves."""
    return IN_MEMORY_RESTORE and spec.model.num_experts is None and spec.cp == 1


@dataclasses.dataclass(frozen=True)
class OptimizerSources:
    """The optimizer part of a plan, and what it means for the rest of the plan."""

    state: OptimizerStatePlan
    resume_step: int | None  # the step every shard is at; None: a reload (the caller's checkpoint step or 0)
    reload: bool  # every rank reloads the checkpoint (or starts fresh): the legacy sources must say so


@dataclasses.dataclass(frozen=True)
class _Holding:
    rank: int  # the process's rank in the new plan
    pod: str


def optimizer_sources(
    sizes: MeshSizes,
    gpus_per_pod: int,
    members: list[PlanMember],
    previous: MeshPlan | None,
    *,
    interval_steps: int,
    survivors_step: int,
    previous_trained: bool,
    copy_steps: Mapping[str, Collection[int]],
    in_memory: bool,
) -> OptimizerSources:
    """The optimizer state plan of a new epoch whose members are ``members``.

    Args:
        sizes, gpus_per_pod: the new mesh.
        members: the new plan's members (with their ranks).
        previous: the plan in force, None for the first one.
        interval_steps: spec optimizer.replicaIntervalSteps.
        survivors_step: the step the surviving ranks' GPU state is at (the plan's resume step).
        previous_trained: whether every member of ``previous`` committed a step in its epoch; when
            not, only ranks that kept their own state hold one, and no copy was refreshed.
        copy_steps: by pod, the steps of which it holds complete host copies (agents' reports).
        in_memory: the trainers restore shards from copies and reshard in memory.
    """
    # Copies cost host memory and a transfer of every shard each refresh: asked for only where the
    # trainers restore from them.
    buddies = in_memory and sizes.world // gpus_per_pod >= 2
    if previous is None:
        return OptimizerSources(_state(interval_steps, buddies, OptimizerSourceKind.INIT), 0, True)
    reload = OptimizerSources(_state(interval_steps, buddies, OptimizerSourceKind.CHECKPOINT), None, True)
    prev_sizes = previous.sizes
    # The process at local GPU i of a pod that stays (same UID) had previous rank old.ranks[i]
    # and has rank new.ranks[i] now.
    now = {(m.pod, m.pod_uid): m for m in members}
    gpu: dict[int, _Holding] = {}  # previous rank -> the process holding its GPU state
    process: dict[int, _Holding] = {}  # previous rank -> the same process, whatever it holds
    for old in previous.members:
        new = now.get((old.pod, old.pod_uid))
        if new is None:
            continue
        for old_rank, new_rank in zip(old.ranks, new.ranks, strict=True):
            process[old_rank] = _Holding(new_rank, old.pod)
            if previous_trained or previous.source_of(old_rank).kind is StateSourceKind.SELF:
                gpu[old_rank] = _Holding(new_rank, old.pod)

    had_buddies = previous_trained and previous.optimizer_state is not None and previous.optimizer_state.buddies

    def copies_of(old_rank: int, step: int) -> list[tuple[_Holding, bool]]:
        """Host copies of a previous shard at ``step`` in the new mesh: the buddy's, then the owner's own."""
        if not had_buddies:
            return []
        found = []
        buddy = previous.buddy_of(old_rank)
        for holder, is_buddy in ((buddy, True), (old_rank, False)):
            held = process.get(holder) if holder is not None else None
            if held is not None and step in copy_steps.get(held.pod, ()):
                found.append((held, is_buddy))
        return found

    # Nothing redone: GPUs where they survive, buddies' copies elsewhere of the survivors' step, or of
    # a newer one: the survivors' step comes from lagging reports, and a complete copy of step s means
    # every rank completed s (with a refresh every step, the copies are usually ahead of the reports).
    # The trainers agree on the newest step every named holder can give (worker/shard_restore.py).
    newer = sorted({s for s in _all_steps(copy_steps) if s > survivors_step}, reverse=True)
    for at in [*newer, survivors_step]:
        holders: list[int] = []
        copies: list[ShardCopy] = []
        for old_rank in range(prev_sizes.world):
            if old_rank in gpu:
                holders.append(gpu[old_rank].rank)
                continue
            found = copies_of(old_rank, at)
            if not found:
                break
            held, is_buddy = found[0]
            holders.append(held.rank)
            copies.append(_copy(old_rank, held, is_buddy, at))
        else:
            return _in_memory(sizes, prev_sizes, interval_steps, buddies, holders, copies, 0, in_memory, at)

    # Redo the steps since the newest copy every shard has (owners' snapshots or buddies' copies).
    steps = sorted({s for s in _all_steps(copy_steps) if s < survivors_step}, reverse=True)
    for step in steps:
        holders, copies = [], []
        for old_rank in range(prev_sizes.world):
            found = copies_of(old_rank, step)
            if not found:
                break
            held, is_buddy = found[-1]  # the owner's own snapshot first: no transfer
            holders.append(held.rank)
            copies.append(_copy(old_rank, held, is_buddy, step))
        else:
            redone = survivors_step - step
            return _in_memory(sizes, prev_sizes, interval_steps, buddies, holders, copies, redone, in_memory, step)
    return reload


def restore_point(copy_steps: Mapping[str, Collection[int]], pods: Collection[str]) -> int | None:
    """The step a loss of one of ``pods`` (a plan's members) goes back to at worst, by their agents'
    reports of the complete copies they hold (``copy_steps``): the oldest of their newest copies.
    None when a pod has reported none (a new epoch's first refresh is not complete everywhere).

    Reports come at different moments (a heartbeat a second; at interval 1 a copy a step), so they
    rarely name one step in common. But every rank refreshes at the same steps and keeps two
    generations, and a pod's copies only move forward: when one is lost, each survivor holds the
    newest refresh complete everywhere (or the one after it), and so do the lost ranks' buddies;
    that step is at least this one, and :func:`optimizer_sources` finds it (or a newer one)."""
    newest = [max(copy_steps.get(pod, ()), default=None) for pod in pods]
    if not newest or None in newest:
        return None
    return min(s for s in newest if s is not None)


def _copy(old_rank: int, held: _Holding, buddy: bool, step: int) -> ShardCopy:
    return ShardCopy(previous_rank=old_rank, holder_rank=held.rank, holder_pod=held.pod, buddy=buddy, step=step)


def _all_steps(copy_steps: Mapping[str, Collection[int]]) -> set[int]:
    return {s for steps in copy_steps.values() for s in steps}


def _state(interval: int, buddies: bool, source: OptimizerSourceKind) -> OptimizerStatePlan:
    return OptimizerStatePlan(replica_interval_steps=interval, buddies=buddies, source=source)


def _in_memory(
    sizes: MeshSizes,
    prev_sizes: MeshSizes,
    interval: int,
    buddies: bool,
    holders: list[int],
    copies: list[ShardCopy],
    redone: int,
    in_memory: bool,
    step: int,
) -> OptimizerSources:
    layout_kept = prev_sizes.dp == sizes.dp
    kept = layout_kept and not copies and holders == list(range(sizes.world))
    if not (in_memory or kept):
        # The trainers cannot take these sources yet: they reload the checkpoint.
        return OptimizerSources(_state(interval, buddies, OptimizerSourceKind.CHECKPOINT), None, True)
    state = OptimizerStatePlan(
        replica_interval_steps=interval,
        buddies=buddies,
        source=OptimizerSourceKind.SELF if layout_kept else OptimizerSourceKind.RESHARD,
        previous_sizes=prev_sizes,
        holders=HolderRun.runs_of(holders),
        copies=copies,
        params_from_shards=redone > 0,
        steps_redone=redone,
    )
    return OptimizerSources(state, step, False)
