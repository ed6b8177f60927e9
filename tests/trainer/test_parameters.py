"""The contract's parameter and host-memory arithmetic (megatron_contract.parameters, .host_memory)
against Megatron-Core.

Scenarios: for small models of every kind the spec describes (GeLU/LayerNorm/biases/learned
positions, Llama-style SwiGLU/RMSNorm/RoPE untied, QK norms with QKV biases, MoE), the tensors of
the model the worker builds (meta device, TP=PP=EP=1) are the arithmetic's, element count by
element count; megatron-core's own layout of those tensors in model order, at DP 2, 3 and 8, gives a
shard no larger than the arithmetic's bound and smaller by no more than its alignment allowance;
and in real gloo processes at DP 2 (dense, and MoE with EP 2: experts in a buffer of their own)
the host copies ``BuddyCopies`` holds after two refreshes of the real optimizer's flat shards take
no more bytes than ``rank_copy_bytes``, within its padding allowance.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from test_model_presets import model_size
from worker_harness import make_spec, run_rank_scripts

from localcluster.cluster import free_port
from megatron_contract.host_memory import rank_copy_bytes, shard_elements
from megatron_contract.job import MegatronJobSpec
from megatron_contract.parameters import rank_parameters
from megatron_trainer.worker.reshard import BufferLayout

BASE = {"numLayers": 2, "hiddenSize": 64, "numAttentionHeads": 4, "vocabSize": 256}
MODELS = {
    "gpt": {**BASE, "numQueryGroups": 2},
    "llama": {
        **BASE,
        "numQueryGroups": 2,
        "ffnHiddenSize": 160,
        "activation": "swiglu",
        "normalization": "RMSNorm",
        "positionEmbedding": "rope",
        "addBiasLinear": False,
        "untieEmbeddingsAndOutputWeights": True,
    },
    "qwen-like": {**BASE, "addBiasLinear": False, "addQkvBias": True, "qkLayernorm": True, "kvChannels": 8},
    "moe": {**BASE, "numExperts": 4, "moeFfnHiddenSize": 96, "addBiasLinear": False, "activation": "swiglu"},
}


@pytest.fixture(scope="module")
def built() -> dict[str, dict[str, Any]]:
    rows = model_size(*(a for m in MODELS.values() for a in ("--tensors", json.dumps(m))))
    return {name: row for name, row in zip(MODELS, rows, strict=True)}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_arithmetic_has_the_built_models_tensors(built: dict[str, dict[str, Any]], name: str) -> None:
    counted = rank_parameters(MegatronJobSpec(image="x", replicas=1, model=MODELS[name]).model, 1, 1, 1, 0)
    assert sorted(built[name]["dense"]) == sorted(counted.dense)
    assert built[name]["expert"] == list(counted.expert) == []  # ep 1: experts are reduced with the rest


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dp", [2, 3, 8])
def test_the_shard_bound_holds_megatrons_layout(built: dict[str, dict[str, Any]], name: str, dp: int) -> None:
    tensors = built[name]["dense"]
    real = BufferLayout.of_megatron(tensors, dp, bucket_size=None).shard_numel
    bound = shard_elements(tuple(tensors), dp)
    allowance = 63 * (len(tensors) - 1) + math.lcm(dp, 128)
    assert real <= bound <= real + allowance // dp + 1


_RANK = r"""
import datetime, json, sys
import torch, torch.distributed as dist
from megatron_trainer import cpu_compat
cpu_compat.install()
from megatron.core import parallel_state
from megatron_contract.job import MegatronJobSpec
from megatron_trainer.worker.buddy_copies import BuddyCopies
from megatron_trainer.worker.model import build_train_state
from megatron_trainer.worker.optimizer_shards import flat_shards

rank, port = int(sys.argv[1]), int(sys.argv[2])
spec = MegatronJobSpec.model_validate(json.loads(sys.argv[3]))
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=spec.ep, create_gloo_process_groups=False)
ts = build_train_state(spec, torch.device("cpu"), initialize=True)
copies = BuddyCopies(rank, buddy=1 - rank, ward=1 - rank)
for step in (1, 2):
    copies.start_refresh(step, flat_shards(ts.optimizer))
    copies.finish_refresh()
print(json.dumps({"bytes": copies.host_bytes(), "buffers": len(flat_shards(ts.optimizer))}))
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["gpt", "moe"])
def test_real_buddy_copies_fit_the_stated_bytes(tmp_path: Path, name: str) -> None:
    ep = 2 if name == "moe" else 1
    wire = make_spec(tp=1, gpus_per_pod=1, min_replicas=2).to_wire()
    wire |= {"model": MODELS[name], "ep": ep, "checkpoint": {"path": str(tmp_path / "ckpt")}}
    wire["training"]["optimizer"]["distributed"] = True
    spec = MegatronJobSpec.model_validate(wire)
    port = free_port()
    results = run_rank_scripts(_RANK, lambda r: [str(r), str(port), json.dumps(wire)], world=2, timeout=400)
    stated = rank_copy_bytes(spec, 2)
    counted = rank_parameters(spec.model, 1, 1, ep, 0)
    # 4 copies (2 generations x own and ward's) of 12 bytes per element: padding is what may differ.
    allowance = 4 * 12 * (63 * (len(counted.dense) + len(counted.expert)) + 3 * 128)
    for r in results:
        assert r["buffers"] == (2 if ep > 1 else 1), r  # experts in a buffer of their own only with ep > 1
        assert stated - allowance <= r["bytes"] <= stated, (r, stated)
