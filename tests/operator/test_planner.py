"""Mesh planning (``megatron_operator.planner.plan_mesh``), a pure function.

Scenarios:
- initial plan: every worker pod gets ranks, every rank starts from init; too few pods waits;
- a failed pod is replaced by a spare in place: same mesh and ranks, the newcomer gets its state
  from a data-parallel peer, everyone else keeps its own;
- with spares exhausted the mesh shrinks by whole replicas and healthy pods of a dropped replica
  go back to the pool (and may repair another replica); never below minReplicas (WAIT);
- grow back to ``replicas`` when pods return; nothing changes when nothing happened;
- spec.replicas lowered with every pod healthy: whole replicas leave (resize, not a loss);
- a recreated pod with the same name but another UID is not taken for the old one;
- when no replica holds a shard any more, every rank reloads the checkpoint (or starts over);
- a plan that never trained delivered no state: its newcomers hold none in the next plan, so a
  pod lost while the survivors were still joining falls back to those who kept theirs;
- the rendezvous store lives with a member whose agent reported most recently;
- expert parallelism (ep=2): a shrink drops a whole expert-parallel group, choosing which replicas
  leave so that every survivor keeps its share of the experts; growth adds a whole group whose
  newcomers take their experts from the peers holding them; a job waits rather than split a group.
- failure domains: a failed pod's replacement is a spare on another node, in another rack (the
  job's topology label) before another node of the same rack; with no placement known the order
  of the spares decides; property (hypothesis): for any placement of pods on nodes and racks and
  any failed members, as few replacements as possible come from a rack, then a node, that lost a pod.
- property (hypothesis): for any valid spec and any sequence of failures, arrivals and changes of
  spec.replicas, every plan is a valid mesh (ranks unique and dense, TP groups inside a pod,
  world = tp*pp*cp*dp, dp a multiple of ep), epochs strictly increase, the global batch never
  changes, dp stays in [minReplicas, replicas] and is as large as the healthy pods allow in whole
  expert-parallel groups, failed pods never train, no healthy pod is lost, and every rank's state
  source really holds that state (the same model shard and share of the experts).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mesh_strategies import specs
from operator_factories import JOB_UID, make_pod_refs, make_spec

from megatron_contract.job import MegatronJobSpec
from megatron_contract.mesh import MeshPlan, PlanReason, StateSourceKind
from megatron_operator.planner import Outcome, Placement, PodRef, UnitShape, plan_mesh

MOE_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_experts": 4, "add_bias_linear": False}


def _initial(spec: MegatronJobSpec, pods: list[PodRef]) -> MeshPlan:
    decision = plan_mesh(spec, JOB_UID, pods, [], [], None)
    assert decision.outcome is Outcome.NEW_PLAN and decision.plan is not None
    return decision.plan


def _refs(plan: MeshPlan) -> list[PodRef]:
    return [PodRef(m.pod, m.pod_uid or "", m.address) for m in plan.members]


def test_initial_plan_gives_every_worker_ranks_and_init_state() -> None:
    spec = make_spec(replicas=4, tp=2, pp=2, gpus_per_pod=2)
    plan = _initial(spec, make_pod_refs(8))
    assert plan.epoch == 1 and plan.reason is PlanReason.INITIAL
    assert (plan.sizes.world, plan.sizes.dp) == (16, 4)
    assert {m.pod for m in plan.members} == {f"p{i}" for i in range(8)}
    assert all(s.kind is StateSourceKind.INIT for s in plan.sources())
    assert plan.rendezvous.store_prefix == f"{JOB_UID}/epoch-1"
    assert plan.resume_step == 0


def test_newcomers_of_a_plan_that_never_trained_hold_nothing() -> None:
    # TP2 on two GPUs per pod: p0 and p1 are the two replicas; the spare p2 replaces p0.
    spec = make_spec(replicas=2, min_replicas=1, spares=2, tp=2, gpus_per_pod=2)
    pods = make_pod_refs(4)
    plan = _initial(spec, pods[:2])
    first = plan_mesh(spec, JOB_UID, [pods[1]], pods[2:], ["p0"], plan, resume_step=9).plan
    assert first is not None and first.member("p2") is not None
    assert {first.source_of(r).kind for r in first.member("p2").ranks} == {StateSourceKind.PEER}  # type: ignore[union-attr]
    # p1, the only keeper, is lost before epoch 2 committed a step: p2 never received its state.
    untrained = plan_mesh(
        spec,
        JOB_UID,
        [pods[2]],
        [pods[3]],
        ["p0", "p1"],
        first,
        resume_step=9,
        checkpoint_step=5,
        previous_trained=False,
    ).plan
    assert untrained is not None and untrained.default_source is StateSourceKind.CHECKPOINT
    assert untrained.resume_step == 5
    # Had epoch 2 trained, p2 would hold the state and give it to the newcomer.
    trained = plan_mesh(
        spec,
        JOB_UID,
        [pods[2]],
        [pods[3]],
        ["p0", "p1"],
        first,
        resume_step=9,
        checkpoint_step=5,
        previous_trained=True,
    ).plan
    assert trained is not None and trained.default_source is StateSourceKind.SELF
    assert trained.resume_step == 9


def test_the_store_goes_to_the_member_that_reported_most_recently() -> None:
    spec = make_spec(replicas=3, spares=1)
    pods = make_pod_refs(4)
    plan = _initial(spec, pods[:3])
    # p0 is the first keeper, but only p2's and p3's agents reported lately (p1 died a moment ago).
    new = plan_mesh(spec, JOB_UID, [pods[1], pods[2]], [pods[3]], ["p0"], plan, store_hosts=["p3", "p2"]).plan
    assert new is not None and new.rendezvous.host == pods[2].address  # a fresh keeper before a newcomer
    only_new = plan_mesh(spec, JOB_UID, [pods[1], pods[2]], [pods[3]], ["p0"], plan, store_hosts=["p3"]).plan
    assert only_new is not None and only_new.rendezvous.host == pods[3].address  # fresh beats kept-but-quiet
    unknown = plan_mesh(spec, JOB_UID, [pods[1], pods[2]], [pods[3]], ["p0"], plan).plan
    assert unknown is not None and unknown.rendezvous.host == pods[1].address  # nothing known: a keeper


def test_initial_plan_waits_for_enough_pods() -> None:
    spec = make_spec(replicas=4, min_replicas=4)
    decision = plan_mesh(spec, JOB_UID, make_pod_refs(3), [], [], None)
    assert decision.outcome is Outcome.WAIT and decision.plan is None


def test_failed_pod_is_replaced_by_spare_in_place() -> None:
    spec = make_spec(replicas=4, spares=1, tp=2, gpus_per_pod=2)
    pods = make_pod_refs(5)
    plan = _initial(spec, pods[:4])
    dead = plan.members[1]
    decision = plan_mesh(
        spec, JOB_UID, [p for p in pods[:4] if p.name != dead.pod], [pods[4]], [dead.pod], plan, resume_step=7
    )
    new = decision.plan
    assert decision.outcome is Outcome.NEW_PLAN and new is not None
    assert new.reason is PlanReason.REPLACE and new.epoch == 2 and new.sizes == plan.sizes
    assert decision.promoted == ("p4",) and decision.lost == (dead.pod,)
    assert new.member("p4") is not None and new.member("p4").ranks == dead.ranks  # type: ignore[union-attr]
    for rank in dead.ranks:
        source = new.source_of(rank)
        assert source.kind is StateSourceKind.PEER
        assert source.peer_rank is not None
        assert new.sizes.shard_key(source.peer_rank) == new.sizes.shard_key(rank)
    others = [r for m in new.members if m.pod != "p4" for r in m.ranks]
    assert all(new.source_of(r).kind is StateSourceKind.SELF for r in others)
    assert new.resume_step == 7
    assert new.rendezvous.host != "127.64.0.5"  # the newcomer does not host the store


def test_a_member_that_stays_as_it_was_is_the_previous_plans_and_only_such_a_member() -> None:
    spec = make_spec(replicas=4, spares=1, tp=2, gpus_per_pod=2)
    pods = make_pod_refs(5)
    plan = _initial(spec, pods[:4])
    # p2 was written by another version, with a field this one does not know: not repeated.
    members = [m.model_copy(update={"vendorHint": 1}) if m.pod == "p2" else m for m in plan.members]
    plan = plan.model_copy(update={"members": members})
    moved = PodRef("p3", "uid-p3", "127.64.9.9")  # p3 is back at another address
    survivors = [pods[0], pods[2], moved]
    new = plan_mesh(spec, JOB_UID, survivors, [pods[4]], ["p1"], plan, resume_step=7).plan
    assert new is not None
    assert new.member("p0") is plan.member("p0")
    assert new.member("p2") is not plan.member("p2") and not new.member("p2").model_extra  # type: ignore[union-attr]
    assert new.member("p3").address == "127.64.9.9"  # type: ignore[union-attr]
    assert new.member("p4").ranks == plan.member("p1").ranks  # type: ignore[union-attr]


def test_shrink_drops_whole_replicas_and_returns_healthy_pods() -> None:
    # A replica spans two pods (tp=2, pp=2, 2 GPUs per pod); no spares.
    spec = make_spec(replicas=3, min_replicas=1, spares=0, tp=2, pp=2, gpus_per_pod=2)
    pods = make_pod_refs(6)
    plan = _initial(spec, pods)
    victim = plan.members[0].pod
    decision = plan_mesh(spec, JOB_UID, [p for p in pods if p.name != victim], [], [victim], plan)
    new = decision.plan
    assert new is not None and new.reason is PlanReason.SHRINK
    assert new.sizes.dp == 2 and len(new.members) == 4
    assert len(decision.released) == 1 and decision.released[0] not in {m.pod for m in new.members}
    assert new.batch.global_batch_size == plan.batch.global_batch_size


def test_released_pod_repairs_another_replica() -> None:
    # Two replicas each lose one of their two pods: one is dropped, its survivor repairs the other.
    spec = make_spec(replicas=2, min_replicas=1, spares=0, tp=2, pp=2, gpus_per_pod=2)
    pods = make_pod_refs(4)
    plan = _initial(spec, pods)
    unit_of = {m.pod: plan.sizes.coords_of(m.ranks[0]).dp for m in plan.members}
    # Victims at different pipeline stages, so that a peer still holds each shard.
    pp_of = {m.pod: plan.sizes.coords_of(m.ranks[0]).pp for m in plan.members}
    victims = [
        next(p for p in unit_of if unit_of[p] == 0 and pp_of[p] == 0),
        next(p for p in unit_of if unit_of[p] == 1 and pp_of[p] == 1),
    ]
    alive = [p for p in pods if p.name not in victims]
    decision = plan_mesh(spec, JOB_UID, alive, [], victims, plan)
    new = decision.plan
    assert new is not None and new.sizes.dp == 1 and new.reason is PlanReason.SHRINK
    assert {m.pod for m in new.members} == {p.name for p in alive}
    assert all(s.kind in (StateSourceKind.SELF, StateSourceKind.PEER) for s in new.sources())


def test_never_below_min_replicas() -> None:
    spec = make_spec(replicas=4, min_replicas=3, spares=0)
    pods = make_pod_refs(4)
    plan = _initial(spec, pods)
    decision = plan_mesh(spec, JOB_UID, pods[2:], [], ["p0", "p1"], plan)
    assert decision.outcome is Outcome.WAIT and decision.plan is None
    assert decision.lost == ("p0", "p1")


def test_grow_back_when_pods_return() -> None:
    spec = make_spec(replicas=4, min_replicas=2, spares=0)
    pods = make_pod_refs(4)
    plan = _initial(spec, pods)
    shrunk = plan_mesh(spec, JOB_UID, pods[1:], [], ["p0"], plan).plan
    assert shrunk is not None and shrunk.sizes.dp == 3
    grown = plan_mesh(spec, JOB_UID, _refs(shrunk), make_pod_refs(1, start=10), [], shrunk)
    assert grown.plan is not None and grown.plan.reason is PlanReason.GROW and grown.plan.sizes.dp == 4
    assert grown.promoted == ("p10",)
    assert grown.plan.epoch == shrunk.epoch + 1


def test_a_shrink_drops_a_whole_expert_parallel_group_and_keeps_every_survivors_experts() -> None:
    # ep=2 over dp=4, one replica per pod: p0 and p2 hold experts 0-1, p1 and p3 experts 2-3.
    spec = make_spec(replicas=4, min_replicas=2, spares=0, ep=2, model=MOE_MODEL)
    pods = make_pod_refs(4)
    plan = _initial(spec, pods)
    assert [plan.sizes.shard_key(m.ranks[0])[3] for m in plan.members] == [0, 1, 0, 1]
    decision = plan_mesh(spec, JOB_UID, [pods[0], pods[2], pods[3]], [], ["p1"], plan, resume_step=6)
    new = decision.plan
    # dp 3 would not split 4 experts over ep=2 evenly in every group: down to dp 2, and p2 (experts
    # 0-1, like p0) leaves rather than p3, the last holder of experts 2-3, which keeps its place.
    assert new is not None and new.reason is PlanReason.SHRINK and new.sizes.dp == 2
    assert [m.pod for m in new.members] == ["p0", "p3"] and decision.released == ("p2",)
    assert all(s.kind is StateSourceKind.SELF for s in new.sources()) and new.resume_step == 6
    # Growing back adds a whole group: the newcomers take their experts from the peers holding them.
    grown = plan_mesh(spec, JOB_UID, _refs(new), make_pod_refs(2, start=10), [], new).plan
    assert grown is not None and grown.reason is PlanReason.GROW and grown.sizes.dp == 4
    for rank in (2, 3):
        source = grown.source_of(rank)
        assert source.kind is StateSourceKind.PEER and source.peer_rank == rank - 2


def test_expert_parallel_jobs_wait_rather_than_split_an_expert_parallel_group() -> None:
    spec = make_spec(replicas=4, min_replicas=4, spares=0, ep=2, model=MOE_MODEL)
    pods = make_pod_refs(4)
    assert plan_mesh(spec, JOB_UID, pods[:3], [], [], None).outcome is Outcome.WAIT
    plan = _initial(spec, pods)
    decision = plan_mesh(spec, JOB_UID, pods[1:], [], ["p0"], plan)
    assert decision.outcome is Outcome.WAIT and "below minReplicas 4" in decision.message


def test_nothing_happened_keeps_the_plan() -> None:
    spec = make_spec(replicas=2, spares=1)
    pods = make_pod_refs(3)
    plan = _initial(spec, pods[:2])
    decision = plan_mesh(spec, JOB_UID, pods[:2], [pods[2]], [], plan)
    assert decision.outcome is Outcome.UNCHANGED and decision.plan is plan


def test_lowering_replicas_resizes_the_mesh_keeping_every_state() -> None:
    spec = make_spec(replicas=4, min_replicas=1, spares=1, tp=2, gpus_per_pod=2)
    pods = make_pod_refs(5)
    plan = _initial(spec, pods[:4])
    smaller = spec.model_copy(update={"replicas": 2})
    decision = plan_mesh(smaller, JOB_UID, pods[:4], [pods[4]], [], plan, resume_step=30)
    new = decision.plan
    assert decision.outcome is Outcome.NEW_PLAN and new is not None
    assert new.reason is PlanReason.RESIZE and new.sizes.dp == 2 and decision.lost == ()
    assert {m.pod for m in new.members} == {"p0", "p1"} and decision.released == ("p2", "p3")
    assert all(s.kind is StateSourceKind.SELF for s in new.sources()) and new.resume_step == 30
    assert new.batch.global_batch_size == spec.training.global_batch_size
    assert "spec.replicas is 2" in decision.message
    # Raising it again grows back onto the released pods.
    grown = plan_mesh(spec, JOB_UID, _refs(new), [pods[2], pods[3], pods[4]], [], new)
    assert grown.plan is not None and grown.plan.reason is PlanReason.GROW and grown.plan.sizes.dp == 4


def test_recreated_pod_with_same_name_is_not_the_member() -> None:
    spec = make_spec(replicas=2, min_replicas=1, spares=0)
    pods = make_pod_refs(2)
    plan = _initial(spec, pods)
    impostor = dataclasses.replace(pods[0], uid="another-uid")
    decision = plan_mesh(spec, JOB_UID, [impostor, pods[1]], [], [], plan)
    assert decision.lost == ("p0",)


@pytest.mark.parametrize("checkpoint_step", [None, 40])
def test_lost_shard_falls_back_to_checkpoint_or_init(checkpoint_step: int | None) -> None:
    spec = make_spec(replicas=1, min_replicas=1, spares=1)
    pods = make_pod_refs(2)
    plan = _initial(spec, pods[:1])
    decision = plan_mesh(spec, JOB_UID, [], [pods[1]], ["p0"], plan, resume_step=50, checkpoint_step=checkpoint_step)
    new = decision.plan
    assert new is not None
    kind = StateSourceKind.INIT if checkpoint_step is None else StateSourceKind.CHECKPOINT
    assert all(s.kind is kind for s in new.sources())
    assert new.resume_step == (checkpoint_step or 0)


# -- properties -----------------------------------------------------------------------------------


events = st.lists(
    st.one_of(
        st.tuples(st.just("fail"), st.integers(0, 1000), st.integers(1, 3)),
        st.tuples(st.just("fail-spare"), st.integers(0, 1000), st.just(1)),
        st.tuples(st.just("arrive"), st.integers(0, 0), st.integers(1, 4)),
        st.tuples(st.just("resize"), st.integers(0, 1000), st.just(0)),
    ),
    max_size=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), history=events, steps=st.lists(st.integers(0, 5), min_size=12, max_size=12))
def test_every_plan_is_a_valid_mesh_for_any_failures_and_arrivals(
    spec: MegatronJobSpec, history: list[tuple[str, int, int]], steps: list[int]
) -> None:
    shape = UnitShape.of(spec)
    serial = spec.worker_pods + spec.spares
    healthy: dict[str, PodRef] = {p.name: p for p in make_pod_refs(serial)}
    plan = _initial(spec, list(healthy.values())[: spec.worker_pods])
    failed: set[str] = set()
    completed = 0
    most_units = shape.units_for(spec.replicas)
    for (kind, pick, count), advance in zip(history, steps, strict=False):
        members = [m.pod for m in plan.members] if plan else []
        spares = [n for n in healthy if n not in members]
        if kind == "fail" and members:
            for k in range(count):
                victim = members[(pick + k) % len(members)]
                healthy.pop(victim, None)
                failed.add(victim)
        elif kind == "fail-spare" and spares:
            victim = spares[pick % len(spares)]
            healthy.pop(victim)
            failed.add(victim)
        elif kind == "resize":  # the user edits spec.replicas (within minReplicas..the original)
            fewest = shape.units_for(spec.min_replicas)
            units = shape.whole(fewest + pick % (most_units - fewest + 1))
            spec = spec.model_copy(update={"replicas": units * shape.replicas_per_unit})
        elif kind == "arrive":
            for ref in make_pod_refs(count, start=serial):
                healthy[ref.name] = ref
            serial += count
        completed += advance
        active = [healthy[n] for n in members if n in healthy]
        pool = [p for n, p in healthy.items() if n not in members]
        decision = plan_mesh(spec, JOB_UID, active, pool, failed, plan, resume_step=completed)
        assert decision.plan is not plan or decision.outcome is Outcome.UNCHANGED
        if decision.outcome is Outcome.WAIT:
            assert decision.plan is None
            assert shape.whole(len(healthy) // shape.pods_per_unit) * shape.replicas_per_unit < spec.min_replicas
            continue  # the job waits; the next event plans from the same previous plan
        new = decision.plan
        assert new is not None
        if decision.outcome is Outcome.UNCHANGED:
            assert new is plan
            continue
        _check_transition(spec, shape, plan, new, healthy, failed)
        plan = new


def _check_transition(
    spec: MegatronJobSpec, shape: UnitShape, old: MeshPlan, new: MeshPlan, healthy: dict[str, PodRef], failed: set[str]
) -> None:
    # Re-validate from the wire form: what the trainer parses is valid too.
    MeshPlan.model_validate(new.to_wire())
    sizes = new.sizes
    assert sizes.world == sizes.tp * sizes.pp * sizes.cp * sizes.dp
    assert (sizes.tp, sizes.pp, sizes.cp, sizes.ep) == (spec.tp, spec.pp, spec.cp, spec.ep)
    assert sizes.dp % sizes.ep == 0  # whole expert-parallel groups, as Megatron requires
    assert sorted(r for m in new.members for r in m.ranks) == list(range(sizes.world))
    assert new.epoch == old.epoch + 1
    assert new.batch.global_batch_size == spec.training.global_batch_size
    assert spec.min_replicas <= sizes.dp <= spec.replicas
    # As large as the healthy pods allow (in whole expert-parallel groups).
    units = min(shape.units_for(spec.replicas), len(healthy) // shape.pods_per_unit)
    assert sizes.dp == shape.whole(units) * shape.replicas_per_unit
    members = {m.pod for m in new.members}
    assert not members & failed and members <= set(healthy)
    for member in new.members:
        assert member.pod_uid == healthy[member.pod].uid
        first_ranks = {r - r % sizes.tp for r in member.ranks}
        assert all(f in member.ranks for f in first_ranks)  # TP groups inside the pod
    # State sources: self means the very pod held that shard (and share of experts) before; peers hold theirs.
    held = {(m.pod, old.sizes.shard_key(r)) for m in old.members for r in m.ranks}
    pod_of = new.pod_of_rank()
    kinds = {s.kind for s in new.sources()}
    for source in new.sources():
        key = sizes.shard_key(source.rank)
        if source.kind is StateSourceKind.SELF:
            assert (pod_of[source.rank], key) in held
        elif source.kind is StateSourceKind.PEER:
            assert source.peer_rank is not None
            assert (pod_of[source.peer_rank], key) in held
    if new.reason is PlanReason.RESIZE:  # nobody lost: every rank keeps what it holds
        assert kinds == {StateSourceKind.SELF} and sizes.dp < old.sizes.dp
    if kinds <= {StateSourceKind.SELF, StateSourceKind.PEER}:
        assert new.resume_step >= old.resume_step
    else:
        assert kinds == {StateSourceKind.INIT} and new.resume_step == 0


def test_the_replacement_comes_from_another_node() -> None:
    spec = make_spec(replicas=2, spares=2)
    pods = make_pod_refs(4)  # p0, p1 train; p2 and p3 are spares
    plan = _initial(spec, pods[:2])
    place = {"p0": Placement("node-a"), "p1": Placement("node-b"), "p2": Placement("node-a"), "p3": Placement("node-c")}
    # p0's node died: p2 beside it is the first spare, but the node that took p0 may take it next.
    decision = plan_mesh(spec, JOB_UID, [pods[1]], pods[2:], ["p0"], plan, placement=place)
    assert decision.plan is not None and decision.plan.reason is PlanReason.REPLACE
    assert decision.promoted == ("p3",)
    # Without placement the order of the spares decides.
    assert plan_mesh(spec, JOB_UID, [pods[1]], pods[2:], ["p0"], plan).promoted == ("p2",)


def test_another_rack_before_another_node_of_the_same_rack() -> None:
    spec = make_spec(replicas=2, spares=3)
    pods = make_pod_refs(5)
    plan = _initial(spec, pods[:2])
    place = {
        "p0": Placement("a1", "rack-a"),
        "p1": Placement("b1", "rack-b"),
        "p2": Placement("a1", "rack-a"),
        "p3": Placement("a2", "rack-a"),
        "p4": Placement("c1", "rack-c"),
    }
    decision = plan_mesh(spec, JOB_UID, [pods[1]], pods[2:], ["p0"], plan, placement=place)
    assert decision.promoted == ("p4",)
    # With rack-c's spare gone, another node of rack-a beats p0's own node.
    decision = plan_mesh(spec, JOB_UID, [pods[1]], pods[2:4], ["p0"], plan, placement=place)
    assert decision.promoted == ("p3",)
    # A spare of unknown place is no suspect: it beats one in the failed pod's rack.
    decision = plan_mesh(spec, JOB_UID, [pods[1]], pods[2:4] + make_pod_refs(1, start=9), ["p0"], plan, placement=place)
    assert decision.promoted == ("p9",)


def test_two_failed_pods_on_one_node_take_spares_elsewhere() -> None:
    spec = make_spec(replicas=4, spares=3)
    pods = make_pod_refs(7)
    plan = _initial(spec, pods[:4])
    nodes = ["n0", "n0", "n1", "n1", "n0", "n2", "n3"]  # p4, a spare, shares n0 with p0 and p1
    place = {p.name: Placement(n) for p, n in zip(pods, nodes, strict=True)}
    decision = plan_mesh(spec, JOB_UID, pods[2:4], pods[4:], ["p0", "p1"], plan, placement=place)
    assert decision.plan is not None and decision.plan.reason is PlanReason.REPLACE
    assert sorted(decision.promoted) == ["p5", "p6"]


@st.composite
def placed_failures(draw: st.DrawFn) -> tuple[MegatronJobSpec, dict[str, Placement], list[int]]:
    spec = draw(specs())
    spec = spec.model_copy(update={"spares": draw(st.integers(1, 6))})
    pods = spec.worker_pods + spec.spares
    racks = draw(st.integers(1, 3))
    nodes = draw(st.integers(1, 6))
    rack_of = [draw(st.integers(0, racks - 1)) for _ in range(nodes)]
    place = {}
    for i in range(pods):
        node = draw(st.integers(0, nodes - 1))
        place[f"p{i}"] = Placement(f"n{node}", f"r{rack_of[node]}" if racks > 1 else None)
    lost = draw(st.lists(st.integers(0, spec.worker_pods - 1), min_size=1, max_size=3, unique=True))
    return spec, place, lost


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=placed_failures())
def test_replacements_come_from_failure_domains_that_lost_nothing(
    case: tuple[MegatronJobSpec, dict[str, Placement], list[int]],
) -> None:
    spec, place, lost_at = case
    pods = make_pod_refs(spec.worker_pods + spec.spares)
    plan = _initial(spec, pods[: spec.worker_pods])
    lost = {plan.members[i].pod for i in lost_at}
    survivors = [p for p in pods[: spec.worker_pods] if p.name not in lost]
    spares = pods[spec.worker_pods :]
    decision = plan_mesh(spec, JOB_UID, survivors, spares, lost, plan, placement=place)
    if decision.plan is None or decision.plan.reason is not PlanReason.REPLACE:
        return  # too few spares: a shrink, whose fillers are not only spares
    lost_nodes = {place[n].node for n in lost}
    lost_racks = {place[n].domain for n in lost} - {None}
    holes = len(decision.promoted)
    assert holes == len(lost)
    in_lost_rack = sum(place[n].domain in lost_racks for n in decision.promoted)
    on_lost_node = sum(place[n].node in lost_nodes for n in decision.promoted)
    clean_racks = sum(place[p.name].domain not in lost_racks for p in spares)
    clean_nodes = sum(place[p.name].node not in lost_nodes for p in spares)
    assert in_lost_rack == max(0, holes - clean_racks)
    assert on_lost_node == max(0, holes - clean_nodes)
