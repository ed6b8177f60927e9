"""Named model architectures for ``spec.model.preset``.

Each preset is the set of ``spec.model`` fields (camelCase, as on the wire) that define the
architecture; fields a job gives next to a preset override it. The shapes follow the published
configurations of the models they are named after; ``PUBLISHED_PARAMETERS`` holds the parameter
count each publication states, and ``CHECKPOINT_PARAMETERS`` the exact count of the published
checkpoints, which tests compare with the count of the Megatron-Core model built from the preset
and with :mod:`megatron_contract.parameters`. Vocabularies are padded where the original is not divisible by 128 (as
Megatron-LM's ``--make-vocab-size-divisible-by 128`` does), so tensor parallelism up to 128 splits
them evenly.
"""

from __future__ import annotations

import enum
from typing import Any


class ModelPreset(enum.StrEnum):
    """Known architectures."""

    GPT_125M = "gpt-125m"  # GPT-3 Small (Brown et al. 2020, table 2.1)
    LLAMA3_1B = "llama3-1b"  # Llama 3.2 1B
    LLAMA3_8B = "llama3-8b"  # Llama 3 / 3.1 8B
    LLAMA3_70B = "llama3-70b"  # Llama 3 / 3.1 70B
    QWEN25_7B = "qwen2.5-7b"  # Qwen2.5 7B


def _llama3(layers: int, hidden: int, heads: int, ffn: int, tied: bool) -> dict[str, Any]:
    return {
        "numLayers": layers,
        "hiddenSize": hidden,
        "numAttentionHeads": heads,
        "numQueryGroups": 8,
        "ffnHiddenSize": ffn,
        "seqLength": 8192,
        "maxPositionEmbeddings": 131072,
        "vocabSize": 128256,
        "activation": "swiglu",
        "normalization": "RMSNorm",
        "layernormEpsilon": 1e-5,
        "positionEmbedding": "rope",
        "rotaryBase": 500000,
        "rotaryPercent": 1.0,
        "untieEmbeddingsAndOutputWeights": not tied,
        "addBiasLinear": False,
        "addQkvBias": False,
        "qkLayernorm": False,
        "initMethodStd": 0.02,
    }


PRESETS: dict[ModelPreset, dict[str, Any]] = {
    ModelPreset.GPT_125M: {
        "numLayers": 12,
        "hiddenSize": 768,
        "numAttentionHeads": 12,
        "numQueryGroups": 12,
        "ffnHiddenSize": 3072,
        "seqLength": 2048,
        "maxPositionEmbeddings": 2048,
        "vocabSize": 50304,  # GPT-2's 50257, padded to a multiple of 128
        "activation": "gelu",
        "normalization": "LayerNorm",
        "layernormEpsilon": 1e-5,
        "positionEmbedding": "learned",
        "rotaryBase": 10000,
        "rotaryPercent": 1.0,
        "untieEmbeddingsAndOutputWeights": False,
        "addBiasLinear": True,
        "addQkvBias": True,
        "qkLayernorm": False,
        "initMethodStd": 0.02,
    },
    ModelPreset.LLAMA3_1B: _llama3(16, 2048, 32, 8192, tied=True),
    ModelPreset.LLAMA3_8B: _llama3(32, 4096, 32, 14336, tied=False),
    ModelPreset.LLAMA3_70B: _llama3(80, 8192, 64, 28672, tied=False),
    ModelPreset.QWEN25_7B: {
        "numLayers": 28,
        "hiddenSize": 3584,
        "numAttentionHeads": 28,
        "numQueryGroups": 4,
        "ffnHiddenSize": 18944,
        "seqLength": 4096,
        "maxPositionEmbeddings": 32768,
        "vocabSize": 152064,
        "activation": "swiglu",
        "normalization": "RMSNorm",
        "layernormEpsilon": 1e-6,
        "positionEmbedding": "rope",
        "rotaryBase": 1000000,
        "rotaryPercent": 1.0,
        "untieEmbeddingsAndOutputWeights": True,
        "addBiasLinear": False,
        "addQkvBias": True,
        "qkLayernorm": False,
        "initMethodStd": 0.02,
    },
}

# Parameter counts as published (model cards / papers), for the preset test.
PUBLISHED_PARAMETERS: dict[ModelPreset, float] = {
    ModelPreset.GPT_125M: 125e6,
    ModelPreset.LLAMA3_1B: 1.24e9,
    ModelPreset.LLAMA3_8B: 8.03e9,
    ModelPreset.LLAMA3_70B: 70.6e9,
    ModelPreset.QWEN25_7B: 7.61e9,
}

# Exact parameter counts of the published checkpoints (their safetensors' total), where the preset
# is their architecture exactly. GPT-3 Small's vocabulary is padded here, so only its rounded figure applies.
CHECKPOINT_PARAMETERS: dict[ModelPreset, int] = {
    ModelPreset.LLAMA3_1B: 1_235_814_400,
    ModelPreset.LLAMA3_8B: 8_030_261_248,
    ModelPreset.LLAMA3_70B: 70_553_706_496,
    ModelPreset.QWEN25_7B: 7_615_616_512,
}
