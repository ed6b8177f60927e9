"""Mesh planning: a pure function from what the operator sees to the next :class:`MeshPlan`.

The atomic piece of a mesh is a *unit*: the smallest set of whole pods that holds whole
data-parallel replicas. When a replica spans pods (``tp*pp*cp > gpusPerPod``) a unit is the
``podsPerReplica`` pods of one replica; when a pod holds several replicas a unit is one pod and
its ``replicasPerPod`` replicas. Shrinking and growing add or remove whole units, so a tensor-
parallel group never spans pods and a pod never holds part of a dropped replica.

Policy, in order (docs/architecture.md):

1. a pod of the mesh that failed is replaced by a spare, in place: same ranks, same mesh; a spare
   outside the failed pod's failure domain (its rack or zone, then its node) first;
2. with spares exhausted, damaged units are dropped whole and their healthy pods go back to the
   pool, where they may repair another damaged unit;
3. never below ``minReplicas``: then there is no plan and the job waits (Degraded); with experts
   split over ``ep`` replicas, the data-parallel size stays a multiple of ``ep`` (a shrink drops
   whole expert-parallel groups, a growth adds them);
4. with pods to spare and fewer than ``replicas`` replicas, the mesh grows back.

A pod keeps its state (``self``) when it stays in the mesh at the same model-parallel position
(and expert-parallel rank: :meth:`MeshSizes.shard_key`); every other rank receives it from a
data-parallel peer at the same position that keeps its own,
or, when no replica holds that shard any more, every rank reloads the newest checkpoint (or, with
no checkpoint configured, training starts over from the seed). With the distributed optimizer each
rank's optimizer shard is its own: the plan's ``optimizerState`` names where every shard comes
from (its GPU, a host copy on a buddy's pod, a reshard of the old group's), or, when some shard has
no live source or the trainers cannot restore them in memory, every rank reloads the checkpoint
(optimizer_sources.py).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime

from megatron_contract.job import MegatronJobSpec
from megatron_contract.mesh import (
    BatchGeometry,
    MeshPlan,
    MeshSizes,
    OptimizerSourceKind,
    OptimizerStatePlan,
    PlanMember,
    PlanReason,
    Rendezvous,
    StateSource,
    StateSourceKind,
)
from megatron_contract.wire import AGENT_PORT, RENDEZVOUS_PORT
from megatron_operator.optimizer_sources import optimizer_sources
from megatron_operator.per_plan import PerPlan


@dataclasses.dataclass(frozen=True)
class PodRef:
    """A healthy pod the planner may place: its name, UID and the address of its agent."""

    name: str
    uid: str
    address: str


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a pod runs: its node and the node's failure domain (the value of the job's
    ``failureDomain.topologyKey`` label), None when not known (never taken for a failed pod's)."""

    node: str | None = None
    domain: str | None = None


class Outcome(enum.StrEnum):
    """What the planner decided."""

    UNCHANGED = "unchanged"  # the previous plan stands
    NEW_PLAN = "new-plan"
    WAIT = "wait"  # too few pods for minReplicas: no plan; the job waits for capacity


@dataclasses.dataclass(frozen=True)
class PlanDecision:
    """The planner's answer.

    Attributes:
        outcome: what was decided.
        plan: the new plan (NEW_PLAN) or the previous one (UNCHANGED); None for WAIT.
        promoted: spares that joined the mesh.
        released: pods of the previous mesh that left it healthy and are spares again.
        lost: pods of the previous mesh that are gone or failed.
        message: one line for events and status.
    """

    outcome: Outcome
    plan: MeshPlan | None
    promoted: tuple[str, ...] = ()
    released: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    message: str = ""


