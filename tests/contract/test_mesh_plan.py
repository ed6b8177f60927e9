"""MeshPlan invariants: rank math is Megatron's tp-cp-dp-pp order and invertible, and a rank's shard
key is its coordinates' model-parallel key and expert rank (property tests);
expert-parallel ranks are those of megatron-core's own expert groups (property test) and ep must
divide dp; a valid plan parses; plans with duplicate or missing ranks, a TP group across pods, a
wrong batch split, or a state source that does not hold the state (another model shard, or another
share of the experts) are refused; the batch split always adds up and sample ranges of one step
tile the global batch exactly; a distributed optimizer's ``optimizerState`` names a holder for every
previous shard (and refuses one missing, misplaced, outside the mesh, of another layout, or a copy
of another step, and a reload or a redo that is not for every rank)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from megatron_contract import BatchGeometry, MeshCoords, MeshPlan, MeshSizes, PlanReason, Rendezvous
from megatron_contract.mesh import MeshError, StateSourceKind

sizes_st = st.builds(
    lambda tp, pp, cp, dp: MeshSizes(world=tp * pp * cp * dp, tp=tp, pp=pp, cp=cp, dp=dp),
    st.integers(1, 8),
    st.integers(1, 4),
    st.integers(1, 2),
    st.integers(1, 16),
)


@given(sizes_st, st.data())
def test_rank_math_round_trips(sizes: MeshSizes, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, sizes.world - 1))
    coords = sizes.coords_of(rank)
    assert sizes.rank_of(coords) == rank
    expected = coords.tp + sizes.tp * (coords.cp + sizes.cp * (coords.dp + sizes.dp * coords.pp))
    assert expected == rank


@given(sizes_st, st.sampled_from([1, 2, 4]), st.data())
def test_shard_key_is_the_coordinates_model_parallel_key_and_expert_rank(
    sizes: MeshSizes, ep: int, data: st.DataObject
) -> None:
    assume(sizes.dp % ep == 0)
    sizes = MeshSizes(**{**sizes.model_dump(), "ep": ep})
    rank = data.draw(st.integers(0, sizes.world - 1))
    coords = sizes.coords_of(rank)
    assert sizes.shard_key(rank) == (*coords.model_parallel_key(), sizes.expert_rank(coords))
    with pytest.raises(MeshError):
        sizes.shard_key(sizes.world)


@given(sizes_st, st.sampled_from([1, 2, 4]))
def test_the_table_of_shard_keys_is_every_ranks_shard_key(sizes: MeshSizes, ep: int) -> None:
    assume(sizes.dp % ep == 0)
    sizes = MeshSizes(**{**sizes.model_dump(), "ep": ep})
    assert sizes.shard_keys() == tuple(sizes.shard_key(rank) for rank in range(sizes.world))


def test_rank_math_refuses_out_of_range() -> None:
    sizes = MeshSizes(world=8, tp=2, pp=2, cp=1, dp=2)
    with pytest.raises(MeshError):
        sizes.coords_of(8)
    with pytest.raises(MeshError):
        sizes.rank_of(MeshCoords(tp=2, cp=0, dp=0, pp=0))


@settings(deadline=None)  # the first example imports megatron-core
@given(sizes_st, st.sampled_from([1, 2, 4]))
def test_expert_ranks_are_megatron_core_expert_groups(sizes: MeshSizes, ep: int) -> None:
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    if sizes.dp % ep:
        with pytest.raises(ValidationError, match=f"dp {sizes.dp} is not a multiple of ep {ep}"):
            MeshSizes(**{**sizes.model_dump(), "ep": ep})
        return
    sizes = MeshSizes(**{**sizes.model_dump(), "ep": ep})
    # megatron-core's expert mesh as initialize_model_parallel builds it: expert tp = tp, no cp.
    experts = parallel_state.RankGenerator(
        tp=sizes.tp, ep=ep, dp=sizes.world // (sizes.tp * ep * sizes.pp), pp=sizes.pp, cp=1, order="tp-cp-ep-dp-pp"
    )
    for group in experts.get_ranks("ep"):
        assert [sizes.expert_rank(sizes.coords_of(r)) for r in group] == list(range(ep))
    # An expert-data-parallel group (the replicas of one share of the experts; cp ranks too, since
    # experts use no cp) has one tp, pp and expert rank: a peer of the same shard key holds its experts.
    for group in experts.get_ranks("dp"):
        assert len({(tp, pp, expert) for tp, _, pp, expert in map(sizes.shard_key, group)}) == 1


@given(st.integers(1, 64), st.integers(1, 4), st.integers(1, 16), st.integers(0, 1000))
def test_batch_split_adds_up_and_tiles_the_step(micro: int, mbs: int, dp: int, step: int) -> None:
    if micro < dp:
        with pytest.raises(MeshError):
            BatchGeometry.split(micro * mbs, mbs, dp)
        return
    geometry = BatchGeometry.split(micro * mbs, mbs, dp)
    assert sum(geometry.micro_batches_per_replica) * mbs == micro * mbs
    assert max(geometry.micro_batches_per_replica) - min(geometry.micro_batches_per_replica) <= 1
    samples = [i for d in range(dp) for i in geometry.sample_range(d, step)]
    assert samples == list(range(step * micro * mbs, (step + 1) * micro * mbs))


def make_plan(**overrides: object) -> dict[str, object]:
    """A valid wire-form plan: dp=2, tp=2, one replica per 2-GPU pod; rank 2,3 restored from peers."""
    plan: dict[str, object] = {
        "jobUid": "uid-1",
        "epoch": 2,
        "reason": "replace",
        "sizes": {"world": 4, "tp": 2, "pp": 1, "cp": 1, "dp": 2},
        "gpusPerPod": 2,
        "batch": {"globalBatchSize": 8, "microBatchSize": 1, "microBatchesPerReplica": [4, 4]},
        "rendezvous": {"host": "10.0.0.5", "port": 29401, "storePrefix": Rendezvous.prefix_for("uid-1", 2)},
        "members": [
            {"pod": "w-0", "address": "10.0.0.5", "ranks": [0, 1]},
            {"pod": "spare-0", "address": "10.0.0.9", "ranks": [2, 3]},
        ],
        "resumeStep": 10,
        "stateSources": [
            {"rank": 0, "kind": "self"},
            {"rank": 1, "kind": "self"},
            {"rank": 2, "kind": "peer", "peerRank": 0},
            {"rank": 3, "kind": "peer", "peerRank": 1},
        ],
    }
    plan.update(overrides)
    return plan


def test_valid_plan_parses_and_answers_queries() -> None:
    plan = MeshPlan.model_validate(make_plan())
    assert plan.reason is PlanReason.REPLACE
    assert plan.member("spare-0") is not None and plan.member("gone") is None
    assert plan.pod_of_rank() == {0: "w-0", 1: "w-0", 2: "spare-0", 3: "spare-0"}
    assert plan.source_of(2).kind is StateSourceKind.PEER
    assert plan.consumed_samples == 80
    assert plan.mesh_label == "2x2x1"
    assert MeshPlan.model_validate(plan.to_wire()) == plan


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {
                "members": [
                    {"pod": "w-0", "address": "a", "ranks": [0, 1]},
                    {"pod": "s", "address": "b", "ranks": [1, 3]},
                ]
            },
            "rank 1 is given to both",
        ),
        (
            {
                "members": [
                    {"pod": "w-0", "address": "a", "ranks": [0, 2]},
                    {"pod": "s", "address": "b", "ranks": [1, 3]},
                ]
            },
            "tensor-parallel group",
        ),
        (
            {
                "members": [
                    {"pod": "w-0", "address": "a", "ranks": [0, 1]},
                    {"pod": "s", "address": "b", "ranks": [2, 4]},
                ]
            },
            "not exactly 0..3",
        ),
        (
            {
                "members": [
                    {"pod": "w-0", "address": "a", "ranks": [0, 1]},
                    {"pod": "w-0", "address": "b", "ranks": [2, 3]},
                ]
            },
            "a pod appears twice",
        ),
        ({"batch": {"globalBatchSize": 8, "microBatchSize": 1, "microBatchesPerReplica": [8]}}, "split over 1"),
        ({"batch": {"globalBatchSize": 8, "microBatchSize": 1, "microBatchesPerReplica": [4, 3]}}, "not the global"),
        ({"sizes": {"world": 5, "tp": 2, "pp": 1, "cp": 1, "dp": 2}}, "world 5"),
        (
            {
                "stateSources": [
                    {"rank": 0, "kind": "self"},
                    {"rank": 1, "kind": "self"},
                    {"rank": 2, "kind": "peer", "peerRank": 1},
                    {"rank": 3, "kind": "peer", "peerRank": 1},
                ]
            },
            "another model shard",
        ),
        (
            {
                "stateSources": [
                    {"rank": 0, "kind": "init"},
                    {"rank": 1, "kind": "self"},
                    {"rank": 2, "kind": "peer", "peerRank": 0},
                    {"rank": 3, "kind": "peer", "peerRank": 1},
                ]
            },
            "does not hold its state",
        ),
        (
            {
                "stateSources": [
                    {"rank": 0, "kind": "self"},
                    {"rank": 1, "kind": "self"},
                    {"rank": 2, "kind": "checkpoint"},
                    {"rank": 3, "kind": "self"},
                ]
            },
            "without checkpointStep",
        ),
        (  # tp=1, dp=4, ep=2: ranks 0 and 2 hold the same experts, rank 1 the others
            {
                "sizes": {"world": 4, "tp": 1, "pp": 1, "cp": 1, "dp": 4, "ep": 2},
                "gpusPerPod": 2,
                "batch": {"globalBatchSize": 8, "microBatchSize": 1, "microBatchesPerReplica": [2, 2, 2, 2]},
                "stateSources": [
                    {"rank": 0, "kind": "self"},
                    {"rank": 1, "kind": "self"},
                    {"rank": 2, "kind": "peer", "peerRank": 1},
                    {"rank": 3, "kind": "peer", "peerRank": 1},
                ],
            },
            "rank 2: peer 1 holds another model shard",
        ),
        ({"sizes": {"world": 4, "tp": 2, "pp": 1, "cp": 1, "dp": 2, "ep": 4}}, "dp 2 is not a multiple of ep 4"),
        ({"stateSources": [{"rank": 0, "kind": "init"}, {"rank": 0, "kind": "self"}]}, "more than once"),
        ({"stateSources": [{"rank": 4, "kind": "init"}]}, "outside 0..3"),
        ({"stateSources": [], "defaultSource": "peer"}, "cannot be peer"),
        ({"stateSources": [], "defaultSource": "checkpoint"}, "without defaultCheckpointStep"),
        ({"epoch": 0}, "greater than or equal to 1"),
        ({"extra": 1, "epoch": 0}, "greater than or equal to 1"),  # a field it does not know changes nothing
    ],
)
def test_invalid_plans_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError) as info:
        MeshPlan.model_validate(make_plan(**overrides))
    assert message in str(info.value)


def test_unlisted_ranks_take_the_default_source() -> None:
    # Only the exceptions travel: a replace plan lists the newcomers, an init plan nothing.
    plan = MeshPlan.model_validate(
        make_plan(stateSources=[{"rank": 2, "kind": "peer", "peerRank": 0}, {"rank": 3, "kind": "peer", "peerRank": 1}])
    )
    assert [s.kind for s in plan.sources()] == [StateSourceKind.SELF] * 2 + [StateSourceKind.PEER] * 2
    assert plan.source_of(3).peer_rank == 1 and plan.source_kinds() == {StateSourceKind.SELF, StateSourceKind.PEER}
    restart = MeshPlan.model_validate(make_plan(stateSources=[], defaultSource="checkpoint", defaultCheckpointStep=40))
    assert {(s.kind, s.checkpoint_step) for s in restart.sources()} == {(StateSourceKind.CHECKPOINT, 40)}
    assert restart.source_kinds() == {StateSourceKind.CHECKPOINT}
    assert "stateSources" not in {k for k, v in restart.to_wire().items() if v}


SIZES_2X2 = {"world": 4, "tp": 2, "pp": 1, "cp": 1, "dp": 2}


def optimizer_state(**overrides: object) -> dict[str, object]:
    """A valid optimizerState for :func:`make_plan`'s mesh: w-0 kept old ranks 0 and 1 on its GPUs and
    holds its buddies' copies of old ranks 2 and 3 (spare-0 replaced their pod)."""
    state: dict[str, object] = {
        "buddies": True,
        "source": "self",
        "previousSizes": SIZES_2X2,
        "holders": [{"previousRank": 0, "holderRank": 0, "count": 2}, {"previousRank": 2, "holderRank": 0, "count": 2}],
        "copies": [
            {"previousRank": 2, "holderRank": 0, "holderPod": "w-0", "buddy": True, "step": 10},
            {"previousRank": 3, "holderRank": 1, "holderPod": "w-0", "buddy": True, "step": 10},
        ],
    }
    state.update(overrides)
    return state


