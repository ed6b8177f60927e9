"""Host memory of the distributed optimizer's buddy copies, by arithmetic (megatron_contract.host_memory).

Scenarios: the parameter arithmetic gives the exact count of each published checkpoint a preset
is; a small model split over tp 2 and pp 2 has the tensors counted by hand below; a shard's padding
bound is megatron-core's layout for two tensors; the worked example of the docs (llama3-1b at dp 2,
one GPU per pod) needs 29,659,693,056 bytes per pod, by hand; the size the need is stated for is
the smallest with two pods; no need without the distributed optimizer, with a model of one's own,
or on one pod; quantities parse as Kubernetes reads them; the memory request is taken from where
the operator takes the trainer's resources (the comparison with the pods it builds is in
tests/operator/test_host_memory_condition.py; with megatron-core's real layouts in tests/trainer/test_parameters.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from megatron_contract.host_memory import (
    host_memory_need,
    pod_copy_bytes,
    quantity_bytes,
    shard_elements,
    smallest_dp_with_copies,
    trainer_memory_request,
)
from megatron_contract.job import MegatronJobSpec
from megatron_contract.parameters import rank_parameters, total_parameters
from megatron_contract.presets import CHECKPOINT_PARAMETERS, ModelPreset

SMALL = {"numLayers": 4, "hiddenSize": 64, "numAttentionHeads": 4, "numQueryGroups": 2, "ffnHiddenSize": 128}


def job(**spec: Any) -> MegatronJobSpec:
    distributed = {"training": {"optimizer": {"distributed": True}}, "checkpoint": {"path": "/ckpt"}}
    return MegatronJobSpec.model_validate({"image": "x", "replicas": 2, **distributed, **spec})


@pytest.mark.parametrize("preset", list(CHECKPOINT_PARAMETERS), ids=lambda p: p.value)
def test_presets_count_as_their_published_checkpoints(preset: ModelPreset) -> None:
    model = MegatronJobSpec(image="x", replicas=1, model={"preset": preset.value}).model
    assert total_parameters(model) == CHECKPOINT_PARAMETERS[preset]


def test_tp_and_pp_split_as_counted_by_hand() -> None:
    model = job(
        model={**SMALL, "vocabSize": 256}, tp=2, pp=2, gpusPerPod=2
    ).model  # vocab 256, LayerNorm, biases, learned positions
    # One layer on a tp rank: 2 norms of (weight, bias) x 64; qkv (64 + 2*32)/2 = 64 rows of 64, bias 64;
    # proj 64 x 32, bias 64 whole; fc1 64 rows of 64, bias 64; fc2 64 x 64, bias 64 whole.
    layer = (64, 64, 4096, 64, 2048, 64, 64, 64, 4096, 64, 4096, 64)
    first = rank_parameters(model, tp=2, pp=2, ep=1, stage=0)
    last = rank_parameters(model, tp=2, pp=2, ep=1, stage=1)
    assert first.dense == (128 * 64, 64 * 64, *layer, *layer)  # half the vocabulary, learned positions whole
    assert last.dense == (*layer, *layer, 64, 64, 128 * 64)  # final norm; an output layer of its own on pp > 1
    assert first.expert == last.expert == ()
    assert (first.total, last.total) == (41_984, 38_016)


def test_moe_experts_are_split_over_ep_into_their_own_buffer() -> None:
    model = job(model={**SMALL, "numExperts": 4, "addBiasLinear": False, "activation": "swiglu"}).model
    one = rank_parameters(model, tp=1, pp=1, ep=2, stage=0)
    # Two experts of 4 per layer on an ep rank, each SwiGLU fc1 (2*128 x 64) and fc2 (64 x 128).
    assert one.expert == (2 * 128 * 64, 64 * 128) * 2 * 4
    assert 4 * 64 in one.dense  # the router, whole on every rank
    together = rank_parameters(model, tp=1, pp=1, ep=1, stage=0)  # ep 1: experts reduced with the rest
    assert together.expert == () and together.total == sum(one.dense) + 2 * sum(one.expert)


def test_shard_padding_bound_matches_megatrons_layout_of_two_tensors() -> None:
    # megatron-core: tensor 1 at [0, 30), tensor 0 at pad64(30) = [64, 164), end padded to lcm(2, 128):
    # 256 elements, 128 a rank. The bound takes the worst alignment (63 before each tensor but the first).
    assert shard_elements((100, 30), 2) == 128
    assert shard_elements((), 2) == 0
    assert shard_elements((1000,), 3) == 1152 // 3  # padded to a multiple of lcm(3, 128) = 384


def test_worked_example_llama3_1b_at_dp_2() -> None:
    spec = job(model={"preset": "llama3-1b"}, minReplicas=2)
    # 1,235,814,400 parameters in 98 tensors (embedding, 16 layers of 6, final norm; tied output), one
    # buffer: at most 1,235,814,400 + 63*97 = 1,235,820,511 elements, padded to 256: 1,235,820,544,
    # 617,910,272 a rank; x 12 bytes x 2 generations x (own + ward) = 29,659,693,056 bytes (27.6 GiB).
    assert pod_copy_bytes(spec, 2) == 29_659_693_056
    assert len(rank_parameters(spec.model, 1, 1, 1, 0).dense) == 98
    eight = job(model={"preset": "llama3-1b"}, replicas=8, gpusPerPod=8, minReplicas=8)
    assert pod_copy_bytes(eight, 16) == 8 * 4 * 12 * (1_235_820_544 // 16)  # 8 GPUs at dp 16: 8 ranks' copies


@pytest.mark.parametrize(
    ("spec", "dp"),
    [
        ({"replicas": 4}, 2),  # one GPU a pod, minReplicas 1: one pod has no buddy, two pods do
        ({"replicas": 4, "minReplicas": 3}, 3),
        ({"replicas": 8, "gpusPerPod": 4, "minReplicas": 4}, 8),  # 4 replicas a pod: two pods at dp 8
        ({"replicas": 4, "gpusPerPod": 4, "minReplicas": 4}, None),  # always one pod
        ({"replicas": 2, "pp": 2}, 1),  # a replica over two pods
    ],
)
def test_the_need_is_stated_for_the_smallest_size_with_two_pods(spec: dict[str, Any], dp: int | None) -> None:
    assert smallest_dp_with_copies(job(**spec)) == dp


def test_no_need_without_copies() -> None:
    assert host_memory_need(MegatronJobSpec(image="x", replicas=2)) is None  # not the distributed optimizer
    assert host_memory_need(job(model={"modelProvider": "mine.model:provide"})) is None  # sizes unknown here
    assert host_memory_need(job(replicas=4, gpusPerPod=4, minReplicas=4)) is None  # one pod: no buddy
    need = host_memory_need(job(resources={"requests": {"memory": "8Gi"}}))
    assert need is not None and (need.dp, need.request) == (2, 8 * 2**30) and need.need > 0


@pytest.mark.parametrize(
    ("quantity", "value"),
    [("64Gi", 64 * 2**30), ("1.5G", 1_500_000_000), ("2e9", 2 * 10**9), ("1E3", 1000), ("1E", 10**18),
     ("500m", 1), ("+.5Ki", 512), ("1536Mi", 1536 * 2**20), (7, 7)],
)  # fmt: skip
def test_quantities_parse_as_kubernetes_reads_them(quantity: str | int, value: int) -> None:
    assert quantity_bytes(quantity) == value


def test_memory_request_is_read_where_the_operator_takes_the_trainers_resources() -> None:
    assert trainer_memory_request(job()) is None
    assert trainer_memory_request(job(resources={"requests": {"memory": "1Gi"}})) == 2**30
    assert trainer_memory_request(job(resources={"limits": {"memory": "2Gi"}})) == 2 * 2**30  # request defaults to it
    trainer = {"name": "trainer", "resources": {"requests": {"memory": "3Gi"}}}
    assert trainer_memory_request(job(template={"spec": {"containers": [trainer]}})) == 3 * 2**30
    bare = {"spec": {"containers": [{"name": "trainer"}]}}
    assert trainer_memory_request(job(resources={"requests": {"memory": "1Gi"}}, template=bare)) == 2**30