@dataclasses.dataclass(frozen=True)
class UnitShape:
    """How replicas map onto pods for a spec."""

    pods_per_unit: int
    replicas_per_unit: int
    gpus_per_pod: int
    model_parallel: int
    ep: int = 1

    @classmethod
    def of(cls, spec: MegatronJobSpec) -> UnitShape:
        return cls(spec.pods_per_replica, spec.replicas_per_pod, spec.gpus_per_pod, spec.model_parallel, spec.ep)

    def units_for(self, replicas: int) -> int:
        """Units that hold ``replicas`` replicas (replicas is a multiple of replicas_per_unit)."""
        return replicas // self.replicas_per_unit

    def whole(self, units: int) -> int:
        """The most units, at most ``units``, whose replicas make whole expert-parallel groups
        (dp a multiple of ep, as Megatron requires); ``units`` itself without experts."""
        step = math.lcm(self.ep, self.replicas_per_unit) // self.replicas_per_unit
        return units - units % step

    def slot(self, unit: int, position: int, local: int) -> tuple[int, int]:
        """(dp rank, model-parallel index) of GPU ``local`` of the pod at ``position`` in ``unit``."""
        if self.pods_per_unit > 1:
            return unit, position * self.gpus_per_pod + local
        return unit * self.replicas_per_unit + local // self.model_parallel, local % self.model_parallel


def _rank(sizes: MeshSizes, dp: int, mp_index: int) -> int:
    """The global rank of model-parallel index ``mp_index`` in data-parallel replica ``dp``."""
    # Model-parallel index inside one replica: tp fastest, then cp, then pp (Megatron's order).
    tp, rest = mp_index % sizes.tp, mp_index // sizes.tp
    cp, pp = rest % sizes.cp, rest // sizes.cp
    return sizes.rank_at(tp, cp, dp, pp)


