"""Unit tests of the worker's pure parts (no torch.distributed, no processes).

Scenarios: the lifecycle allows exactly its transitions; the fault plan chains, round-trips through
the environment, rejects malformed values and fires only at its (epoch, rank, step) and injection
point; mock samples are deterministic and the batch geometry hands every sample of a step to exactly
one replica whatever the data-parallel size; settings name the missing variable and ignore spec
fields a newer operator sends; the restore's buckets keep every tensor once, by dtype, within the
limit; the restore's routes send each newcomer its named peer's state, bring survivors of a DP
group that disagree by a step to the newest one (from the lowest-ranked survivor holding it, also
for a newcomer whose named peer is behind; with expert parallelism, one holding the same experts),
and leave every member of the group at the newest step whatever the survivors hold; the flat
shards hold every optimizer piece at its row and zeros in the padding, their columns one after the
other in memory, and read the pieces' tensors anew at every assembly.
"""

from __future__ import annotations

from pathlib import Path

import numpy
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from worker_harness import make_plan, make_spec, peer_sources

from megatron_contract import wire
from megatron_contract.job import MegatronJobSpec
from megatron_contract.mesh import BatchGeometry, MeshPlan, StateSource, StateSourceKind
from megatron_trainer.faults import ENV_FAULTS, Fault, FaultPlan, InjectedFault, InjectionPoint
from megatron_trainer.worker.data import IndexedTokens, MockTokens, micro_batches, replica_samples
from megatron_trainer.worker.lifecycle import IllegalTransition, WorkerState, check_transition
from megatron_trainer.worker.optimizer_shards import ShardPieces, columns_of, materialize
from megatron_trainer.worker.peer_restore import buckets, restore_routes
from megatron_trainer.worker.settings import (
    ENV_ALLOC_CONF,
    ENV_COPY_TRANSPORT,
    NCCL_DEFAULTS,
    PINNED_ALLOC_CONF,
    WorkerSettings,
    apply_process_defaults,
)
from megatron_trainer.worker.verify import StateMismatch, check_step


def test_lifecycle_allows_the_recovery_path() -> None:
    path = [
        WorkerState.STARTING,
        WorkerState.SPARE,
        WorkerState.RECONFIGURING,
        WorkerState.TRAINING,
        WorkerState.WAITING,
        WorkerState.RECONFIGURING,
        WorkerState.TRAINING,
        WorkerState.RECONFIGURING,
        WorkerState.RECONFIGURING,  # a newer plan overtook the join
        WorkerState.SPARE,
    ]
    state = path[0]
    for target in path[1:]:
        state = check_transition(state, target)
    assert state is WorkerState.SPARE


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (WorkerState.STARTING, WorkerState.TRAINING),  # never trains without joining an epoch
        (WorkerState.SPARE, WorkerState.TRAINING),
        (WorkerState.WAITING, WorkerState.TRAINING),  # a failed epoch is never resumed as is
        (WorkerState.FAILED, WorkerState.SPARE),
    ],
)
def test_lifecycle_refuses_shortcuts(current: WorkerState, target: WorkerState) -> None:
    with pytest.raises(IllegalTransition, match=f"from {current.value} to {target.value}"):
        check_transition(current, target)


def test_fault_plan_chains_and_round_trips_through_env() -> None:
    plan = FaultPlan().fail_at(rank=1, step=3).fail_at(rank=0, step=5, fault=Fault.SIGSTOP, epoch=2)
    back = FaultPlan.from_env({ENV_FAULTS: plan.to_env()})
    assert back.specs == plan.specs
    assert back.due(epoch=1, rank=1, step=3) is not None
    assert back.due(epoch=2, rank=1, step=3) is None  # the rank's successor in a later epoch is spared
    assert back.due(epoch=2, rank=0, step=5).fault is Fault.SIGSTOP  # type: ignore[union-attr]
    assert FaultPlan.from_env({}).specs == []


def test_fault_plan_rejects_malformed_env() -> None:
    with pytest.raises(ValueError, match=ENV_FAULTS):
        FaultPlan.from_env({ENV_FAULTS: '[{"fault": "meteor", "rank": 0, "step": 1}]'})


def test_exception_fault_raises_only_when_due() -> None:
    plan = FaultPlan().fail_at(rank=2, step=4, fault=Fault.EXCEPTION)
    plan.maybe_fire(epoch=1, rank=2, step=3)
    with pytest.raises(InjectedFault, match="rank 2 step 4"):
        plan.maybe_fire(epoch=1, rank=2, step=4)


