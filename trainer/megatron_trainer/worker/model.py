"""Build the Megatron-Core GPT, its DDP wrapper, Megatron's optimizer and its learning-rate
scheduler for the current groups, and move model/optimizer/scheduler state between builds.

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

from megatron_contract.job import Activation, MegatronJobSpec, PositionEmbedding, Precision
from megatron_trainer.worker import providers
from megatron_trainer.worker.optimizer_shards import ShardPieces, shard_pieces

# Optimizer state entries of Adam, in the canonical order used by transfer and checksums.
_ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


@dataclasses.dataclass
class TrainState:
    """What one rank trains: the DDP-wrapped model and Megatron's optimizer."""

    model: Any  # megatron.core.distributed.DistributedDataParallel wrapping a GPTModel
    optimizer: Any  # megatron.core.optimizer.MegatronOptimizer (ChainedOptimizer)
    config: Any  # megatron.core.transformer.TransformerConfig
    scheduler: Any  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler
    spec: MegatronJobSpec
    forward_step: Any  # the job's forward_step(data_iterator, model), see worker/providers.py
    step: int = 0  # steps completed by this state
    build_seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # per build stage
    # The optimizer's update of step ``step`` began and did not end: the state is of no step. The
    # distributed optimizer's update ends with a collective (the parameters' all-gather), which a
    # dead peer fails after this rank's shard was written (worker/step.py:guard_commit).
    torn: bool = False


@dataclasses.dataclass
class HeldState:
    """State tensors detached from a build: they reference no process group."""

    tensors: list[torch.Tensor]
    step: int
    scheduler_steps: int  # OptimizerParamScheduler.num_steps
    # With the distributed optimizer: where its shard lies in ``tensors`` (views, no copy), for a
    # reshard or a restore that moves shards (worker/shard_restore.py), and the rank it belonged to.
    shards: list[ShardPieces] | None = None
    rank: int | None = None
    torn: bool = False  # TrainState.torn: its shard is past ``step`` and its parameters half gathered


def param_dtype(spec: MegatronJobSpec, device: torch.device) -> torch.dtype:
    """bf16 on GPU when asked for (fp8 computes in fp8 with bf16 parameters); CPU runs always use fp32."""
    if device.type == "cuda" and spec.training.precision in (Precision.BF16, Precision.FP8):
        return torch.bfloat16
    return torch.float32


def has_transformer_engine() -> bool:
    """Whether Transformer Engine is importable in this image."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def has_apex() -> bool:
    """Whether Apex is importable (megatron-core's fused norms for the local layer spec)."""
    try:
        import apex  # noqa: F401
    except ImportError:
        return False
    return True


def check_supported(spec: MegatronJobSpec, device: torch.device) -> None:
    """Refuse, with a message naming the field, what this image or device cannot train."""
    if spec.model.sequence_parallel and not (has_transformer_engine() or has_apex()):
        # Without either, megatron-core's local layer spec falls back to torch norms, which assert
        # "sequence parallel not supported by torch LayerNorm" when the model is built.
        raise ValueError(
            "spec.model.sequenceParallel needs Transformer Engine or Apex, which this trainer image does not have "
            "(megatron-core's torch norms refuse it); so does spec.model.numExperts with spec.tp > 1"
        )
    if spec.training.precision is Precision.FP8:
        if not has_transformer_engine():
            raise ValueError(
                "spec.training.precision fp8 needs Transformer Engine, which this trainer image does not have; "
                "use bf16 or an image with transformer_engine"
            )
        if device.type != "cuda":
            raise ValueError("spec.training.precision fp8 needs a GPU")


def transformer_config(spec: MegatronJobSpec, device: torch.device, initialize: bool) -> Any:
    """Megatron-Core's TransformerConfig for the job on the current process groups."""
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    m = spec.model
    dtype = param_dtype(spec, device)
    fp8 = spec.training.precision is Precision.FP8 and device.type == "cuda"
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        kv_channels=m.kv_channels,
        ffn_hidden_size=m.ffn_size,
        activation_func=F.silu if m.activation is Activation.SWIGLU else F.gelu,
        gated_linear_unit=m.activation is Activation.SWIGLU,
        normalization=m.normalization.value,
        layernorm_epsilon=m.layernorm_epsilon,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        init_method_std=m.init_method_std,
        # Dropout masks are drawn from generators reseeded per micro-batch from the samples it
        # holds (seed_dropout), so a resumed step draws exactly what the uninterrupted run drew.
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        sequence_parallel=m.sequence_parallel,
        num_moe_experts=m.num_experts,
        moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size if m.num_experts else None,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        moe_grouped_gemm=False,  # grouped GEMM needs Transformer Engine or nv-grouped-gemm
        moe_token_dispatcher_type=m.moe_token_dispatcher_type.value,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=initialize,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp8="hybrid" if fp8 else None,
        pipeline_dtype=dtype,
        # Loss is summed per token and divided by the global token count in finalize_model_grads,
        # so uneven micro-batches per replica (after a shrink) still give the global-batch mean.
        calculate_per_token_loss=True,
    )


