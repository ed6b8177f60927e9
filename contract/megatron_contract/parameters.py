"""Parameter tensors of the GPT a worker builds from ``spec.model``, per model-parallel rank, by arithmetic.

``megatron_trainer.model_size`` counts parameters by building the Megatron-Core model (on the meta
device); the operator has neither torch nor megatron, yet needs the sizes to state the host memory
of the distributed optimizer's buddy copies (:mod:`megatron_contract.host_memory`). So the shapes
are written out here, following megatron-core's GPTModel with TP=PP splits as Megatron makes them
(column- and row-parallel weights and the vocabulary split over tp; norms, the row-parallel
biases, learned positions and the MoE router replicated; layers split evenly over pp; experts over
ep). tests/trainer/test_parameters.py compares them, tensor by tensor, with the model built.

The element counts are what the distributed optimizer lays out in its buffers: with ep > 1 expert
tensors in a buffer of their own, sharded over the expert-data-parallel ranks, the rest in the
dense buffer.
A job with ``spec.model.modelProvider`` builds a model of its own: its sizes are unknown here.
"""

from __future__ import annotations

import dataclasses

from megatron_contract.job import Activation, ModelSpec, Normalization, PositionEmbedding


@dataclasses.dataclass(frozen=True)
class RankParameters:
    """Element counts of the parameter tensors one model-parallel rank holds, by optimizer buffer."""

    dense: tuple[int, ...]
    expert: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.dense) + sum(self.expert)


def rank_parameters(model: ModelSpec, tp: int, pp: int, ep: int, stage: int) -> RankParameters:
    """The tensors of a tensor-parallel rank of pipeline stage ``stage`` (all tp ranks hold the same
    sizes: spec rules make every split even)."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} outside 0..{pp - 1}")
    h, vocab = model.hidden_size, model.vocab_size // tp
    dense: list[int] = []
    expert: list[int] = []
    if stage == 0:
        dense.append(vocab * h)
        if model.position_embedding is PositionEmbedding.LEARNED:
            dense.append(model.max_positions * h)
    for _ in range(model.num_layers // pp):
        layer_dense, layer_expert = _layer(model, tp, ep)
        dense += layer_dense
        # megatron-core gives experts the expert data-parallel group (a buffer of their own) only
        # with ep > 1; else they are reduced with everything else.
        if ep > 1:
            expert += layer_expert
        else:
            dense += layer_expert
    if stage == pp - 1:
        dense += _norm(model, h)
        # Megatron ties the output layer to the embedding only on one stage (worker.model.build_gpt).
        if model.untie_embeddings_and_output_weights or pp > 1:
            dense.append(vocab * h)
    return RankParameters(tuple(dense), tuple(expert))


def total_parameters(model: ModelSpec) -> int:
    """Parameters of the whole model (TP=PP=EP=1), as ``megatron_trainer.model_size`` counts them."""
    return rank_parameters(model, 1, 1, 1, 0).total


def _norm(model: ModelSpec, size: int) -> list[int]:
    return [size, size] if model.normalization is Normalization.LAYER_NORM else [size]


def _layer(model: ModelSpec, tp: int, ep: int) -> tuple[list[int], list[int]]:
    """(dense, expert) tensors of one transformer layer on one tp rank."""
    h = model.hidden_size
    dense = [*_norm(model, h), *_attention(model, tp), *_norm(model, h)]
    if model.num_experts is None:
        return dense + _mlp(model, model.ffn_size, tp, model.add_bias_linear), []
    dense.append(model.num_experts * h)  # the router
    if model.add_bias_linear:
        dense.append(model.num_experts)
    ffn = model.moe_ffn_hidden_size or model.ffn_size
    expert = _mlp(model, ffn, tp, bias=False) * (model.num_experts // ep)
    return dense, expert


def _attention(model: ModelSpec, tp: int) -> list[int]:
    h = model.hidden_size
    head = model.kv_channels or h // model.num_attention_heads
    q, kv = model.num_attention_heads * head, model.query_groups * head
    qkv = (q + 2 * kv) // tp
    out = [qkv * h]
    if model.add_bias_linear or model.add_qkv_bias:
        out.append(qkv)
    if model.qk_layernorm:
        out += _norm(model, head) * 2
    out.append(q // tp * h)
    if model.add_bias_linear:
        out.append(h)  # a row-parallel bias is whole on every tp rank
    return out


def _mlp(model: ModelSpec, ffn: int, tp: int, bias: bool) -> list[int]:
    h = model.hidden_size
    fc1 = (2 if model.activation is Activation.SWIGLU else 1) * ffn // tp
    out = [fc1 * h, *([fc1] if bias else []), ffn // tp * h]
    return out + ([h] if bias else [])