def test_before_update_fault_is_due_only_at_its_point() -> None:
    plan = FaultPlan().fail_at(rank=1, step=3, fault=Fault.DELAY, seconds=4, point=InjectionPoint.BEFORE_UPDATE)
    back = FaultPlan.from_env({ENV_FAULTS: plan.to_env()})
    assert back.due(epoch=1, rank=1, step=3) is None  # not mid-step
    due = back.due(epoch=1, rank=1, step=3, point=InjectionPoint.BEFORE_UPDATE)
    assert due is not None and due.fault is Fault.DELAY and due.seconds == 4


def test_mock_samples_are_deterministic_and_distinct() -> None:
    a, b = MockTokens(seed=7, vocab_size=100, seq_length=16), MockTokens(seed=7, vocab_size=100, seq_length=16)
    assert torch.equal(a.sample(5), b.sample(5))
    assert not torch.equal(a.sample(5), a.sample(6))
    assert a.sample(0).shape == (17,) and int(a.sample(0).max()) < 100
    with pytest.raises(ValueError, match="negative"):
        a.sample(-1)


@given(
    micro=st.integers(min_value=1, max_value=4),
    n_micro=st.integers(min_value=1, max_value=24),
    dp=st.integers(min_value=1, max_value=8),
    step=st.integers(min_value=0, max_value=1000),
)
def test_every_sample_of_a_step_goes_to_exactly_one_replica(micro: int, n_micro: int, dp: int, step: int) -> None:
    if n_micro < dp:
        return  # the contract refuses such a split; covered by the contract's own tests
    batch = BatchGeometry.split(micro * n_micro, micro, dp)
    taken = [i for d in range(dp) for i in replica_samples(batch, d, step)]
    g = batch.global_batch_size
    assert sorted(taken) == list(range(step * g, (step + 1) * g))
    assert len(taken) == len(set(taken))


def test_micro_batches_shift_labels_by_one() -> None:
    source = MockTokens(seed=1, vocab_size=50, seq_length=8)
    batch = BatchGeometry.split(4, 2, 1)
    mbs = list(micro_batches(source, batch, dp_rank=0, step=1, device=torch.device("cpu")))
    assert [mb.indices for mb in mbs] == [(4, 5), (6, 7)]
    assert mbs[0].tokens.shape == (2, 8)
    assert torch.equal(mbs[0].tokens[0, 1:], mbs[0].labels[0, :-1])
    with pytest.raises(ValueError, match="dp rank 1"):
        replica_samples(batch, 1, 0)


def test_settings_name_what_is_missing() -> None:
    with pytest.raises(ValueError, match=wire.ENV_JOB_SPEC):
        WorkerSettings.from_env({})
    with pytest.raises(ValueError, match="not a valid MegatronJobSpec"):
        WorkerSettings.from_env({wire.ENV_JOB_SPEC: '{"replicas": -1}', wire.ENV_POD_NAME: "p"})
    with pytest.raises(ValueError, match=wire.ENV_POD_NAME):
        WorkerSettings.from_env({wire.ENV_JOB_SPEC: '{"image": "x", "replicas": 1}'})


def test_settings_take_the_copy_transport_and_refuse_an_unknown_one() -> None:
    env = {wire.ENV_JOB_SPEC: '{"image": "x", "replicas": 3}', wire.ENV_POD_NAME: "p"}
    assert not WorkerSettings.from_env(env).copies_over_gloo
    assert WorkerSettings.from_env({**env, ENV_COPY_TRANSPORT: "gloo"}).copies_over_gloo
    with pytest.raises(ValueError, match=ENV_COPY_TRANSPORT):
        WorkerSettings.from_env({**env, ENV_COPY_TRANSPORT: "tcp"})


def test_process_defaults_keep_what_is_set_and_add_the_pinned_memory_options() -> None:
    env: dict[str, str] = {"NCCL_NVLS_ENABLE": "1"}
    apply_process_defaults(env)
    assert env == {**NCCL_DEFAULTS, "NCCL_NVLS_ENABLE": "1", ENV_ALLOC_CONF: PINNED_ALLOC_CONF}
    env = {ENV_ALLOC_CONF: "expandable_segments:True"}
    apply_process_defaults(env)
    assert env[ENV_ALLOC_CONF] == f"expandable_segments:True,{PINNED_ALLOC_CONF}"
    env = {ENV_ALLOC_CONF: "pinned_use_background_threads:True"}  # the user's pinned options win
    apply_process_defaults(env)
    assert env[ENV_ALLOC_CONF] == "pinned_use_background_threads:True"


def test_settings_ignore_spec_fields_of_a_newer_operator() -> None:
    env = {wire.ENV_JOB_SPEC: '{"image": "x", "replicas": 3, "futureKnob": 2}', wire.ENV_POD_NAME: "p"}
    assert WorkerSettings.from_env(env).spec.replicas == 3


