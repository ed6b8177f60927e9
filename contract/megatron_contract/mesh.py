"""``MeshPlan``: the one versioned document that says who trains as what.

Rank order follows Megatron's default (tp fastest, then cp, dp, pp)::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Expert parallelism (mixture of experts) lies inside data parallelism, as in Megatron: the ``ep``
replicas of one expert-parallel group each hold ``numExperts/ep`` of every expert layer's experts,
so two ranks hold the same state only when their tp/cp/pp coordinates *and* expert-parallel ranks
agree (:meth:`MeshSizes.shard_key`).

A plan is checked whole when it is parsed: ranks unique and dense, world = tp·pp·cp·dp, ep
dividing dp, each tensor-parallel group inside one pod, batch geometry adding up to the global
batch, every rank's state source pointing at a rank that really holds that state (the same
shard), and, with the distributed optimizer (``optimizerState``), every buddy on another pod, a
holder for every previous shard, host copies all of the resume step, and a reload only ever for
every rank. Operator and trainer parse the same model, so neither can act on a plan the other
would call invalid.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from datetime import datetime

from pydantic import Field, model_validator

from megatron_contract.base import OpenWireModel, WireModel
from megatron_contract.wire import AGENT_PORT


class MeshError(ValueError):
    """A plan or mesh that breaks one of the invariants above."""


class PlanReason(enum.StrEnum):
    """Why a plan was made."""

    INITIAL = "initial"
    REPLACE = "replace"
    SHRINK = "shrink"
    GROW = "grow"
    RESIZE = "resize"  # spec.replicas was lowered: whole replicas leave the mesh, no pod was lost
    MIGRATE = "migrate"  # members leave nodes being drained (cordoned): a spare or DP peers take over
    # The job is suspended: members enter the epoch with the state they hold, write a distributed
    # checkpoint of their step (complete and verified), report it, and train no further.
    SUSPEND = "suspend"
    RESUME = "resume"  # a suspended job's new pods: every rank loads the checkpoint written when it stopped


class StateSourceKind(enum.StrEnum):
    """Where a rank gets its model and optimizer state when it enters an epoch."""

    INIT = "init"  # fresh initialization from the job's seed (first epoch, nothing saved)
    SELF = "self"  # keeps what it holds: it was in the previous epoch with the same coordinates
    PEER = "peer"  # broadcast from a DP peer with the same tp/cp/pp coordinates
    CHECKPOINT = "checkpoint"  # the newest complete distributed checkpoint


class OptimizerSourceKind(enum.StrEnum):
    """Where the ranks' distributed-optimizer shards come from when they enter an epoch (one kind
    for the whole plan: shards of one step make one consistent state)."""

    SELF = "self"  # layout unchanged: rank r takes the previous epoch's shard of rank r
    RESHARD = "reshard"  # layout changed: each rank gathers the byte ranges it now owns from the old shards
    CHECKPOINT = "checkpoint"  # the newest complete distributed checkpoint (defaultCheckpointStep)
    INIT = "init"  # fresh initialization (first epoch, or nothing saved)


class MeshSizes(OpenWireModel):
    """The parallel degrees of one epoch."""

    world: int = Field(ge=1, description="Number of ranks: tp*pp*cp*dp.")
    tp: int = Field(ge=1, description="Tensor-parallel size.")
    pp: int = Field(ge=1, description="Pipeline-parallel size.")
    cp: int = Field(ge=1, description="Context-parallel size.")
    dp: int = Field(ge=1, description="Data-parallel size (number of model replicas).")
    ep: int = Field(default=1, ge=1, description="Expert-parallel size: experts split over ep replicas; divides dp.")

    @model_validator(mode="after")
    def _world_is_product(self) -> MeshSizes:
        if self.world != self.tp * self.pp * self.cp * self.dp:
            raise MeshError(f"world {self.world} != tp*pp*cp*dp = {self.tp}*{self.pp}*{self.cp}*{self.dp}")
        if self.dp % self.ep:
            raise MeshError(f"dp {self.dp} is not a multiple of ep {self.ep}")
        return self

    @property
    def model_parallel(self) -> int:
        """Ranks in one data-parallel replica: tp*cp*pp."""
        return self.tp * self.cp * self.pp

    def rank_of(self, coords: MeshCoords) -> int:
        """Global rank of the given coordinates (Megatron's tp-cp-dp-pp order)."""
        return self.rank_at(coords.tp, coords.cp, coords.dp, coords.pp)

    def rank_at(self, tp: int, cp: int, dp: int, pp: int) -> int:
        """:meth:`rank_of` without a :class:`MeshCoords` (the planner asks it for every rank)."""
        for name, value in (("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp)):
            if not 0 <= value < getattr(self, name):
                raise MeshError(f"{name} coordinate {value} outside 0..{getattr(self, name) - 1}")
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def expert_rank(self, coords: MeshCoords) -> int:
        """Expert-parallel rank of the given coordinates. Megatron orders the expert mesh tp-ep-dp-pp
        over the same ranks (expert tp = tp, no cp), so the expert-parallel rank is the position
        in the cp-dp block modulo ep."""
        return self._expert_rank_at(coords.cp, coords.dp)

    def _expert_rank_at(self, cp: int, dp: int) -> int:
        return (cp + self.cp * dp) % self.ep

    def shard_key(self, rank: int) -> tuple[int, int, int, int]:
        """(tp, cp, pp, expert rank): ranks sharing it hold the same state (the expert layers' share
        of experts included), so one can restore another."""
        # Without a MeshCoords: the planner asks this for every rank of both meshes on each pass
        # (8192 pydantic models at 4096 ranks were a quarter of a pass).
        tp, cp, dp, pp = self._split(rank)
        return (tp, cp, pp, self._expert_rank_at(cp, dp))

    def shard_keys(self) -> tuple[tuple[int, int, int, int], ...]:
        """:meth:`shard_key` of every rank, by rank: made once per set of sizes (a plan of a large job
        asks it of every rank of both meshes; rank by rank that was ~100 ms at 4096 pods x 8 GPUs)."""
        return _shard_keys(self.tp, self.cp, self.dp, self.pp, self.ep)

    def coords_of(self, rank: int) -> MeshCoords:
        """Coordinates of a global rank; inverse of :meth:`rank_of`."""
        tp, cp, dp, pp = self._split(rank)
        return MeshCoords(tp=tp, cp=cp, dp=dp, pp=pp)

    def _split(self, rank: int) -> tuple[int, int, int, int]:
        """(tp, cp, dp, pp) of a global rank."""
        if not 0 <= rank < self.world:
            raise MeshError(f"rank {rank} outside 0..{self.world - 1}")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return tp, cp, dp, pp


@functools.lru_cache(maxsize=8)
def _shard_keys(tp: int, cp: int, dp: int, pp: int, ep: int) -> tuple[tuple[int, int, int, int], ...]:
    # In rank order (tp fastest, then cp, dp, pp); one tuple per distinct key, shared by its ranks.
    distinct: dict[tuple[int, int, int, int], tuple[int, int, int, int]] = {}
    keys: list[tuple[int, int, int, int]] = []
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                expert = (c + cp * d) % ep
                keys.extend(distinct.setdefault((t, c, p, expert), (t, c, p, expert)) for t in range(tp))
    return tuple(keys)


class MeshCoords(WireModel):
    """A rank's position in the mesh."""

    tp: int = Field(ge=0)
    cp: int = Field(ge=0)
    dp: int = Field(ge=0)
    pp: int = Field(ge=0)

    def model_parallel_key(self) -> tuple[int, int, int]:
        """(tp, cp, pp): ranks sharing it hold the same shard of the model."""
        return (self.tp, self.cp, self.pp)


class BatchGeometry(OpenWireModel):
    """How the fixed global batch is split over data-parallel replicas in this epoch.

    Replica ``d`` takes ``microBatchesPerReplica[d]`` micro-batches of each step; its samples are
    the contiguous slice that starts after those of replicas ``0..d-1``. The global batch never
    changes, so ``consumed samples = step * globalBatchSize`` whatever the data-parallel size.
    """

    global_batch_size: int = Field(ge=1, description="Samples per optimizer step, fixed for the job.")
    micro_batch_size: int = Field(ge=1, description="Samples per micro-batch.")
    micro_batches_per_replica: list[int] = Field(
        min_length=1, description="Micro-batches per step of each data-parallel replica, by dp rank."
    )

    @model_validator(mode="after")
    def _adds_up(self) -> BatchGeometry:
        if any(n < 1 for n in self.micro_batches_per_replica):
            raise MeshError("every replica needs at least one micro-batch per step")
        total = sum(self.micro_batches_per_replica) * self.micro_batch_size
        if total != self.global_batch_size:
            raise MeshError(f"micro-batches add up to {total} samples, not the global batch {self.global_batch_size}")
        return self

    @classmethod
    def split(cls, global_batch_size: int, micro_batch_size: int, dp: int) -> BatchGeometry:
        """Spread the global batch over ``dp`` replicas as evenly as whole micro-batches allow."""
        if global_batch_size % micro_batch_size:
            raise MeshError(f"global batch {global_batch_size} is not a multiple of micro-batch {micro_batch_size}")
        micro = global_batch_size // micro_batch_size
        if micro < dp:
            raise MeshError(f"{micro} micro-batches cannot feed {dp} replicas")
        base, extra = divmod(micro, dp)
        return cls(
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            micro_batches_per_replica=[base + (1 if d < extra else 0) for d in range(dp)],
        )

    def sample_range(self, dp_rank: int, step: int) -> range:
        """Global sample indices that replica ``dp_rank`` consumes at ``step``."""
        before = sum(self.micro_batches_per_replica[:dp_rank]) * self.micro_batch_size
        start = step * self.global_batch_size + before
        return range(start, start + self.micro_batches_per_replica[dp_rank] * self.micro_batch_size)


class Rendezvous(OpenWireModel):
    """Where the ranks of an epoch meet: a TCPStore and a key prefix unique to the epoch."""

    host: str = Field(min_length=1, description="Host of the TCPStore.")
    port: int = Field(ge=1, le=65535, description="Port of the TCPStore.")
    store_prefix: str = Field(min_length=1, description="Key prefix unique to this epoch.")

    @staticmethod
    def prefix_for(job_uid: str, epoch: int) -> str:
        """The store prefix of an epoch; no two epochs of a job share one."""
        return f"{job_uid}/epoch-{epoch}"


class PlanMember(OpenWireModel):
    """A pod that trains in this epoch, and the global rank of each of its GPUs."""

    pod: str = Field(min_length=1, description="Pod name.")
    pod_uid: str | None = Field(default=None, description="Pod UID, to tell a re-created pod from the old one.")
    address: str = Field(min_length=1, description="Pod IP or DNS name of its agent.")
    agent_port: int = Field(default=AGENT_PORT, ge=1, le=65535, description="The agent's control port.")
    ranks: list[int] = Field(min_length=1, description="Global rank of each local GPU, by local index.")


class StateSource(OpenWireModel):
    """Where one rank's state comes from when it enters the epoch."""

    rank: int = Field(ge=0)
    kind: StateSourceKind
    peer_rank: int | None = Field(default=None, ge=0, description="For kind=peer: the rank that sends.")
    checkpoint_step: int | None = Field(default=None, ge=0, description="For kind=checkpoint: its step.")


class ShardCopy(OpenWireModel):
    """A previous epoch's optimizer shard restored from a host copy instead of its owner's GPU."""

    previous_rank: int = Field(ge=0, description="The shard's owner in the previous epoch.")
    holder_rank: int = Field(ge=0, description="Rank, in this plan, of the process whose host memory holds the copy.")
    holder_pod: str = Field(min_length=1, description="The holder's pod.")
    buddy: bool = Field(
        description="True: the copy a buddy keeps for the owner (the owner is gone); false: the owner's own host "
        "snapshot (its GPU state is newer than the step every rank goes back to)."
    )
    step: int = Field(ge=0, description="The copy's step: the steps before it are in it.")


class HolderRun(OpenWireModel):
    """Previous ranks ``previousRank .. previousRank+count-1`` are held by ranks ``holderRank ..
    holderRank+count-1`` of this plan."""

    previous_rank: int = Field(ge=0)
    holder_rank: int = Field(ge=0)
    count: int = Field(ge=1)

    @staticmethod
    def runs_of(holders: list[int]) -> list[HolderRun]:
        """``holders`` (by previous rank) as runs."""
        runs: list[list[int]] = []  # [previous, holder, count]
        for previous, holder in enumerate(holders):
            if runs and runs[-1][1] + runs[-1][2] == holder:
                runs[-1][2] += 1
            else:
                runs.append([previous, holder, 1])
        return [HolderRun(previous_rank=p, holder_rank=h, count=n) for p, h, n in runs]


class OptimizerStatePlan(OpenWireModel):
    """The distributed optimizer's state in an epoch: its buddy copies and where each shard comes from.

    Sources, for ``source`` self or reshard: the previous epoch's shard of rank ``p`` is taken from
    the process that is now rank ``holder_ranks()[p]``: from its GPU, or, when ``p`` is listed in
    ``copies``, from its host memory. Every such shard is at step ``resumeStep``. Holders travel as
    runs of consecutive ranks (a plan for 4096 pods x 8 GPUs would carry 32768 of them).
    """

    replica_interval_steps: int = Field(
        default=1, ge=1, description="Steps between refreshes of the host copies (spec optimizer.replicaIntervalSteps)."
    )
    replica_cost_percent: float | None = Field(
        default=None,
        gt=0,
        le=100,
        description="The refreshes' cost budget in percent of the step time (spec optimizer.replicaCostPercent): "
        "the workers then refresh every N >= replicaIntervalSteps steps, N measured and agreed at the epoch's start.",
    )
    buddies: bool = Field(
        default=False,
        description="Every rank keeps a host copy of its shard with its buddy (MeshPlan.buddy_of), on another pod.",
    )
    source: OptimizerSourceKind = Field(description="Where the shards come from, for every rank.")
    previous_sizes: MeshSizes | None = Field(
        default=None, description="For source self or reshard: the layout of the previous epoch's shards."
    )
    holders: list[HolderRun] = Field(
        default_factory=list,
        description="For source self or reshard, by previous rank, in runs: the rank in this plan of the process "
        "holding that rank's shard.",
    )
    copies: list[ShardCopy] = Field(
        default_factory=list, description="Previous shards taken from a host copy; the others come from a GPU."
    )
    params_from_shards: bool = Field(
        default=False,
        description="Every rank's parameters are all-gathered from the restored shards' fp32 main parameters (no "
        "data-parallel peer holds them at the resume step); else stateSources says where they come from.",
    )
    steps_redone: int = Field(
        default=0, ge=0, description="Steps completed before the failure that are redone (the copies were older)."
    )

    def holder_ranks(self) -> list[int]:
        """By previous rank: the rank in this plan of the process holding its shard."""
        return [run.holder_rank + i for run in self.holders for i in range(run.count)]


@dataclasses.dataclass(frozen=True)
class ShardOrigin:
    """One previous shard a rank's optimizer shard is made of: its previous owner, the rank that holds
    it now, and the host copy it is taken from (None: the holder's GPU state)."""

    previous_rank: int
    holder_rank: int
    copy: ShardCopy | None


class MeshPlan(OpenWireModel):
    """Who trains as what in one epoch of a job."""

    job_uid: str = Field(min_length=1, description="UID of the MegatronJob.")
    epoch: int = Field(ge=1, description="Strictly increasing; agents refuse a plan not newer than theirs.")
    reason: PlanReason
    sizes: MeshSizes
    gpus_per_pod: int = Field(ge=1)
    batch: BatchGeometry
    rendezvous: Rendezvous
    members: list[PlanMember] = Field(min_length=1)
    resume_step: int = Field(ge=0, description="The step training continues from (the first not yet done).")
    # Every rank has a source; only the ranks that differ from the default are listed, so a plan
    # for 4096 pods x 8 GPUs stays far below etcd's object size limit (one entry per rank would
    # not: ~1.7 MB).
    default_source: StateSourceKind = Field(
        default=StateSourceKind.SELF, description="Source of every rank not listed in stateSources (not peer)."
    )
    default_checkpoint_step: int | None = Field(
        default=None, ge=0, description="For defaultSource=checkpoint: the checkpoint's step."
    )
    state_sources: list[StateSource] = Field(
        default_factory=list, description="Ranks whose source differs from defaultSource, at most one entry each."
    )
    optimizer_state: OptimizerStatePlan | None = Field(
        default=None,
        description="With the distributed optimizer: its buddy copies and the source of every shard. Older "
        "trainers ignore it (they reload the checkpoint whenever a shard moves).",
    )
    created_at: datetime | None = None

    @model_validator(mode="after")
    def _valid_mesh(self) -> MeshPlan:
        sizes = self.sizes
        if self.gpus_per_pod % sizes.tp:
            raise MeshError(f"gpusPerPod {self.gpus_per_pod} is not a multiple of tp {sizes.tp}")
        if len(self.batch.micro_batches_per_replica) != sizes.dp:
            raise MeshError(
                f"batch is split over {len(self.batch.micro_batches_per_replica)} replicas, mesh has dp={sizes.dp}"
            )
        pod_of: dict[int, str] = {}
        for member in self.members:
            if len(member.ranks) != self.gpus_per_pod:
                raise MeshError(f"pod {member.pod} has {len(member.ranks)} ranks, gpusPerPod is {self.gpus_per_pod}")
            for rank in member.ranks:
                if rank in pod_of:
                    raise MeshError(f"rank {rank} is given to both {pod_of[rank]} and {member.pod}")
                pod_of[rank] = member.pod
        if len({m.pod for m in self.members}) != len(self.members):
            raise MeshError("a pod appears twice among the members")
        if sorted(pod_of) != list(range(sizes.world)):
            raise MeshError(f"ranks are not exactly 0..{sizes.world - 1}")
        for rank, pod in pod_of.items():
            # tp is the fastest dimension, so a TP group is the block of tp consecutive ranks.
            first = rank - rank % sizes.tp
            if pod_of[first] != pod:
                raise MeshError(f"tensor-parallel group of rank {rank} spans pods {pod_of[first]} and {pod}")
        self._check_state_sources()
        if self.optimizer_state is not None:
            self._check_optimizer_state(self.optimizer_state, pod_of)
        return self

    def _check_state_sources(self) -> None:
        if self.default_source is StateSourceKind.PEER:
            raise MeshError("defaultSource cannot be peer: a peer source names its peer rank")
        if self.default_source is StateSourceKind.CHECKPOINT and self.default_checkpoint_step is None:
            raise MeshError("defaultSource checkpoint without defaultCheckpointStep")
        listed = {s.rank for s in self.state_sources}
        if len(listed) != len(self.state_sources):
            raise MeshError("stateSources names a rank more than once")
        if any(r >= self.sizes.world for r in listed):
            raise MeshError(f"stateSources names a rank outside 0..{self.sizes.world - 1}")
        for src in self.state_sources:
            if src.kind is StateSourceKind.PEER:
                if src.peer_rank is None or src.peer_rank >= self.sizes.world:
                    raise MeshError(f"rank {src.rank}: peer source without a valid peerRank")
                peer = self.source_of(src.peer_rank)
                if peer.kind is not StateSourceKind.SELF:
                    raise MeshError(
                        f"rank {src.rank}: peer {src.peer_rank} does not hold its state (it is {peer.kind.value})"
                    )
                if self.sizes.shard_key(src.rank) != self.sizes.shard_key(src.peer_rank):
                    raise MeshError(f"rank {src.rank}: peer {src.peer_rank} holds another model shard")
            elif src.kind is StateSourceKind.CHECKPOINT and src.checkpoint_step is None:
                raise MeshError(f"rank {src.rank}: checkpoint source without checkpointStep")

    def _check_optimizer_state(self, state: OptimizerStatePlan, pod_of: dict[int, str]) -> None:
        if state.buddies:
            for rank in range(self.sizes.world):
                buddy = self.buddy_of(rank)
                if buddy is None or pod_of[buddy] == pod_of[rank]:
                    raise MeshError(f"optimizerState.buddies: rank {rank} has no buddy on another pod")
        if state.source in (OptimizerSourceKind.CHECKPOINT, OptimizerSourceKind.INIT):
            if state.previous_sizes or state.holders or state.copies or state.params_from_shards or state.steps_redone:
                raise MeshError(f"optimizerState source {state.source.value} names no previous shards")
            if self.default_source.value != state.source.value or self.state_sources:
                raise MeshError(
                    f"optimizerState source {state.source.value} but defaultSource {self.default_source.value}: "
                    "a reload or a fresh start is for every rank"
                )
            return
        prev = state.previous_sizes
        starts = [0]
        for run in state.holders:
            starts.append(starts[-1] + run.count)
        if prev is None or starts[-1] != prev.world or [r.previous_rank for r in state.holders] != starts[:-1]:
            raise MeshError("optimizerState: source self or reshard needs previousSizes and a holder per previous rank")
        holders = state.holder_ranks()
        if (prev.tp, prev.pp, prev.cp, prev.ep) != (self.sizes.tp, self.sizes.pp, self.sizes.cp, self.sizes.ep):
            raise MeshError("optimizerState: only the data-parallel size may change between epochs")
        if (state.source is OptimizerSourceKind.SELF) != (prev.dp == self.sizes.dp):
            raise MeshError("optimizerState: source self needs the previous data-parallel size, reshard another one")
        if any(h >= self.sizes.world for h in holders):
            raise MeshError(f"optimizerState.holders names a rank outside 0..{self.sizes.world - 1}")
        if self.default_source in (StateSourceKind.CHECKPOINT, StateSourceKind.INIT):
            raise MeshError(f"optimizerState restores in memory but defaultSource is {self.default_source.value}")
        copied: set[int] = set()
        for copy in state.copies:
            p = copy.previous_rank
            if p >= prev.world or p in copied:
                raise MeshError(f"optimizerState.copies: previous rank {p} outside the old mesh or listed twice")
            copied.add(p)
            if copy.holder_rank != holders[p] or pod_of[copy.holder_rank] != copy.holder_pod:
                raise MeshError(f"optimizerState.copies: the copy of previous rank {p} is not where holders says")
            if copy.step != self.resume_step:
                raise MeshError(f"optimizerState.copies: rank {p}'s copy is of step {copy.step}, not resumeStep")
        if state.params_from_shards and (self.state_sources or self.default_source is not StateSourceKind.SELF):
            raise MeshError("optimizerState.paramsFromShards: stateSources must be the plain self default")
        if state.steps_redone and (len(copied) != prev.world or not state.params_from_shards):
            raise MeshError("optimizerState.stepsRedone: every shard and parameter must come from the older copies")

    def buddy_of(self, rank: int) -> int | None:
        """The rank that keeps a host copy of ``rank``'s optimizer shard: on another pod, so that losing
        one pod never loses both copies of a shard; None when the mesh is one pod.

        With two units or more (a unit: the replicas of one pod, or the pods of one replica) it is
        the same model-parallel position in the next unit, so it keeps a shard of its own shard's
        size; else (one replica over several pods) the same local GPU of the replica's next pod.
        Either way a permutation: every rank keeps exactly one copy, every pod gpusPerPod copies."""
        s, gpus = self.sizes, self.gpus_per_pod
        if not 0 <= rank < s.world:
            raise MeshError(f"rank {rank} outside 0..{s.world - 1}")
        if s.world // gpus < 2:
            return None
        # Plain arithmetic (a plan check calls this for every rank): rank = low + block*(dp + dp_size*pp)
        # with low = tp + tp_size*cp, and model-parallel index low + block*pp.
        block = s.tp * s.cp
        low, dp, pp = rank % block, rank // block % s.dp, rank // block // s.dp
        replicas_per_unit = max(1, gpus // s.model_parallel)
        if s.dp // replicas_per_unit >= 2:
            return low + block * ((dp + replicas_per_unit) % s.dp + s.dp * pp)
        index = (low + block * pp + gpus) % s.model_parallel
        return index % block + block * (dp + s.dp * (index // block))

    # -- queries used by both sides -------------------------------------------------------------

    def member(self, pod: str) -> PlanMember | None:
        """The member entry of a pod, or None when the pod does not train in this epoch."""
        return next((m for m in self.members if m.pod == pod), None)

    def source_of(self, rank: int) -> StateSource:
        """The state source of a rank: its entry in stateSources, else the default."""
        listed = next((s for s in self.state_sources if s.rank == rank), None)
        return listed or self._default_source_of(rank)

    def sources(self) -> list[StateSource]:
        """The state source of every rank, in rank order."""
        listed = {s.rank: s for s in self.state_sources}
        return [listed.get(r) or self._default_source_of(r) for r in range(self.sizes.world)]

    def source_kinds(self) -> set[StateSourceKind]:
        """The kinds of source some rank of this plan uses."""
        kinds = {s.kind for s in self.state_sources}
        if len(self.state_sources) < self.sizes.world:  # listed ranks are unique (validated)
            kinds.add(self.default_source)
        return kinds

    def _default_source_of(self, rank: int) -> StateSource:
        return StateSource(rank=rank, kind=self.default_source, checkpoint_step=self.default_checkpoint_step)

    def optimizer_sources_of(self, rank: int) -> list[ShardOrigin]:
        """The previous epoch's shards that ``rank``'s optimizer shard is made of, with where each is
        now; empty when the plan reloads a checkpoint or starts fresh (or has no optimizerState).

        Layout unchanged: the shard of the same rank. Resharded: every previous shard of its old
        data-parallel group (Megatron shards over the dp-cp group: same tp and pp coordinates), in
        that group's order; the rank takes from each the byte ranges it now owns."""
        state = self.optimizer_state
        if state is None or state.previous_sizes is None:
            return []
        prev = state.previous_sizes
        copies = {c.previous_rank: c for c in state.copies}
        if state.source is OptimizerSourceKind.SELF:
            previous = [rank]
        else:
            coords = self.sizes.coords_of(rank)
            previous = [r for r in range(prev.world) if (c := prev.coords_of(r)).tp == coords.tp and c.pp == coords.pp]
        holders = state.holder_ranks()
        return [ShardOrigin(p, holders[p], copies.get(p)) for p in previous]

    def pod_of_rank(self) -> dict[int, str]:
        """Map from global rank to pod name."""
        return {rank: m.pod for m in self.members for rank in m.ranks}

    @property
    def consumed_samples(self) -> int:
        """Samples consumed before ``resume_step`` (the global batch never changes)."""
        return self.resume_step * self.batch.global_batch_size

    @property
    def mesh_label(self) -> str:
        """``dp x tp x pp`` (and ``x cp`` when cp > 1), as printed by ``kubectl get``."""
        s = self.sizes
        return f"{s.dp}x{s.tp}x{s.pp}" + (f"x{s.cp}" if s.cp > 1 else "")
