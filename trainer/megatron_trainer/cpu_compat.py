"""CPU adaptations for megatron-core call sites that hard-require CUDA. Used only without a GPU.

megatron-core 0.19 assumes CUDA in about 35 places (RNG state, RoPE, DDP buffers, optimizer,
clip_grads, checkpoint savers, the MoE all-to-all dispatcher). Rather than fork them, this
module redirects the few ``torch.cuda`` entry points those call sites reach to their CPU
equivalents, and nothing else. Each shim names the call site that needs it. :func:`install` is
called once by the worker before it builds a model, and only when ``torch.cuda.is_available()`` is
false; on a GPU machine this module is never imported by the training path.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_installed = False


def _cpu_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    # megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed and
    # CudaRNGStatesTracker.add seed "the CUDA generator"; on CPU the CPU generator plays that role.
    torch.manual_seed(seed)


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` (DDP param/grad buffers, schedules' stream waits)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        return _NullEvent()


class _NullEvent:
    """Stands in for ``torch.cuda.Event`` (timers and stream ordering in schedules)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _null_stream_context(stream: Any = None) -> Iterator[None]:
    yield


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaToCpu(TorchFunctionMode):
    """Maps ``device="cuda"`` in tensor factories and ``Tensor.cuda()/.to("cuda")`` to the CPU.

    Call sites: optimizer/optimizer.py FP32Optimizer (``torch.tensor(..., device='cuda')``),
    optimizer/clip_grads.py (``torch.zeros(1, device='cuda')``, ``.cuda()`` on norms),
    distributed/param_and_grad_buffer.py (``device=torch.cuda.current_device()``).

    ``Tensor.type()`` names CPU tensors as their CUDA types: optimizer/distrib_optimizer.py
    (_build_model_and_main_param_groups) and optimizer.py accept only ``torch.cuda.*Tensor``
    parameters, and every ``.type()`` call in megatron-core compares with CUDA names.
    """

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name: str = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_device_mode: _CudaToCpu | None = None


def _clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float | torch.Tensor, use_decoupled_grad: bool = False
) -> None:
    """optimizer/clip_grads.py clip_grad_by_total_norm_fp32 asserts ``torch.cuda.FloatTensor``
    grads; same scaling, CPU tensors allowed."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if isinstance(clip_coeff, torch.Tensor):
        clip_coeff = clip_coeff.clamp_max(1.0)
        for g in grads:
            g.mul_(clip_coeff)
    elif clip_coeff < 1.0:
        for g in grads:
            g.mul_(clip_coeff)


def _splits_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """transformer/moe/token_dispatcher.py (MoEAlltoAllTokenDispatcher) moves the all-to-all split
    sizes to the host through moe_utils.maybe_move_tensor_to_cpu, which makes numpy arrays of CUDA
    tensors only; CPU tensors stay tensors, and all_to_all_single refuses a tensor as split sizes
    ("alltoall_base(): incompatible function arguments"). Same result as on GPU: numpy arrays."""
    if as_numpy and isinstance(tensor, torch.Tensor):
        return tensor.numpy()
    return tensor


# (where torch.cuda.<name> is reached, the CPU replacement). Only these names are replaced.
_TORCH_CUDA_SHIMS: dict[str, tuple[str, Callable[..., Any] | type]] = {
    "get_rng_state": ("tensor_parallel/random.py CudaRNGStatesTracker.add", _cpu_rng_state),
    "manual_seed": ("tensor_parallel/random.py model_parallel_cuda_manual_seed", _cpu_manual_seed),
    "current_device": ("models/common/embeddings/rotary_pos_embedding.py, DDP buffers, optimizer", lambda: "cpu"),
    "synchronize": ("dist_checkpointing savers, timers", lambda device=None: None),
    "current_stream": ("distributed/param_and_grad_buffer.py, schedules", lambda device=None: _NullStream()),
    "default_stream": ("pipeline_parallel/p2p_communication.py", lambda device=None: _NullStream()),
    "Stream": ("distributed/distributed_data_parallel.py communication stream", _NullStream),
    "Event": ("pipeline_parallel/schedules.py, timers", _NullEvent),
    "stream": ("distributed/param_and_grad_buffer.py", _null_stream_context),
}


def install() -> None:
    """Apply every shim; idempotent. Refuses to run where CUDA is available."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_compat is for machines without a GPU; a GPU is present")
    for name, (site, replacement) in _TORCH_CUDA_SHIMS.items():
        setattr(torch.cuda, name, replacement)
        log.debug("cpu_compat: torch.cuda.%s -> CPU (needed by %s)", name, site)
    from megatron.core.tensor_parallel import random as mcore_random

    # tensor_parallel/random.py CudaRNGStatesTracker.fork swaps "CUDA" RNG states through these.
    mcore_random._get_cuda_rng_state = _cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state
    # CudaRNGStatesTracker.fork warns when the CPU generator moves inside the fork; here the
    # "CUDA" generator is the CPU one, so attention dropout moves it every micro-batch, by design.
    logging.getLogger(mcore_random.__name__).addFilter(
        lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage()
    )
    from megatron.core.optimizer import optimizer as mcore_optimizer

    # optimizer/optimizer.py imported clip_grad_by_total_norm_fp32 by name; replace it there.
    mcore_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _splits_to_host
    global _device_mode
    _device_mode = _CudaToCpu()
    _device_mode.__enter__()  # stays active for the life of the worker process
    _installed = True