def test_survivors_step_wins_over_the_plans_estimate() -> None:
    # The operator's resumeStep comes from lagging heartbeats: survivors that kept (or broadcast)
    # their state may be well past it, or one step short when the step in flight was discarded.
    spec = make_spec()
    replace = make_plan(spec, 2, ["spare", "survivor"], 1, resume_step=5, sources=peer_sources(spec, [0, 1], [2, 3]))
    for held in (5, 4, 6, 14):
        check_step(replace, held)


@pytest.mark.parametrize("epoch, held", [(1, 3), (2, 11)])
def test_a_fresh_or_checkpoint_start_must_hold_the_plans_step(epoch: int, held: int) -> None:
    spec = make_spec()
    plan = make_plan(spec, epoch, ["a", "b"], 1, resume_step=10)
    if epoch == 2:  # a shard nobody holds: everyone loads the checkpoint of step 10
        plan = MeshPlan.model_validate(
            {**plan.to_wire(), "defaultSource": "checkpoint", "defaultCheckpointStep": 10, "stateSources": []}
        )
    else:
        plan = plan.model_copy(update={"resume_step": 0})
    with pytest.raises(StateMismatch, match="the plan restores step"):
        check_step(plan, held)
    check_step(plan, plan.resume_step)


def test_a_checkpoint_restore_may_fall_back_to_an_older_step_never_a_newer_one() -> None:
    # The plan's checkpoint failed verification and every rank restored the next older one.
    spec = make_spec()
    plan = make_plan(spec, 2, ["a", "b"], 1, resume_step=10)
    plan = MeshPlan.model_validate(
        {**plan.to_wire(), "defaultSource": "checkpoint", "defaultCheckpointStep": 10, "stateSources": []}
    )
    check_step(plan, 8)
    with pytest.raises(StateMismatch, match="the plan restores step"):
        check_step(plan, 12)


