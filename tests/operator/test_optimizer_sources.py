"""The distributed optimizer's shards in the plan (``MeshPlan.optimizerState``, planner).

Scenarios:
- a replaced pod's shards come from its buddies' host copies, the survivors keep theirs: nothing
  redone; with the copies one step behind, every rank goes back to the copies and the plan says
  how many steps are redone; with the copies unknown, everyone reloads the checkpoint;
- a shrink reshards from the old owners and the buddies of the lost ones;
- trainers without in-memory restore reload the checkpoint whenever a shard moves, and are asked
  for no copies; the trainers restore dense models without context parallelism in memory, the
  others (experts, cp > 1) reload;
- one pod: no buddy on another pod, no copies; the copies' cost budget is in every plan of a job
  that sets one;
- property (hypothesis), over meshes (tp, pp, cp, ep, gpus per pod, pods): the buddy assignment is
  a permutation (every rank keeps one copy, every pod gpusPerPod copies), deterministic, puts
  every buddy on another pod (losing one pod never loses both copies of a shard) and, with two
  units or more, at the same model-parallel position (a copy of its own shard's size);
- property (hypothesis), for any failures, arrivals and copies reported: every previous shard
  that a plan restores in memory is live (its owner's GPU on a pod that stayed, or a host copy of
  the resume step on the owner's or its buddy's pod, reported by that pod), every new rank's
  sources cover its old data-parallel group; else every rank reloads the newest checkpoint;
  replacing one lost pod with copies of the survivors' step never redoes a step; without
  optimizerState (what an older agent reads) the plan is still valid.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from mesh_strategies import specs
from operator_factories import JOB_UID, make_pod_refs, make_spec

from megatron_contract.job import MegatronJobSpec
from megatron_contract.mesh import MeshError, MeshPlan, OptimizerSourceKind, PlanReason, StateSourceKind
from megatron_operator.optimizer_sources import in_memory_restore, restore_point
from megatron_operator.planner import Outcome, PodRef, UnitShape, plan_mesh

CHECKPOINT = {"path": "/ckpt", "interval_steps": 10}


def distributed_spec(**fields: object) -> MegatronJobSpec:
    spec = make_spec(checkpoint=CHECKPOINT, **fields)  # type: ignore[arg-type]
    wire = spec.to_wire()
    wire["training"]["optimizer"]["distributed"] = True
    return MegatronJobSpec.model_validate(wire)


def _initial(spec: MegatronJobSpec, pods: list[PodRef], in_memory: bool = True) -> MeshPlan:
    decision = plan_mesh(spec, JOB_UID, pods, [], [], None, in_memory_optimizer=in_memory)
    assert decision.plan is not None
    return decision.plan


def _replace(
    spec: MegatronJobSpec,
    plan: MeshPlan,
    pods: list[PodRef],
    lost: list[str],
    copies: Mapping[str, Collection[int]],
    *,
    in_memory: bool = True,
) -> MeshPlan:
    members = {m.pod for m in plan.members}
    active = [p for p in pods if p.name in members and p.name not in lost]
    spares = [p for p in pods if p.name not in members and p.name not in lost]
    new = plan_mesh(
        spec,
        JOB_UID,
        active,
        spares,
        lost,
        plan,
        resume_step=20,
        checkpoint_step=10,
        copy_steps=copies,
        in_memory_optimizer=in_memory,
    ).plan
    assert new is not None
    return new


def test_a_replaced_pod_takes_its_shards_from_its_buddies_copies() -> None:
    spec = distributed_spec(replicas=2, spares=1, tp=2, gpus_per_pod=2)
    pods = make_pod_refs(3)
    plan = _initial(spec, pods[:2])
    assert plan.optimizer_state is not None and plan.optimizer_state.buddies
    assert [plan.buddy_of(r) for r in range(4)] == [2, 3, 0, 1]
    new = _replace(spec, plan, pods, ["p0"], {"p1": [20], "p2": []})
    state = new.optimizer_state
    assert state is not None and state.source is OptimizerSourceKind.SELF
    assert new.resume_step == 20 and state.steps_redone == 0 and not state.params_from_shards
    # p2 took ranks 0, 1; their shards are p1's host copies, p1's own stay on its GPUs.
    assert new.member("p2").ranks == [0, 1]  # type: ignore[union-attr]
    assert state.holder_ranks() == [2, 3, 2, 3]
    assert [(c.previous_rank, c.holder_pod, c.buddy, c.step) for c in state.copies] == [
        (0, "p1", True, 20),
        (1, "p1", True, 20),
    ]
    assert [o.holder_rank for o in new.optimizer_sources_of(0)] == [2]
    assert new.optimizer_sources_of(2)[0].copy is None  # its own GPU
    assert {s.kind for s in new.sources()} == {StateSourceKind.SELF, StateSourceKind.PEER}  # parameters


def test_the_copies_cost_budget_travels_in_every_plan_of_the_job() -> None:
    wire = distributed_spec(replicas=2, spares=1).to_wire()
    wire["training"]["optimizer"]["replicaCostPercent"] = 2.5
    spec = MegatronJobSpec.model_validate(wire)
    pods = make_pod_refs(3)
    plan = _initial(spec, pods[:2])
    assert plan.optimizer_state is not None and plan.optimizer_state.replica_cost_percent == 2.5
    new = _replace(spec, plan, pods, ["p0"], {"p1": [20], "p2": []})
    assert new.optimizer_state is not None and new.optimizer_state.replica_cost_percent == 2.5
    plain = _initial(distributed_spec(replicas=2), pods[:2])
    assert plain.optimizer_state is not None and plain.optimizer_state.replica_cost_percent is None


def test_copies_newer_than_the_lagging_reports_are_taken_with_nothing_redone() -> None:
    spec = distributed_spec(replicas=2, spares=1, tp=2, gpus_per_pod=2)
    pods = make_pod_refs(3)
    plan = _initial(spec, pods[:2])
    # The reports said step 20; copies of steps 22 and 21 are complete since (a refresh every step).
    new = _replace(spec, plan, pods, ["p0"], {"p1": [22, 21]})
    state = new.optimizer_state
    assert state is not None and state.source is OptimizerSourceKind.SELF
    assert new.resume_step == 22 and state.steps_redone == 0
    assert [(c.previous_rank, c.holder_pod, c.buddy, c.step) for c in state.copies] == [
        (0, "p1", True, 22),
        (1, "p1", True, 22),
    ]


def test_copies_a_step_behind_redo_that_step_for_every_rank() -> None:
    spec = distributed_spec(replicas=2, spares=1, tp=2, gpus_per_pod=2)
    pods = make_pod_refs(3)
    plan = _initial(spec, pods[:2])
    # The refresh of step 20 was in flight: p1 holds complete copies of step 19 only.
    new = _replace(spec, plan, pods, ["p0"], {"p1": [19]})
    state = new.optimizer_state
    assert state is not None and new.resume_step == 19 and state.steps_redone == 1
    assert state.params_from_shards and {c.step for c in state.copies} == {19}
    # p1's own shards from its own snapshot (no transfer), p0's from the copies p1 keeps for it.
    assert [(c.previous_rank, c.holder_rank, c.buddy) for c in state.copies] == [
        (0, 2, True),
        (1, 3, True),
        (2, 2, False),
        (3, 3, False),
    ]


def test_without_a_live_copy_every_rank_reloads_the_newest_checkpoint() -> None:
    spec = distributed_spec(replicas=2, spares=1, tp=2, gpus_per_pod=2)
    pods = make_pod_refs(3)
    plan = _initial(spec, pods[:2])
    new = _replace(spec, plan, pods, ["p0"], {})
    assert new.optimizer_state is not None and new.optimizer_state.source is OptimizerSourceKind.CHECKPOINT
    assert new.default_source is StateSourceKind.CHECKPOINT and new.default_checkpoint_step == 10
    assert new.resume_step == 10 and not new.state_sources


def test_trainers_without_in_memory_restore_reload_the_checkpoint() -> None:
    # What the trainers do today with the distributed optimizer: a moved shard reloads the checkpoint.
    spec = distributed_spec(replicas=2, spares=1, tp=2, gpus_per_pod=2)
    pods = make_pod_refs(3)
    plan = _initial(spec, pods[:2])
    new = _replace(spec, plan, pods, ["p0"], {"p1": [20]}, in_memory=False)
    assert new.optimizer_state is not None and new.optimizer_state.source is OptimizerSourceKind.CHECKPOINT
    assert new.default_source is StateSourceKind.CHECKPOINT and new.resume_step == 10
    assert not new.optimizer_state.buddies and not _initial(spec, pods[:2], in_memory=False).optimizer_state.buddies


def test_a_shrink_reshards_from_old_owners_and_the_lost_ranks_buddies() -> None:
    spec = distributed_spec(replicas=4, min_replicas=2, spares=0, tp=1, gpus_per_pod=1)
    pods = make_pod_refs(4)
    plan = _initial(spec, pods)
    assert [plan.buddy_of(r) for r in range(4)] == [1, 2, 3, 0]
    new = _replace(spec, plan, pods, ["p2"], {"p0": [20], "p1": [20], "p3": [20]})
    state = new.optimizer_state
    assert new.reason is PlanReason.SHRINK and new.sizes.dp == 3
    assert state is not None and state.source is OptimizerSourceKind.RESHARD
    assert state.previous_sizes is not None and state.previous_sizes.dp == 4
    # Old rank 2 (p2, lost) is kept by its buddy, old rank 3 (p3).
    [copy] = state.copies
    assert (copy.previous_rank, copy.holder_pod, copy.buddy) == (2, "p3", True)
    assert [o.previous_rank for o in new.optimizer_sources_of(0)] == [0, 1, 2, 3]
    assert new.resume_step == 20


def test_one_pod_has_no_buddies() -> None:
    spec = distributed_spec(replicas=2, min_replicas=2, spares=0, tp=1, gpus_per_pod=2)
    plan = _initial(spec, make_pod_refs(1))
    assert plan.optimizer_state is not None and not plan.optimizer_state.buddies
    assert plan.buddy_of(0) is None
    wire = plan.to_wire()
    wire["optimizerState"]["buddies"] = True
    with pytest.raises(ValueError, match="no buddy on another pod"):
        MeshPlan.model_validate(wire)


def test_a_copy_not_of_the_resume_step_is_refused() -> None:
    spec = distributed_spec(replicas=2, spares=1, tp=2, gpus_per_pod=2)
    pods = make_pod_refs(3)
    new = _replace(spec, _initial(spec, pods[:2]), pods, ["p0"], {"p1": [20]})
    wire = new.to_wire()
    wire["optimizerState"]["copies"][0]["step"] = 19
    with pytest.raises(ValueError, match="not resumeStep"):
        MeshPlan.model_validate(wire)
    wire = new.to_wire()
    wire["optimizerState"]["copies"][0]["holderRank"] = 0
    with pytest.raises(ValueError, match="not where holders says"):
        MeshPlan.model_validate(wire)
    assert issubclass(MeshError, ValueError)


# -- properties -----------------------------------------------------------------------------------


def check_buddies(plan: MeshPlan, in_memory: bool = True) -> None:
    state = plan.optimizer_state
    assert state is not None
    pod_of = plan.pod_of_rank()
    if not in_memory:  # copies only for trainers that restore from them
        assert not state.buddies
        return
    if len(plan.members) < 2:
        assert not state.buddies and plan.buddy_of(0) is None
        return
    assert state.buddies
    buddies = [plan.buddy_of(r) for r in range(plan.sizes.world)]
    again = MeshPlan.model_validate(plan.to_wire())
    assert [again.buddy_of(r) for r in range(plan.sizes.world)] == buddies  # deterministic
    assert sorted(b for b in buddies if b is not None) == list(range(plan.sizes.world))  # one copy each
    for pod in {m.pod for m in plan.members}:  # losing this pod loses no shard's both copies
        assert not any(pod_of[r] == pod and pod_of[b] == pod for r, b in enumerate(buddies) if b is not None)
    local = {r: i for m in plan.members for i, r in enumerate(m.ranks)}
    assert all(b is not None and local[b] == local[r] for r, b in enumerate(buddies))  # the same local GPU
    kept = [sum(1 for b in buddies if b is not None and pod_of[b] == m.pod) for m in plan.members]
    assert set(kept) == {plan.gpus_per_pod}  # balanced: every pod keeps gpusPerPod copies
    units = plan.sizes.dp // max(1, plan.gpus_per_pod // plan.sizes.model_parallel)
    if units >= 2:  # a copy of a shard of its own shard's size: the same model-parallel position
        for r, b in enumerate(buddies):
            assert b is not None
            key, buddy_key = plan.sizes.coords_of(r), plan.sizes.coords_of(b)
            assert key.model_parallel_key() == buddy_key.model_parallel_key()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(distributed_spec), pods=st.integers(1, 8))
def test_buddies_are_on_other_pods_deterministic_and_balanced(spec: MegatronJobSpec, pods: int) -> None:
    decision = plan_mesh(spec, JOB_UID, make_pod_refs(pods), [], [], None, in_memory_optimizer=True)
    if decision.outcome is Outcome.WAIT:
        return
    assert decision.plan is not None
    check_buddies(decision.plan)


events = st.lists(
    st.tuples(
        st.sampled_from(["fail", "fail", "arrive"]),
        st.integers(0, 1000),
        st.integers(1, 2),
        st.lists(st.sampled_from([0, 0, 0, 0, 0, 1, 2]), min_size=1, max_size=2),  # how far each pod's copies lag
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(distributed_spec), history=events, in_memory=st.sampled_from([True, True, True, False]))
def test_every_restored_shard_has_a_live_source_or_everyone_reloads(
    spec: MegatronJobSpec, history: list[tuple[str, int, int, list[int]]], in_memory: bool
) -> None:
    shape = UnitShape.of(spec)
    serial = spec.worker_pods + spec.spares
    healthy = {p.name: p for p in make_pod_refs(serial)}
    plan = _initial(spec, list(healthy.values())[: spec.worker_pods], in_memory)
    failed: set[str] = set()
    completed = 0
    for kind, pick, count, lags in history:
        completed += 5
        members = [m.pod for m in plan.members]
        lost: list[str] = []
        if kind == "fail":
            for k in range(count):
                victim = members[(pick + k) % len(members)]
                if victim in healthy:
                    healthy.pop(victim)
                    failed.add(victim)
                    lost.append(victim)
        else:
            for ref in make_pod_refs(count, start=serial):
                healthy[ref.name] = ref
            serial += count
        # What each healthy pod holds: complete copies of the step its lag says (and the one before).
        copies = {
            name: {completed - lags[i % len(lags)], completed - lags[i % len(lags)] - 1}
            for i, name in enumerate(sorted(healthy))
        }
        active = [healthy[n] for n in members if n in healthy]
        pool = [p for n, p in healthy.items() if n not in members]
        checkpoint = max(0, completed - 7)
        # The status's buddyCopyStep, from the survivors' reports (the lost pod's copies are gone).
        point = restore_point(copies, [p.name for p in active])
        # Copies of a synchronous refresh schedule: at most one refresh apart from pod to pod.
        newest = {max(copies[p.name]) for p in active}
        synchronous = bool(newest) and max(newest) - min(newest) <= 1
        decision = plan_mesh(
            spec,
            JOB_UID,
            active,
            pool,
            failed,
            plan,
            resume_step=completed,
            checkpoint_step=checkpoint,
            copy_steps=copies,
            in_memory_optimizer=in_memory,
        )
        if decision.outcome is not Outcome.NEW_PLAN:
            continue
        new = decision.plan
        assert new is not None
        check_buddies(new, in_memory)
        check_sources(plan, new, copies, completed, checkpoint, in_memory)
        buddies = plan.optimizer_state is not None and plan.optimizer_state.buddies
        if in_memory and in_memory_restore(spec) and buddies and len(lost) == 1 and synchronous and point is not None:
            # One pod lost while every other member held copies of ``point``: no further back than it
            # (for the jobs the operator asks copies of; the others reload the checkpoint).
            event("one pod lost with a restore point")
            assert new.optimizer_state is not None and new.optimizer_state.source is not OptimizerSourceKind.CHECKPOINT
            assert new.resume_step >= point, (point, new.resume_step)
        if (
            in_memory
            and new.reason is PlanReason.REPLACE
            and len(lost) == 1
            and set(lags) == {0}
            and shape.pods_per_unit * shape.units_for(plan.sizes.dp) >= 2
        ):
            # One pod lost, copies of the survivors' step: nothing is redone.
            event("one pod replaced with fresh copies")
            assert new.optimizer_state is not None and new.optimizer_state.steps_redone == 0
            assert new.optimizer_state.source is OptimizerSourceKind.SELF and new.resume_step == completed
        completed = new.resume_step
        plan = new


def check_sources(
    old: MeshPlan,
    new: MeshPlan,
    copies: Mapping[str, Collection[int]],
    survivors: int,
    checkpoint: int,
    in_memory: bool,
) -> None:
    state = new.optimizer_state
    assert state is not None
    # An agent of an older version reads the plan without optimizerState: still a valid plan.
    older = new.to_wire()
    del older["optimizerState"]
    MeshPlan.model_validate(older)
    event(f"{new.reason.value}: {state.source.value}" + (", steps redone" if state.steps_redone else ""))
    if state.source is OptimizerSourceKind.CHECKPOINT:
        assert new.default_source is StateSourceKind.CHECKPOINT and not new.state_sources
        assert new.default_checkpoint_step == checkpoint == new.resume_step
        return
    assert state.source in (OptimizerSourceKind.SELF, OptimizerSourceKind.RESHARD)
    assert state.previous_sizes == old.sizes
    moved = state.copies or state.holder_ranks() != list(range(new.sizes.world)) or old.sizes != new.sizes
    assert in_memory or not moved
    assert new.resume_step == survivors - state.steps_redone
    old_place = {r: (m.pod, m.pod_uid, i) for m in old.members for i, r in enumerate(m.ranks)}
    new_place = {r: (m.pod, m.pod_uid, i) for m in new.members for i, r in enumerate(m.ranks)}
    copy_of = {c.previous_rank: c for c in state.copies}
    for previous, holder in enumerate(state.holder_ranks()):
        copy = copy_of.get(previous)
        if copy is None:  # the owner's GPU, on the very pod it ran on, at the survivors' step
            assert new_place[holder] == old_place[previous] and state.steps_redone == 0
            continue
        # A host copy of the resume step, reported by its holder, on the owner's pod or its buddy's.
        assert copy.step == new.resume_step and copy.step in copies[copy.holder_pod]
        owner = old.buddy_of(previous) if copy.buddy else previous
        assert owner is not None and new_place[holder] == old_place[owner]
    for rank in range(new.sizes.world):
        origins = new.optimizer_sources_of(rank)
        coords = new.sizes.coords_of(rank)
        if state.source is OptimizerSourceKind.SELF:
            assert [o.previous_rank for o in origins] == [rank]
        else:
            group = [
                r
                for r in range(old.sizes.world)
                if old.sizes.coords_of(r).tp == coords.tp and old.sizes.coords_of(r).pp == coords.pp
            ]
            assert [o.previous_rank for o in origins] == group and len(group) == old.sizes.dp * old.sizes.cp


def test_the_restore_point_is_the_oldest_of_the_pods_newest_copies() -> None:
    assert restore_point({"p0": [21, 20], "p1": [20, 19]}, ["p0", "p1"]) == 20
    assert restore_point({"p0": [21, 20], "p1": [20, 19], "p2": [9]}, ["p0", "p1"]) == 20  # p2: no member
    # Reports of different moments (a refresh every step, a heartbeat every few): p0's is older.
    assert restore_point({"p0": [40, 39], "p1": [57, 56]}, ["p0", "p1"]) == 40
    assert restore_point({"p0": [21], "p1": []}, ["p0", "p1"]) is None  # p1 holds no complete copy yet
    assert restore_point({"p0": [21]}, ["p0", "p1"]) is None  # p1 has not reported
    assert restore_point({}, []) is None


def test_in_memory_restore_covers_dense_models_without_context_parallelism() -> None:
    assert in_memory_restore(distributed_spec(replicas=2))
    wire = distributed_spec(replicas=2).to_wire()
    wire["model"].update({"numExperts": 4, "moeRouterTopk": 2, "addBiasLinear": False})
    assert not in_memory_restore(MegatronJobSpec.model_validate(wire))
    wire = distributed_spec(replicas=2).to_wire()
    wire["cp"] = 2
    assert not in_memory_restore(MegatronJobSpec.model_validate(wire))
