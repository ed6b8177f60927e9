"""Model presets against their publications, and the model fields reaching Megatron-Core.

Scenarios: each ``spec.model.preset``'s parameter count, from the Megatron-Core model the worker
builds (meta device, depths 1 and 2, extrapolated), is within 0.5 % of the published figure, and
for the Llama and Qwen presets equal to the exact count of the published checkpoints; the depth
extrapolation equals a whole build with real tensors on the CPU for a small Llama-style model, dense
and mixture-of-experts (megatron-core's local experts, no Transformer Engine);
fields given next to a preset override it; fp8 without Transformer Engine is refused naming the
field, and so is sequenceParallel (which MoE with tp > 1 needs) without Transformer Engine or Apex.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_contract.job import MegatronJobSpec, Precision
from megatron_contract.presets import CHECKPOINT_PARAMETERS, PUBLISHED_PARAMETERS, ModelPreset
from megatron_trainer.worker.model import check_supported, has_apex, has_transformer_engine

REPO = Path(__file__).resolve().parents[2]

SMALL_LLAMA = {
    "numLayers": 3,
    "hiddenSize": 64,
    "numAttentionHeads": 8,
    "numQueryGroups": 2,
    "ffnHiddenSize": 160,
    "vocabSize": 256,
    "activation": "swiglu",
    "normalization": "RMSNorm",
    "positionEmbedding": "rope",
    "addBiasLinear": False,
    "untieEmbeddingsAndOutputWeights": True,
}


def model_size(*args: str) -> list[dict[str, object]]:
    env = {"PYTHONPATH": f"{REPO / 'contract'}:{REPO / 'trainer'}", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    # A bare environment, but torch's inductor cache where the suite keeps it (tests/conftest.py),
    # not in /tmp: importing megatron-core makes that folder.
    env["TORCHINDUCTOR_CACHE_DIR"] = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    out = subprocess.run(
        [sys.executable, "-m", "megatron_trainer.model_size", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def counts() -> dict[str, int]:
    rows = model_size(*(a for p in ModelPreset for a in ("--preset", p.value)))
    return {str(r["preset"]): int(str(r["parameters"])) for r in rows}


@pytest.mark.parametrize("preset", list(ModelPreset), ids=lambda p: p.value)
def test_preset_parameter_count_matches_the_publication(counts: dict[str, int], preset: ModelPreset) -> None:
    got = counts[preset.value]
    published = PUBLISHED_PARAMETERS[preset]
    assert abs(got - published) / published < 0.005, f"{preset}: built {got:,}, published {published:,.0f}"
    if preset in CHECKPOINT_PARAMETERS:
        assert got == CHECKPOINT_PARAMETERS[preset], (
            f"{preset}: built {got:,}, the published checkpoint has {CHECKPOINT_PARAMETERS[preset]:,}"
        )


def test_depth_extrapolation_equals_a_whole_cpu_build() -> None:
    (row,) = model_size("--model", json.dumps(SMALL_LLAMA))
    assert row["extrapolated"] == row["cpu"]
    assert isinstance(row["cpu"], int) and row["cpu"] > 0


def test_mixture_of_experts_builds_every_expert_and_a_router() -> None:
    experts = 4
    moe = {**SMALL_LLAMA, "numExperts": experts, "moeRouterTopk": 2}
    dense_row, moe_row = model_size("--model", json.dumps(SMALL_LLAMA), "--model", json.dumps(moe))
    assert moe_row["extrapolated"] == moe_row["cpu"]
    h, f, layers = SMALL_LLAMA["hiddenSize"], SMALL_LLAMA["ffnHiddenSize"], SMALL_LLAMA["numLayers"]
    # Per layer: experts - 1 more SwiGLU MLPs (3 h x f matrices each, no biases) and a router (experts x h).
    extra = layers * ((experts - 1) * 3 * h * f + experts * h)
    assert isinstance(moe_row["cpu"], int) and isinstance(dense_row["cpu"], int)
    assert moe_row["cpu"] - dense_row["cpu"] == extra


def test_fields_next_to_a_preset_override_it() -> None:
    spec = MegatronJobSpec.model_validate(
        {"image": "x", "replicas": 1, "model": {"preset": "llama3-8b", "numLayers": 4, "seqLength": 1024}}
    )
    m = spec.model
    assert (m.num_layers, m.seq_length) == (4, 1024)
    assert (m.hidden_size, m.query_groups, m.ffn_size, m.rotary_base) == (4096, 8, 14336, 500000)
    assert MegatronJobSpec.model_validate_json(spec.model_dump_json(by_alias=True)).model == m  # survives the wire


@pytest.mark.skipif(has_transformer_engine(), reason="Transformer Engine is installed: fp8 is allowed")
def test_fp8_without_transformer_engine_is_refused_naming_the_field() -> None:
    spec = MegatronJobSpec(image="x", replicas=1, training={"precision": Precision.FP8})
    with pytest.raises(ValueError, match=r"spec\.training\.precision fp8 needs Transformer Engine"):
        check_supported(spec, torch.device("cpu"))


@pytest.mark.skipif(has_transformer_engine() or has_apex(), reason="Transformer Engine or Apex norms are installed")
def test_sequence_parallel_without_fused_norms_is_refused_naming_the_field() -> None:
    # megatron-core's local spec would fail later, building the model: "sequence parallel not
    # supported by torch LayerNorm". MoE with tp > 1 needs sequence parallelism, so it cannot train here.
    model = {"numExperts": 4, "addBiasLinear": False, "sequenceParallel": True}
    spec = MegatronJobSpec(image="x", replicas=1, tp=2, gpus_per_pod=2, model=model)
    with pytest.raises(ValueError, match=r"spec\.model\.sequenceParallel needs Transformer Engine or Apex"):
        check_supported(spec, torch.device("cpu"))
