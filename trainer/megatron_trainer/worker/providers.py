"""Model providers and forward steps, in Megatron-LM's plug-in shape.

A job may name its own (``spec.model.modelProvider`` / ``spec.model.forwardStep``, each
``package.module:function`` importable in the trainer image); the built-in GPT of ``spec.model``
(and so every preset) is the default pair below, used through the same path.

- ``model_provider(pre_process, post_process, *, config, spec)`` returns a Megatron-Core module
  (a ``MegatronModule`` with ``model_type`` and ``set_input_tensor``, as Megatron's schedules require; its
  ``sharded_state_dict`` is what distributed checkpoints save). ``config``
  is the TransformerConfig the worker derived from ``spec.model`` for the current process groups,
  ``spec`` the whole MegatronJobSpec.
- ``forward_step(data_iterator, model)`` takes one micro-batch from the iterator and returns
  ``(output, loss_func)``; ``loss_func(output)`` returns ``(loss_sum, num_tokens, {"lm loss":
  tensor([loss_sum, num_tokens])})``: Megatron-LM's shape with ``calculate_per_token_loss``, so the
  worker divides by the global token count whatever the data-parallel size.

A micro-batch is a dict: ``tokens`` and ``labels`` ([micro_batch, seq] int64), ``position_ids``
([1, seq]) and ``loss_mask`` ([micro_batch, seq], ones).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_contract.job import MegatronJobSpec

ModelProvider = Callable[..., Any]
ForwardStep = Callable[[Iterator[dict[str, torch.Tensor]], Any], tuple[torch.Tensor, Callable[..., Any]]]


def load(reference: str) -> Any:
    """Import ``package.module:function``; a bad reference raises ValueError naming it."""
    module_name, _, attribute = reference.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import {reference!r} from the trainer image: {err}") from err


def gpt_model_provider(pre_process: bool, post_process: bool, *, config: Any, spec: MegatronJobSpec) -> Any:
    """The Megatron-Core GPTModel of ``spec.model`` (presets included)."""
    from megatron_trainer.worker.model import build_gpt

    return build_gpt(spec, config, pre_process=pre_process, post_process=post_process)


def per_token_loss(per_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Summed loss, token count and the report Megatron's schedule collects (see the module docstring)."""
    loss_sum = per_token.float().sum()
    tokens = torch.tensor(per_token.numel(), dtype=torch.int, device=per_token.device)
    return loss_sum, tokens, {"lm loss": torch.stack([loss_sum.detach().double(), tokens.double()])}


def gpt_forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]], model: Any
) -> tuple[torch.Tensor, Callable[..., Any]]:
    """GPTModel's forward: per-token losses of the micro-batch (no attention mask: causal)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, per_token_loss


def model_provider(spec: MegatronJobSpec) -> ModelProvider:
    """The job's model provider."""
    return load(spec.model.model_provider) if spec.model.model_provider else gpt_model_provider


def forward_step(spec: MegatronJobSpec) -> ForwardStep:
    """The job's forward step."""
    return load(spec.model.forward_step) if spec.model.forward_step else gpt_forward_step