def build_gpt(spec: MegatronJobSpec, config: Any, pre_process: bool = True, post_process: bool = True) -> Any:
    """The GPTModel of ``spec.model`` (the layer spec of Transformer Engine where installed)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    m = spec.model
    # Tied embeddings across pipeline stages would need Megatron's embedding group; untied there.
    tied = not m.untie_embeddings_and_output_weights and parallel_state.get_pipeline_model_parallel_world_size() == 1
    return GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(spec),
        vocab_size=m.vocab_size,
        max_sequence_length=m.max_positions,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope" if m.position_embedding is PositionEmbedding.ROPE else "learned_absolute",
        rotary_percent=m.rotary_percent,
        rotary_base=m.rotary_base,
    )


def build_scheduler(spec: MegatronJobSpec, optimizer: Any) -> Any:
    """Megatron-Core's OptimizerParamScheduler for ``spec.training`` (stepped once per training step)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = spec.training
    s = t.lr_schedule
    wd = t.optimizer.weight_decay
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=s.min_lr,
        lr_warmup_steps=s.warmup_steps,
        lr_decay_steps=t.decay_steps,
        lr_decay_style=s.decay_style.value,
        start_wd=wd,
        end_wd=wd,
        wd_incr_steps=t.train_iters,
        wd_incr_style="constant",
        wsd_decay_steps=s.wsd_decay_steps,
        lr_wsd_decay_style="linear",
    )


def set_scheduler_steps(ts: TrainState, steps: int) -> None:
    """Put the scheduler at ``steps`` and apply its learning rate and weight decay to the optimizer."""
    ts.scheduler.num_steps = 0
    ts.scheduler.step(steps)


