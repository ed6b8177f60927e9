"""Build the Megatron-Core GPT, its DDP wrapper and Megatron's optimizer for the current groups,
and move model/optimizer state between builds.

Megatron modules capture their process groups when they are constructed (megatron-core 0.19), so
every epoch builds fresh ones. State is not rebuilt: :func:`detach_state` takes the tensors out of
the old build (they hold no group) and :func:`adopt_state` points the new build at them, so a
surviving rank keeps its exact bits and a re-mesh costs allocations, not copies.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from megatron_contract.job import MegatronJobSpec, Precision

# Optimizer state entries of Adam, in the canonical order used by transfer and checksums.
_ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


@dataclasses.dataclass
class TrainState:
    """What one rank trains: the DDP-wrapped model and Megatron's optimizer."""

    model: Any  # megatron.core.distributed.DistributedDataParallel wrapping a GPTModel
    optimizer: Any  # megatron.core.optimizer.MegatronOptimizer (ChainedOptimizer)
    config: Any  # megatron.core.transformer.TransformerConfig
    step: int = 0  # steps completed by this state
    build_seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # per build stage


@dataclasses.dataclass
class HeldState:
    """State tensors detached from a build: they reference no process group."""

    tensors: list[torch.Tensor]
    step: int


def param_dtype(spec: MegatronJobSpec, device: torch.device) -> torch.dtype:
    """bf16 on GPU when asked for; CPU runs always use fp32."""
    if device.type == "cuda" and spec.training.precision is Precision.BF16:
        return torch.bfloat16
    return torch.float32


def build_train_state(
    spec: MegatronJobSpec,
    device: torch.device,
    initialize: bool,
    before_collectives: Callable[[], object] | None = None,
) -> TrainState:
    """Build model, DDP and optimizer for the process groups in ``parallel_state`` now.

    Args:
        spec: the job (model size, optimizer settings, precision).
        device: the rank's device.
        initialize: draw initial weights from the job's seed (first epoch); otherwise leave them
            uninitialized because state will be adopted, received or loaded.
        before_collectives: called after the model and DDP exist and before the optimizer's first
            collective (waits for the epoch's communicators, see ``rendezvous.Connecting``).
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    m = spec.model
    dtype = param_dtype(spec, device)
    # Seeds the model-parallel RNG tracker for this epoch's tp rank (attention needs it to exist).
    model_parallel_cuda_manual_seed(spec.training.seed, force_reset_rng=True)
    config = TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        # No dropout: a resumed step must compute exactly what the uninterrupted run computed,
        # and dropout would need the RNG state of every rank carried across the re-mesh.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=initialize,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        # Loss is summed per token and divided by the global token count in finalize_model_grads,
        # so uneven micro-batches per replica (after a shrink) still give the global-batch mean.
        calculate_per_token_loss=True,
    )
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    marks = [("start", time.perf_counter())]
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(get_gpt_layer_local_spec),
        vocab_size=m.vocab_size,
        max_sequence_length=m.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=pp_size == 1,
    )
    if device.type == "cuda":
        gpt.cuda(device)
    marks.append(("model", _synced(device)))
    module: Any = gpt
    if config.bf16:
        from megatron.core.transformer.module import Float16Module

        module = Float16Module(config, gpt)  # casts inputs to bf16 and the loss back to fp32
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False), module
    )
    marks.append(("ddp", _synced(device)))
    if before_collectives is not None:
        before_collectives()
        marks.append(("connect_wait", time.perf_counter()))
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=spec.training.lr,
            weight_decay=0.0,
            clip_grad=1.0,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
        ),
        [model],
        use_gloo_process_groups=False,  # gloo side groups cost a TCP mesh per epoch; not needed here
    )
    marks.append(("optimizer", _synced(device)))
    _init_optimizer_state(optimizer)
    marks.append(("optimizer_state", _synced(device)))
    times = {name: t - marks[i][1] for i, (name, t) in enumerate(marks[1:])}
    return TrainState(model=model, optimizer=optimizer, config=config, build_seconds=times)


def _synced(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _layer_spec(factory: Any) -> Any:
    # The TE spec where Transformer Engine is installed, Megatron's local spec otherwise.
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return factory()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec()


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside Megatron's (possibly chained) optimizer, in order."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [c.optimizer for c in chained]


def _init_optimizer_state(optimizer: Any) -> None:
    """Create Adam's state up front (torch creates it lazily at the first step), so every build,
    fresh or warm, has the same tensors to transfer, compare and checksum."""
    for opt in _inner_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def sync_initial_weights(ts: TrainState) -> None:
    """Give every DP replica DP rank 0's initial weights (collective over the DP group) and
    refresh the optimizer's fp32 main copies from them."""
    ts.model.broadcast_params()
    for opt in getattr(ts.optimizer, "chained_optimizers", None) or [ts.optimizer]:
        opt.reload_model_params()


def state_tensors(ts: TrainState) -> list[torch.Tensor]:
    """Every tensor of model and optimizer state, in a canonical order shared by all builds with
    the same model-parallel coordinates: model parameters, then per optimizer parameter its main
    (fp32) copy and Adam's state."""
    out = [p.data for p in ts.model.module.parameters()]
    for opt in _inner_optimizers(ts.optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                out.append(p.data)
                out.extend(opt.state[p][k] for k in _ADAM_KEYS)
    return out


def detach_state(ts: TrainState) -> HeldState:
    """Take the state tensors out of a build that is about to be dropped."""
    return HeldState(tensors=list(state_tensors(ts)), step=ts.step)


def adopt_state(ts: TrainState, held: HeldState) -> None:
    """Point a fresh build at held state tensors (no copy); shapes must match exactly."""
    params = list(ts.model.module.parameters())
    expected = len(params) + sum(
        len(g["params"]) * (1 + len(_ADAM_KEYS)) for o in _inner_optimizers(ts.optimizer) for g in o.param_groups
    )
    if expected != len(held.tensors):
        raise ValueError(f"held state has {len(held.tensors)} tensors, the new build needs {expected}")
    it = iter(held.tensors)
    for p in params:
        _assign(p, next(it))
    for opt in _inner_optimizers(ts.optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                _assign(p, next(it))
                for k in _ADAM_KEYS:
                    new = next(it)
                    old = opt.state[p][k]
                    if old.shape != new.shape or old.dtype != new.dtype:
                        raise ValueError(f"optimizer state {k}: held {new.shape}/{new.dtype}, build {old.shape}")
                    opt.state[p][k] = new
    ts.step = held.step


def _assign(param: torch.Tensor, data: torch.Tensor) -> None:
    if param.shape != data.shape or param.dtype != data.dtype or param.device != data.device:
        raise ValueError(
            f"held tensor {tuple(data.shape)}/{data.dtype}/{data.device} does not fit "
            f"{tuple(param.shape)}/{param.dtype}/{param.device}"
        )
    param.data = data


def state_checksum(ts: TrainState) -> int:
    """An exact checksum of the state's bits: position-weighted integer sums of the raw words,
    accumulated on the device (int64, wrapping) with a single host sync."""
    total = None
    for i, t in enumerate(state_tensors(ts)):
        words = t.detach().contiguous().reshape(-1)
        words = words.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[words.element_size()])
        term = words.sum(dtype=torch.int64).to(words.device) * (i + 1)
        total = term if total is None else total + term.to(total.device)
    return 0 if total is None else int(total.item()) & ((1 << 62) - 1)
