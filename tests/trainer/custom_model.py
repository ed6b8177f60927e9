"""A model the tests define themselves, trained through ``spec.model.modelProvider`` and
``spec.model.forwardStep`` (Megatron-LM's plug-in shape, see ``megatron_trainer.worker.providers``).

It is no GPT: a vocabulary-parallel embedding, one tensor-parallel GeLU MLP block with a residual,
and a vocabulary-parallel output with Megatron's parallel cross-entropy, all Megatron-Core layers,
with a forward signature of its own (tokens and labels only).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule

from megatron_contract.job import MegatronJobSpec
from megatron_trainer.worker.providers import per_token_loss


class MlpLanguageModel(MegatronModule):
    """Embedding -> h + MLP(h) -> logits, tensor-parallel over the MLP and the vocabulary."""

    def __init__(self, config: Any, vocab_size: int) -> None:
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder  # read by Megatron's schedules
        h, f = config.hidden_size, config.ffn_hidden_size
        self.embedding = tensor_parallel.VocabParallelEmbedding(
            vocab_size, h, init_method=config.init_method, config=config
        )
        self.up = tensor_parallel.ColumnParallelLinear(
            h, f, config=config, init_method=config.init_method, bias=True, gather_output=False
        )
        self.down = tensor_parallel.RowParallelLinear(
            f,
            h,
            config=config,
            init_method=config.output_layer_init_method,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
        )
        self.output = tensor_parallel.ColumnParallelLinear(
            h, vocab_size, config=config, init_method=config.init_method, bias=False, gather_output=False
        )

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Megatron's schedules hand a pipeline stage its input here; with one stage there is none."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token losses [micro_batch, seq]."""
        hidden = self.embedding(tokens.t()).contiguous()  # [seq, micro_batch, h], Megatron's layout
        hidden = hidden + self.down(F.gelu(self.up(hidden)[0]))[0]
        logits = self.output(hidden)[0]
        return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels.t().contiguous()).t()


def model_provider(pre_process: bool, post_process: bool, *, config: Any, spec: MegatronJobSpec) -> MlpLanguageModel:
    """Megatron-LM's provider shape; this model has no pipeline stages."""
    if not (pre_process and post_process):
        raise ValueError("MlpLanguageModel does not split into pipeline stages")
    logging.getLogger(__name__).info("custom_model: built MlpLanguageModel")
    return MlpLanguageModel(config, spec.model.vocab_size)


def forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]], model: Any
) -> tuple[torch.Tensor, Callable[..., Any]]:
    """Megatron-LM's forward-step shape."""
    batch = next(data_iterator)
    return model(batch["tokens"], batch["labels"]), per_token_loss