def seed_dropout(spec: MegatronJobSpec, first_sample: int) -> None:
    """Reseed Megatron's generators (default, tensor- and expert-parallel) for the micro-batch whose
    first global sample is ``first_sample``: dropout masks become a function of the data position,
    which travels with the step, so every recovery redraws exactly the masks of the failure-free run."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    seed = (spec.training.seed * 1_000_003 + first_sample * 7919 + 100 * pp_rank) % (1 << 62)
    model_parallel_cuda_manual_seed(seed)


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
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    check_supported(spec, device)
    dtype = param_dtype(spec, device)
    distributed = spec.training.optimizer.distributed
    # Seeds the model-parallel RNG tracker for this epoch's tp rank (attention needs it to exist).
    model_parallel_cuda_manual_seed(spec.training.seed, force_reset_rng=True)
    config = transformer_config(spec, device, initialize)
    marks = [("start", time.perf_counter())]
    # The job's model provider: the GPT of spec.model unless the job brings its own.
    gpt = providers.model_provider(spec)(
        parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage(), config=config, spec=spec
    )
    if device.type == "cuda":
        gpt.cuda(device)
    marks.append(("model", _synced(device)))
    module: Any = gpt
    if config.bf16:
        from megatron.core.transformer.module import Float16Module

        module = Float16Module(config, gpt)  # casts inputs to bf16 and the loss back to fp32
    model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed),
        module,
    )
    marks.append(("ddp", _synced(device)))
    if before_collectives is not None:
        before_collectives()
        marks.append(("connect_wait", time.perf_counter()))
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    o = spec.training.optimizer
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=spec.training.lr,
            min_lr=spec.training.lr_schedule.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            use_distributed_optimizer=distributed,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
        ),
        [model],
        use_gloo_process_groups=False,  # gloo side groups cost a TCP mesh per epoch; not needed here
    )
    marks.append(("optimizer", _synced(device)))
    _init_optimizer_state(optimizer)
    scheduler = build_scheduler(spec, optimizer)
    marks.append(("optimizer_state", _synced(device)))
    times = {name: t - marks[i][1] for i, (name, t) in enumerate(marks[1:])}
    return TrainState(
        model=model,
        optimizer=optimizer,
        config=config,
        scheduler=scheduler,
        spec=spec,
        forward_step=providers.forward_step(spec),
        build_seconds=times,
    )


def _synced(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _layer_spec(spec: MegatronJobSpec) -> Any:
    # The TE spec where Transformer Engine is installed, Megatron's local spec otherwise.
    from megatron.core.models.gpt import gpt_layer_specs

    m = spec.model
    if has_transformer_engine():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=m.num_experts, qk_layernorm=m.qk_layernorm
        )
    return gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=m.num_experts, qk_layernorm=m.qk_layernorm, normalization=m.normalization.value
    )


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside Megatron's (possibly chained) optimizer, in order."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [c.optimizer for c in chained]


def _init_optimizer_state(optimizer: Any) -> None:
    """Create Adam's state up front (torch creates it lazily at the first step), so every build,
    fresh or warm, has the same tensors to transfer, compare and checksum."""
    for opt in inner_optimizers(optimizer):
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
    for opt in inner_optimizers(ts.optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                out.append(p.data)
                out.extend(opt.state[p][k] for k in _ADAM_KEYS)
    return out


def detach_state(ts: TrainState, rank: int | None = None) -> HeldState:
    """Take the state tensors out of a build that is about to be dropped (``rank``: the rank it
    trained as)."""
    shards = shard_pieces(ts.optimizer) if ts.spec.training.optimizer.distributed else None
    return HeldState(
        tensors=list(state_tensors(ts)),
        step=ts.step,
        scheduler_steps=ts.scheduler.num_steps,
        shards=shards,
        rank=rank,
        torn=ts.torn,
    )


def adopt_state(ts: TrainState, held: HeldState) -> None:
    """Point a fresh build at held state tensors (no copy; the parameters are copied into the build's
    buffer with the distributed optimizer); shapes must match exactly."""
    params = list(ts.model.module.parameters())
    expected = len(params) + sum(
        len(g["params"]) * (1 + len(_ADAM_KEYS)) for o in inner_optimizers(ts.optimizer) for g in o.param_groups
    )
    if expected != len(held.tensors):
        raise ValueError(f"held state has {len(held.tensors)} tensors, the new build needs {expected}")
    it = iter(held.tensors)
    # With the distributed optimizer the parameters are views of DDP's parameter buffer, which the
    # optimizer's all-gather fills after every step: pointing them elsewhere would leave each data-
    # parallel rank training on its own shard's updates only. Their values are copied in instead.
    in_buffer = ts.spec.training.optimizer.distributed
    for p in params:
        _assign(p, next(it), copy=in_buffer)
    for opt in inner_optimizers(ts.optimizer):
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
    set_scheduler_steps(ts, held.scheduler_steps)


@torch.no_grad()
def _assign(param: torch.Tensor, data: torch.Tensor, copy: bool = False) -> None:
    if param.shape != data.shape or param.dtype != data.dtype or param.device != data.device:
        raise ValueError(
            f"held tensor {tuple(data.shape)}/{data.dtype}/{data.device} does not fit "
            f"{tuple(param.shape)}/{param.dtype}/{param.device}"
        )
    if copy:
        param.data.copy_(data)
    else:
        param.data = data


def replicated_state_tensors(ts: TrainState) -> list[torch.Tensor]:
    """The state every rank of a data-parallel group holds identically: all of it with the plain
    optimizer, the model's parameters with the distributed one (its optimizer state is sharded)."""
    if ts.spec.training.optimizer.distributed:
        return [p.data for p in ts.model.module.parameters()]
    return state_tensors(ts)


def state_checksum(ts: TrainState) -> int:
    """An exact checksum of the bits of the replicated state: position-weighted integer sums of the
    raw words, accumulated on the device (int64, wrapping) with a single host sync."""
    total = None
    for i, t in enumerate(replicated_state_tensors(ts)):
        words = t.detach().contiguous().reshape(-1)
        words = words.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[words.element_size()])
        term = words.sum(dtype=torch.int64).to(words.device) * (i + 1)
        total = term if total is None else total + term.to(total.device)
    return 0 if total is None else int(total.item()) & ((1 << 62) - 1)