def test_optimizer_state_names_every_shards_holder() -> None:
    plan = MeshPlan.model_validate(make_plan(optimizerState=optimizer_state()))
    assert [plan.buddy_of(r) for r in range(4)] == [2, 3, 0, 1]
    assert plan.optimizer_state is not None and plan.optimizer_state.holder_ranks() == [0, 1, 0, 1]
    origin = plan.optimizer_sources_of(2)
    assert [(o.previous_rank, o.holder_rank, o.copy is not None) for o in origin] == [(2, 0, True)]
    assert MeshPlan.model_validate(plan.to_wire()) == plan


@pytest.mark.parametrize(
    ("state", "plan_overrides", "message"),
    [
        ({"holders": [{"previousRank": 0, "holderRank": 0, "count": 3}]}, {}, "a holder per previous rank"),
        ({"holders": [{"previousRank": 1, "holderRank": 0, "count": 4}]}, {}, "a holder per previous rank"),
        ({"source": "reshard"}, {}, "reshard another one"),
        (
            {
                "previousSizes": {**SIZES_2X2, "world": 8, "pp": 2},
                "holders": [
                    {"previousRank": 0, "holderRank": 0, "count": 4},
                    {"previousRank": 4, "holderRank": 0, "count": 4},
                ],
            },
            {},
            "only the data-parallel size",
        ),
        ({"holders": [{"previousRank": 0, "holderRank": 2, "count": 4}]}, {}, "outside"),
        (
            {"copies": [{"previousRank": 2, "holderRank": 0, "holderPod": "w-0", "buddy": True, "step": 10}] * 2},
            {},
            "listed twice",
        ),
        (
            {"copies": [{"previousRank": 2, "holderRank": 0, "holderPod": "spare-0", "buddy": True, "step": 10}]},
            {},
            "not where",
        ),
        ({"source": "checkpoint", "previousSizes": None, "holders": [], "copies": []}, {}, "for every rank"),
        ({"paramsFromShards": True}, {}, "paramsFromShards"),
        ({"stepsRedone": 2, "paramsFromShards": True}, {"stateSources": []}, "stepsRedone"),
        ({}, {"defaultSource": "checkpoint", "defaultCheckpointStep": 4, "stateSources": []}, "restores in memory"),
    ],
)
def test_optimizer_state_that_misplaces_a_shard_is_refused(
    state: dict[str, object], plan_overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        MeshPlan.model_validate(make_plan(optimizerState=optimizer_state(**state), **plan_overrides))