@functools.lru_cache(maxsize=8)
def _pod_ranks(shape: UnitShape, sizes: tuple[int, int, int, int, int, int]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The global ranks of each pod's GPUs, by unit and position in it, for a mesh of ``sizes``
    (world, tp, pp, cp, dp, ep): made once per mesh (every plan and every pass of a large job asks
    for them; rank by rank that was ~30 ms a plan at 4096 pods)."""
    world, tp, pp, cp, dp, ep = sizes
    mesh = MeshSizes(world=world, tp=tp, pp=pp, cp=cp, dp=dp, ep=ep)
    return tuple(
        tuple(
            tuple(_rank(mesh, *shape.slot(unit, position, local)) for local in range(shape.gpus_per_pod))
            for position in range(shape.pods_per_unit)
        )
        for unit in range(dp // shape.replicas_per_unit)
    )


def _sizes_key(sizes: MeshSizes) -> tuple[int, int, int, int, int, int]:
    return sizes.world, sizes.tp, sizes.pp, sizes.cp, sizes.dp, sizes.ep


def _units_of(plan: MeshPlan, shape: UnitShape) -> list[list[str]]:
    """The previous mesh as units: for each unit, its pod names by position (shared by every pass
    that asks about the same plan: not to be changed)."""
    pod_of = plan.pod_of_rank()
    return [[pod_of[ranks[0]] for ranks in unit] for unit in _pod_ranks(shape, _sizes_key(plan.sizes))]


#: Every reconcile pass asks for the units of the plan in force (at 4096 pods ~50 ms each time).
_previous_units: PerPlan[UnitShape, list[list[str]]] = PerPlan(_units_of)


def _resume(reported: int | None, previous: int) -> int:
    # Never behind the previous plan: steps before it were completed by the whole mesh.
    return max(previous, reported if reported is not None else 0)


def plan_mesh(
    spec: MegatronJobSpec,
    job_uid: str,
    healthy_active: Sequence[PodRef],
    healthy_spares: Sequence[PodRef],
    failed: Collection[str],
    previous: MeshPlan | None,
    *,
    resume_step: int | None = None,
    checkpoint_step: int | None = None,
    store_hosts: Sequence[str] = (),
    previous_trained: bool = True,
    retry: bool = False,
    now: datetime | None = None,
    placement: Mapping[str, Placement] | None = None,
    copy_steps: Mapping[str, Collection[int]] | None = None,
    in_memory_optimizer: bool = False,
) -> PlanDecision:
    """The next mesh plan.

    Args:
        spec: the job's spec.
        job_uid: the job's UID (plans and store prefixes carry it).
        healthy_active: healthy pods of the current mesh (or the worker pods, before the first plan).
        healthy_spares: healthy pods outside the mesh, usable as spares, in order of preference.
        failed: names of pods known to have failed; they never enter a plan.
        previous: the plan in force, or None before the first one.
        resume_step: the first step not yet completed by the surviving trainers, when known.
        checkpoint_step: step of the newest complete checkpoint, when known; used only when no
            data-parallel peer still holds some shard of the state.
        store_hosts: pods whose agents reported recently, freshest first; the rendezvous store
            is hosted by the first of them that is a member (a pod that only looks Running may
            have died a moment ago, and a store nobody can reach stalls the whole epoch).
        previous_trained: whether every member of ``previous`` committed a step in its epoch.
            When not, the ranks that were to receive their state in it never did: only ranks
            that kept their own state then still hold any.
        retry: every member abandoned the join of ``previous`` and nobody is to blame: a new plan
            (a new epoch, its store on the freshest member) even when no pod was lost.
        now: the plan's creation time.
        placement: where pods run (or ran), by name, failed ones included: a failed pod's
            replacement is taken from outside its failure domain, then outside its node, when such
            a spare is ready.
        copy_steps: with the distributed optimizer, by pod: the steps of which it holds complete host
            copies of optimizer shards made under ``previous`` (its agent's ``replicaSteps``, from a
            report of ``previous``'s epoch: copies of an older epoch follow another buddy assignment).
        in_memory_optimizer: the trainers restore distributed-optimizer shards from host copies and
            reshard them in memory; when not, a shard that moves reloads the checkpoint for everyone.

    Returns:
        The decision; its plan, when new, has passed every invariant of :class:`MeshPlan`.
    """
    placement = placement or {}
    shape = UnitShape.of(spec)
    max_units = shape.units_for(spec.replicas)
    min_units = shape.units_for(spec.min_replicas)
    failed_set = set(failed)
    active = {p.name: p for p in healthy_active if p.name not in failed_set}
    spares = [p for p in healthy_spares if p.name not in failed_set and p.name not in active]

    if previous is None:
        copies = _Copies({}, in_memory_optimizer)
        return _first_plan(spec, job_uid, shape, active, spares, checkpoint_step, now, store_hosts, copies)

    previous_units = _previous_units(previous, shape)
    uid_of = {m.pod: m.pod_uid for m in previous.members}
    # A member survives only if the very pod of the plan (same UID) is still healthy.
    survivors = {
        name
        for unit in previous_units
        for name in unit
        if name in active and (uid_of[name] is None or active[name].uid == uid_of[name])
    }
    lost = tuple(sorted({name for unit in previous_units for name in unit} - survivors))
    intact = [u for u in previous_units if all(n in survivors for n in u)]
    damaged = [u for u in previous_units if not all(n in survivors for n in u)]

    damaged_survivors = sum(1 for u in damaged for n in u if n in survivors)
    available = len(intact) * shape.pods_per_unit + damaged_survivors + len(spares)
    n_units = shape.whole(min(max_units, available // shape.pods_per_unit))
    current_units = len(previous_units)

    if not lost and n_units == current_units and not retry:
        return PlanDecision(Outcome.UNCHANGED, previous)
    if n_units < min_units:
        return PlanDecision(
            Outcome.WAIT,
            None,
            lost=lost,
            message=(
                f"{available} healthy pods hold {n_units * shape.replicas_per_unit} replicas, "
                f"below minReplicas {spec.min_replicas}; waiting for capacity"
            ),
        )

    new_units = _new_units(shape, previous_units, intact, damaged, survivors, n_units, active, spares, lost, placement)
    members = {p.name for u in new_units for p in u}
    promoted = tuple(p.name for u in new_units for p in u if p.name not in survivors)
    released = tuple(sorted(n for n in survivors if n not in members))
    if n_units < current_units:
        # Fewer units with every pod healthy: the user lowered spec.replicas.
        reason = PlanReason.SHRINK if lost else PlanReason.RESIZE
    elif n_units > current_units:
        reason = PlanReason.GROW
    else:
        reason = PlanReason.REPLACE
    resume = _resume(resume_step, previous.resume_step)
    plan = _build(
        spec,
        job_uid,
        previous.epoch + 1,
        reason,
        shape,
        new_units,
        previous,
        resume,
        checkpoint_step,
        now,
        store_hosts,
        previous_trained,
        _Copies(copy_steps or {}, in_memory_optimizer),
    )
    message = (
        f"{reason.value}: mesh {previous.mesh_label} -> {plan.mesh_label}"
        + (f", lost {', '.join(lost)}" if lost else "")
        + (f", promoted {', '.join(promoted)}" if promoted else "")
        + (f", released {', '.join(released)}" if released else "")
        + (f" (spec.replicas is {spec.replicas})" if reason is PlanReason.RESIZE else "")
        + (f"; every member abandoned epoch {previous.epoch}, joining again" if retry and not lost else "")
    )
    return PlanDecision(Outcome.NEW_PLAN, plan, promoted=promoted, released=released, lost=lost, message=message)


def _first_plan(
    spec: MegatronJobSpec,
    job_uid: str,
    shape: UnitShape,
    active: Mapping[str, PodRef],
    spares: Sequence[PodRef],
    checkpoint_step: int | None,
    now: datetime | None,
    store_hosts: Sequence[str],
    copies: _Copies,
) -> PlanDecision:
    """The job's first plan: as many whole units of the pods as the spec asks for, workers first."""
    max_units, min_units = shape.units_for(spec.replicas), shape.units_for(spec.min_replicas)
    pool = [*active.values(), *spares]
    n_units = shape.whole(min(max_units, len(pool) // shape.pods_per_unit))
    if n_units < min_units or n_units == 0:
        return PlanDecision(
            Outcome.WAIT,
            None,
            message=f"{len(pool)} healthy pods; the first plan needs {min_units * shape.pods_per_unit}",
        )
    units = [[pool[u * shape.pods_per_unit + j] for j in range(shape.pods_per_unit)] for u in range(n_units)]
    promoted = tuple(p.name for u in units for p in u if p.name not in active)
    plan = _build(
        spec,
        job_uid,
        1,
        PlanReason.INITIAL,
        shape,
        units,
        None,
        0,
        checkpoint_step,
        now,
        store_hosts,
        True,
        copies,  # none yet; whether to keep them
    )
    return PlanDecision(Outcome.NEW_PLAN, plan, promoted=promoted, message=f"initial mesh {plan.mesh_label}")


def first_plan_replica(spec: MegatronJobSpec, worker: int) -> int:
    """The data-parallel replica (its first GPU's) that the first plan gives the ``worker``-th
    running worker in serial order: :func:`_first_plan` fills whole units in that order."""
    shape = UnitShape.of(spec)
    return shape.slot(worker // shape.pods_per_unit, worker % shape.pods_per_unit, 0)[0]


def _new_units(
    shape: UnitShape,
    previous_units: list[list[str]],
    intact: list[list[str]],
    damaged: list[list[str]],
    survivors: set[str],
    n_units: int,
    active: Mapping[str, PodRef],
    spares: Sequence[PodRef],
    lost: Sequence[str],
    placement: Mapping[str, Placement],
) -> list[list[PodRef]]:
    """The pods of each unit of the next mesh: surviving units where they were, holes filled."""
    # Keep intact units; rebuild the damaged units with the most survivors first; the survivors of
    # the damaged units not rebuilt join the pool and fill the holes of the ones that are.
    by_survivors = sorted(damaged, key=lambda u: -sum(1 for n in u if n in survivors))
    slots: list[list[str] | None]
    if shape.ep == 1:
        keep_damaged = by_survivors[: max(0, n_units - len(intact))]
        kept = {id(u) for u in intact[:n_units]} | {id(u) for u in keep_damaged}
        # Kept units stay in their previous order, so dp ranks move as little as possible.
        slots = [u for u in previous_units if id(u) in kept]
        slots += [None] * (n_units - len(slots))
    else:
        slots = _by_expert_rank(intact + by_survivors, previous_units, n_units, shape)
    placed = {id(u) for u in slots if u is not None}
    # Spares first, so released pods tend to stay spares; but a pod in a failure domain that just
    # lost pods (the same node, rack or zone) comes last: what took the lost pod may take it next.
    fillers: list[PodRef] = list(spares)
    fillers.extend(active[n] for u in previous_units if id(u) not in placed for n in u if n in survivors)
    suspect = _suspect_domains(lost, placement)
    fillers = [p for _, p in sorted(enumerate(fillers), key=lambda ip: (*suspect(ip[1]), ip[0]))]
    fillers.reverse()  # pop() takes the first

    new_units: list[list[PodRef]] = []
    for slot in slots:
        if slot is None:
            new_units.append([fillers.pop() for _ in range(shape.pods_per_unit)])
        else:
            new_units.append([active[name] if name in survivors else fillers.pop() for name in slot])
    return new_units


def boundary_lead(spec: MegatronJobSpec, step_seconds: float | None) -> int:
    """Steps between the reported step and a plan's step boundary when members switch plans without
    a failure (a drain's move, a suspension): enough for the reports' lag (a heartbeat interval) and
    the plan's push, so that no member has passed the boundary when the plan lands. Counted at the
    fastest recent step and twice over: steps speed up, and a loaded operator pushes late (a member
    that overtakes the boundary aborts a step its peers commit; seen on a loaded 2-core machine)."""
    lag = 2 * (2 * spec.failure_detection.heartbeat_interval_seconds + 1.0)
    return max(2, math.ceil(lag / step_seconds) + 1) if step_seconds else 4


def plan_resume(
    spec: MegatronJobSpec,
    job_uid: str,
    pods: Sequence[PodRef],
    previous: MeshPlan,
    checkpoint_step: int | None,
    *,
    store_hosts: Sequence[str] = (),
    now: datetime | None = None,
    in_memory_optimizer: bool = False,
) -> PlanDecision:
    """The plan of a suspended job's new pods: laid out as a first plan (the spec's mesh, as far as
    ``pods`` allow), numbered after ``previous`` (the plan in force when the job stopped, whose pods
    are gone), every rank loading the checkpoint of ``checkpoint_step`` (from the seed when there
    is none: nothing was trained). ``in_memory_optimizer`` as for :func:`plan_mesh`."""
    shape = UnitShape.of(spec)
    n_units = shape.whole(min(shape.units_for(spec.replicas), len(pods) // shape.pods_per_unit))
    if n_units < shape.units_for(spec.min_replicas) or n_units == 0:
        needed = shape.units_for(spec.min_replicas) * shape.pods_per_unit
        return PlanDecision(Outcome.WAIT, None, message=f"{len(pods)} healthy pods; resuming needs {needed}")
    units = [[pods[u * shape.pods_per_unit + j] for j in range(shape.pods_per_unit)] for u in range(n_units)]
    plan = _build(
        spec,
        job_uid,
        previous.epoch + 1,
        PlanReason.RESUME,
        shape,
        units,
        previous,
        0,
        checkpoint_step,
        now,
        store_hosts,
        False,
        _Copies({}, in_memory_optimizer),  # the suspended pods, and the host copies they held, are gone
    )
    start = f"the checkpoint of step {checkpoint_step}" if checkpoint_step is not None else "the seed (nothing trained)"
    return PlanDecision(
        Outcome.NEW_PLAN,
        plan,
        promoted=tuple(p.name for u in units for p in u),
        message=f"resume: mesh {plan.mesh_label} from {start}",
    )


def _by_expert_rank(
    candidates: list[list[str]], previous_units: list[list[str]], n_units: int, shape: UnitShape
) -> list[list[str] | None]:
    """The previous units that stay, by new position (None: a unit of spares): each candidate, in
    order of preference, takes the first free position whose replicas have the expert-parallel
    ranks its replicas had, so that it keeps its experts; the rest fill the positions left over."""
    index = {id(u): i for i, u in enumerate(previous_units)}

    def phase(position: int) -> int:
        return (position * shape.replicas_per_unit) % shape.ep

    slots: list[list[str] | None] = [None] * n_units
    unmatched = []
    for unit in candidates:
        free = next((j for j in range(n_units) if slots[j] is None and phase(j) == phase(index[id(unit)])), None)
        if free is None:
            unmatched.append(unit)
        else:
            slots[free] = unit
    for j, unit in zip([j for j in range(n_units) if slots[j] is None], unmatched, strict=False):
        slots[j] = unit
    return slots


def _suspect_domains(
    lost: Collection[str], placement: Mapping[str, Placement]
) -> Callable[[PodRef], tuple[bool, bool]]:
    """How suspect a candidate is, as a sort key: (in a failure domain that lost a pod, on a node
    that lost one). A larger domain goes first: a rack that lost a node may lose the next."""
    nodes = {placement[n].node for n in lost if n in placement} - {None}
    domains = {placement[n].domain for n in lost if n in placement} - {None}

    def key(pod: PodRef) -> tuple[bool, bool]:
        place = placement.get(pod.name, Placement())
        return place.domain is not None and place.domain in domains, place.node is not None and place.node in nodes

    return key


def _build(
    spec: MegatronJobSpec,
    job_uid: str,
    epoch: int,
    reason: PlanReason,
    shape: UnitShape,
    units: list[list[PodRef]],
    previous: MeshPlan | None,
    resume_step: int,
    checkpoint_step: int | None,
    now: datetime | None,
    store_hosts: Sequence[str],
    previous_trained: bool,
    copies: _Copies,
) -> MeshPlan:
    dp = len(units) * shape.replicas_per_unit
    sizes = MeshSizes(world=spec.model_parallel * dp, tp=spec.tp, pp=spec.pp, cp=spec.cp, dp=dp, ep=spec.ep)
    # A member that stays as it was is the previous plan's (plans are never changed in place): at
    # 4096 pods, validating every member anew was a fifth of a replacement's planning.
    same = {
        (m.pod, m.pod_uid, m.address, tuple(m.ranks)): m
        for m in (previous.members if previous is not None else ())
        if m.agent_port == AGENT_PORT and not m.model_extra  # fields of another version are not ours to repeat
    }
    members = [
        same.get((pod.name, pod.uid, pod.address, ranks))
        or PlanMember(pod=pod.name, pod_uid=pod.uid, address=pod.address, agent_port=AGENT_PORT, ranks=list(ranks))
        for unit, unit_ranks in zip(units, _pod_ranks(shape, _sizes_key(sizes)), strict=True)
        for pod, ranks in zip(unit, unit_ranks, strict=True)
    ]
    sources = _state_sources(sizes, members, previous, checkpoint_step, previous_trained)
    optimizer_state = None
    if spec.training.optimizer.distributed:
        sources, optimizer_state, resume_step = _with_optimizer_shards(
            spec, sizes, members, previous, sources, resume_step, checkpoint_step, previous_trained, copies
        )
        if (budget := spec.training.optimizer.replica_cost_percent) is not None:
            optimizer_state = optimizer_state.model_copy(update={"replica_cost_percent": budget})
    elif previous is not None and sources.default is not StateSourceKind.SELF:
        # Some shard is held by nobody: everyone restarts from the checkpoint step (or from 0).
        resume_step = sources.checkpoint_step or 0
    members.sort(key=lambda m: m.ranks[0])
    host = _rendezvous_host(members, sources.keepers, store_hosts)
    return MeshPlan(
        job_uid=job_uid,
        epoch=epoch,
        reason=reason,
        sizes=sizes,
        gpus_per_pod=spec.gpus_per_pod,
        batch=BatchGeometry.split(spec.training.global_batch_size, spec.training.micro_batch_size, dp),
        rendezvous=Rendezvous(host=host, port=RENDEZVOUS_PORT, store_prefix=Rendezvous.prefix_for(job_uid, epoch)),
        members=members,
        resume_step=resume_step,
        default_source=sources.default,
        default_checkpoint_step=sources.checkpoint_step,
        state_sources=sources.listed,
        optimizer_state=optimizer_state,
        created_at=now,
    )


@dataclasses.dataclass(frozen=True)
class _Copies:
    """What the planner knows of the distributed optimizer's host copies."""

    steps: Mapping[str, Collection[int]]  # by pod: steps of the complete copies it holds
    in_memory: bool  # the trainers restore shards from them (and reshard in memory)


def _with_optimizer_shards(
    spec: MegatronJobSpec,
    sizes: MeshSizes,
    members: list[PlanMember],
    previous: MeshPlan | None,
    sources: _Sources,
    resume_step: int,
    checkpoint_step: int | None,
    previous_trained: bool,
    copies: _Copies,
) -> tuple[_Sources, OptimizerStatePlan, int]:
    """The state sources, optimizer state plan and resume step with the distributed optimizer,
    whose shards move whenever a rank or the data-parallel size changes."""
    found = optimizer_sources(
        sizes,
        spec.gpus_per_pod,
        members,
        previous,
        interval_steps=spec.training.optimizer.replica_interval_steps,
        survivors_step=resume_step,
        previous_trained=previous_trained,
        copy_steps=copies.steps,
        in_memory=copies.in_memory,
    )
    if found.reload:
        if previous is not None:
            kind = StateSourceKind.CHECKPOINT if checkpoint_step is not None else StateSourceKind.INIT
            step = checkpoint_step if kind is StateSourceKind.CHECKPOINT else None
            sources = _Sources(kind, step, [], frozenset())
            resume_step = step or 0
        state = found.state.model_copy(update={"source": OptimizerSourceKind(sources.default.value)})
        return sources, state, resume_step
    assert found.resume_step is not None
    state = found.state
    if state.params_from_shards or sources.default is not StateSourceKind.SELF:
        # No data-parallel peer holds some model shard at the resume step: every rank gathers its
        # parameters from the restored shards' fp32 main parameters.
        state = state.model_copy(update={"params_from_shards": True})
        sources = _Sources(StateSourceKind.SELF, None, [], sources.keepers)
    return sources, state, found.resume_step


@dataclasses.dataclass(frozen=True)
class _Sources:
    """Where every rank's state comes from, as the plan carries it: a default plus exceptions."""

    default: StateSourceKind  # init, checkpoint, or self (survivors keep theirs)
    checkpoint_step: int | None  # for a checkpoint default
    listed: list[StateSource]  # ranks that differ from the default: newcomers taking a peer's state
    keepers: frozenset[int]  # ranks that keep their own state


def _state_sources(
    sizes: MeshSizes,
    members: list[PlanMember],
    previous: MeshPlan | None,
    checkpoint_step: int | None,
    previous_trained: bool,
) -> _Sources:
    if previous is None:
        return _Sources(StateSourceKind.INIT, None, [], frozenset())

    # What each previous member held: pod (by UID when known) -> shard keys it held. A
    # plan that never trained delivered nothing: only the ranks that kept their own state in it
    # hold one (a plan whose default was a reload or a fresh start leaves nobody holding any).
    kept_own = (
        None
        if previous_trained
        else {r for r, source in enumerate(previous.sources()) if source.kind is StateSourceKind.SELF}
    )
    previous_keys, keys = previous.sizes.shard_keys(), sizes.shard_keys()
    held = {
        (m.pod, m.pod_uid): {previous_keys[r] for r in m.ranks if kept_own is None or r in kept_own}
        for m in previous.members
    }
    keeps: dict[int, bool] = {}
    for m in members:
        had = held.get((m.pod, m.pod_uid), ())
        for rank in m.ranks:
            keeps[rank] = keys[rank] in had
    holder: dict[tuple[int, int, int, int], int] = {}
    for rank in sorted(keeps):
        if keeps[rank]:
            holder.setdefault(keys[rank], rank)
    if any(keys[r] not in holder for r in keeps):
        if checkpoint_step is not None:
            return _Sources(StateSourceKind.CHECKPOINT, checkpoint_step, [], frozenset())
        return _Sources(StateSourceKind.INIT, None, [], frozenset())
    listed = [
        StateSource(rank=r, kind=StateSourceKind.PEER, peer_rank=holder[keys[r]]) for r in sorted(keeps) if not keeps[r]
    ]
    return _Sources(StateSourceKind.SELF, None, listed, frozenset(r for r, kept in keeps.items() if kept))


def _rendezvous_host(members: list[PlanMember], keeps: frozenset[int], store_hosts: Sequence[str]) -> str:
    """Every agent runs a store. Prefer a member whose agent reported recently (freshest first,
    keepers before newcomers), then a keeper, then the first member."""
    # By pod name, in one pass each: comparing the members themselves (pydantic models) made this
    # quadratic, ~1 s of every replacement's planning at 1024 pods.
    by_name = {m.pod: m for m in members}
    fresh = [by_name[name] for name in store_hosts if name in by_name]
    keepers = [m for m in members if any(r in keeps for r in m.ranks)]
    keeper_pods = {m.pod for m in keepers}
    fresh_keepers = [m for m in fresh if m.pod in keeper_pods]
    return (fresh_keepers or fresh or keepers or members)[0].address