def test_indexed_tokens_read_megatrons_indexed_dataset(tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    docs = [[5, 6, 7], list(range(10, 30)), [42]]
    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for doc in docs:
        builder.add_item(torch.tensor(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")

    source = IndexedTokens(prefix, seq_length=7)
    assert source.sample(0).tolist() == [5, 6, 7, 5, 6, 7, 5, 6]  # short: repeated to seq + 1
    assert source.sample(1).tolist() == list(range(10, 18))  # long: cut
    assert source.sample(2).tolist() == [42] * 8
    assert source.sample(4).tolist() == source.sample(1).tolist()  # index wraps over the corpus
    assert source.sample(1).dtype == torch.int64


def test_restore_buckets_group_by_dtype_in_order_within_the_limit() -> None:
    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(300)  # float32: 16, 16, 1200 bytes
    h1, h2 = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)
    got = buckets([h1, a, b, h2, c], limit=40)
    assert [[id(t) for t in run] for run in got] == [[id(h1), id(h2)], [id(a), id(b)], [id(c)]]
    # Every tensor exactly once, whatever the limit.
    tensors = [torch.zeros(n) for n in (1, 7, 3, 12, 5)]
    for limit in (4, 20, 10_000):
        flat = [t for run in buckets(tensors, limit=limit) for t in run]
        assert [id(t) for t in flat] == [id(t) for t in tensors]


def test_restore_routes_name_the_plans_peers_when_survivors_agree() -> None:
    spec = make_spec()  # dp 2, tp 2: DP groups {0, 2} and {1, 3}
    replace = make_plan(spec, 2, ["spare", "survivor"], 1, resume_step=5, sources=peer_sources(spec, [0, 1], [2, 3]))
    assert restore_routes(replace, [1, 3], {}) == {1: 3}
    assert restore_routes(replace, [1, 3], {3: 5}) == {1: 3}
    kept = make_plan(spec, 2, ["a", "b"], 1, resume_step=5)
    assert restore_routes(kept, [1, 3], {1: 5, 3: 5}) == {}


def test_restore_routes_bring_a_survivor_behind_to_its_peers_step() -> None:
    # Rank 1's step 4 was aborted before its optimizer update; its DP peer rank 3 committed it.
    spec = make_spec()
    kept = make_plan(spec, 2, ["a", "b"], 1, resume_step=4)
    assert restore_routes(kept, [1, 3], {1: 4, 3: 5}) == {1: 3}
    assert restore_routes(kept, [1, 3], {1: 5, 3: 4}) == {3: 1}


def test_restore_routes_redirect_a_newcomer_whose_named_peer_is_behind() -> None:
    spec = make_spec(replicas=3)  # dp 3: DP group {1, 3, 5}
    sources = peer_sources(spec, [1], [3])  # the spare in pod "a" takes rank 1's state from rank 3
    plan = make_plan(spec, 2, ["spare", "b", "c"], 1, resume_step=4, sources=sources)
    assert restore_routes(plan, [1, 3, 5], {3: 4, 5: 5}) == {1: 5, 3: 5}
    assert restore_routes(plan, [1, 3, 5], {3: 5, 5: 4}) == {1: 3, 5: 3}
    # Two survivors at the newest step: the lowest-ranked one sends.
    kept = make_plan(spec, 2, ["a", "b", "c"], 1, resume_step=4)
    assert restore_routes(kept, [1, 3, 5], {1: 5, 3: 4, 5: 5}) == {3: 1}


def test_restore_routes_take_a_survivor_behind_to_a_peer_holding_the_same_experts() -> None:
    # dp 4, tp 1, ep 2: ranks 0 and 2 hold experts 0-1, ranks 1 and 3 experts 2-3.
    spec = MegatronJobSpec.model_validate(
        {
            **make_spec(
                replicas=4, min_replicas=2, tp=1, gpus_per_pod=2, num_experts=4, add_bias_linear=False
            ).to_wire(),
            "ep": 2,
        }
    )
    kept = make_plan(spec, 2, ["a", "b"], 1, resume_step=4)
    # Rank 0 is behind; rank 1 is the lowest-ranked holder of the newest step, but of other experts.
    assert restore_routes(kept, [0, 1, 2, 3], {0: 4, 1: 5, 2: 5, 3: 5}) == {0: 2}
    # Nobody holds experts 0-1 at the newest step: no route can repair it (verification refuses it).
    assert restore_routes(kept, [0, 1, 2, 3], {0: 4, 1: 5, 2: 4, 3: 5}) == {}


@given(
    steps=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=4),
    newcomers=st.lists(st.integers(min_value=0, max_value=7), max_size=4),
)
def test_restore_routes_leave_every_member_at_the_newest_step(steps: list[int], newcomers: list[int]) -> None:
    # One DP group of single-rank replicas (tp 1): survivors hold ``steps``, each newcomer names
    # some survivor as its peer.
    spec = make_spec(tp=1, gpus_per_pod=1, replicas=len(steps) + len(newcomers))
    survivors = list(range(len(steps)))
    joining = [len(steps) + i for i in range(len(newcomers))]
    sources = {
        r: StateSource(rank=r, kind=StateSourceKind.PEER, peer_rank=survivors[n % len(survivors)])
        for r, n in zip(joining, newcomers, strict=True)
    }
    plan = make_plan(spec, 2, [f"p{r}" for r in survivors + joining], 1, sources=sources)
    held = dict(zip(survivors, steps, strict=True))
    routes = restore_routes(plan, survivors + joining, held)
    newest = max(steps)
    assert set(routes) == set(joining) | {r for r in survivors if held[r] < newest}
    assert all(held[sender] == newest for sender in routes.values()), "every sender holds the newest step"
    assert all(held[r] == newest for r in survivors if r not in routes), "a survivor that keeps is current"
    kept_peers = {r: s.peer_rank for r, s in sources.items() if held[s.peer_rank or 0] == newest}
    assert {r: routes[r] for r in kept_peers} == kept_peers, "a current named peer is kept"


@given(
    layout=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40)), max_size=8),  # (padding before, piece rows)
    tail=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_flat_shards_hold_every_piece_where_it_starts_and_zeros_elsewhere_columns_apart(
    layout: list[tuple[int, int]], tail: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    pieces, row = [], 0
    for gap, rows in layout:
        dtypes = (torch.float32, torch.float32, torch.bfloat16 if rows % 3 == 0 else torch.float32)
        pieces.append((row + gap, tuple(torch.randn(rows, generator=generator).to(d) for d in dtypes)))
        row += gap + rows
    shard = ShardPieces(row + tail, tuple(reversed(pieces)))  # in any order
    want = torch.zeros(shard.rows, 3)
    for first, columns in pieces:
        for c, t in enumerate(columns):
            want[first : first + t.numel(), c] = t.float()
    [got] = materialize([shard])
    assert got.shape == want.shape and torch.equal(got, want), (got, want)
    # Each column lies whole in memory, the next after it: copies move the memory as it is.
    memory = columns_of(got)
    assert memory.data_ptr() == got.data_ptr() and torch.equal(memory.reshape(-1), want.t().reshape(-1))
    # The runs are found once; the next refresh reads the pieces' tensors as they are by then.
    for first, columns in pieces:
        for c, t in enumerate(columns):
            t.mul_(2)
            want[first : first + t.numel(), c] = t.float()
    [again] = materialize([shard])
    assert torch.equal(again, want), (again, want)
