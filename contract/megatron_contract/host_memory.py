"""Host memory a trainer pod needs for the distributed optimizer's buddy copies, and what it requests.

With ``spec.training.optimizer.distributed`` every rank keeps, in host memory, two generations of
(its own shard snapshot + the copy of its ward's shard), so that a refresh in flight never spoils
the previous complete copy (``megatron_trainer.worker.buddy_copies``). A shard is flat rows of fp32
main parameter, ``exp_avg`` and ``exp_avg_sq``: 12 bytes per element of the rank's slice of every
optimizer buffer (``megatron_trainer.worker.optimizer_shards``). Megatron lays a buffer out with
every parameter start aligned to 64 elements and its end padded to a multiple of lcm(D, 128), D
the ranks it is sharded over: dp*cp for the dense buffer, dp*cp/ep for the experts' (their own
buffer only with ep > 1) (``megatron_trainer.worker.reshard``). With the trainer's DDP settings (no overlapped gradient
reduction) each buffer is one bucket; the sizes here bound that padding from above.

The operator compares the pod's memory request with this need and says so in the job's
``HostMemoryShort`` condition. It warns rather than refuses at admission, though a CEL rule could
(Kubernetes v1.33, the local API server, accepts ``quantity(...).asInteger() >= <int arithmetic>``
in a CRD rule): the operator asks for no copies until the trainers restore from them, so a refusal
would turn away jobs that train today; a memory request is not a limit (the container may use more); the need depends on
the data-parallel size the elastic job runs at; and the rule would restate this arithmetic
(presets, MoE, tp/pp splits, padding) in a second language.
"""

from __future__ import annotations

import dataclasses
import math
import re
from decimal import Decimal

from megatron_contract.job import MegatronJobSpec
from megatron_contract.parameters import rank_parameters
from megatron_contract.pod_template import Quantity

#: Bytes of optimizer state per parameter element in a host copy: fp32 main parameter and Adam's two moments.
ADAM_BYTES_PER_ELEMENT = 12
#: Generations of copies a rank keeps: the previous complete one survives a refresh in flight.
BUDDY_GENERATIONS = 2
_PARAM_ALIGN = 64  # megatron-core's pad_param_start
_BUCKET_ALIGN = 128  # megatron-core's bucket_end_divisor: lcm(D, 128)


def shard_elements(tensors: tuple[int, ...], shards: int, buffers: int = 1) -> int:
    """Elements of one rank's shard of the ``buffers`` buffer(s) holding ``tensors``, split over
    ``shards`` ranks: at most this many (each start's 64-element alignment and each buffer's end
    padding taken at their worst)."""
    if not tensors:
        return 0
    unaligned = sum(tensors) + (_PARAM_ALIGN - 1) * (len(tensors) - 1)
    divisor = math.lcm(shards, _BUCKET_ALIGN)
    return (-(-unaligned // divisor) * divisor + (buffers - 1) * divisor) // shards


def rank_copy_bytes(spec: MegatronJobSpec, dp: int) -> int:
    """Host bytes of one rank's buddy copies at data-parallel size ``dp``, for the heaviest
    pipeline stage: generations x (own + ward's shard) x 12 bytes per shard element."""
    shards = dp * spec.cp
    heaviest = 0
    for stage in range(spec.pp):
        p = rank_parameters(spec.model, spec.tp, spec.pp, spec.ep, stage)
        # MoE routers are created in fp32 and may get a buffer of their own.
        dense = shard_elements(p.dense, shards, buffers=2 if spec.model.num_experts else 1)
        heaviest = max(heaviest, dense + shard_elements(p.expert, shards // spec.ep))
    return BUDDY_GENERATIONS * 2 * ADAM_BYTES_PER_ELEMENT * heaviest


def pod_copy_bytes(spec: MegatronJobSpec, dp: int) -> int:
    """Host bytes of a pod's buddy copies at data-parallel size ``dp``, at most: gpusPerPod ranks of
    the heaviest stage (a pod's ranks are of one stage unless it holds whole replicas)."""
    return spec.gpus_per_pod * rank_copy_bytes(spec, dp)


def smallest_dp_with_copies(spec: MegatronJobSpec) -> int | None:
    """The smallest data-parallel size the job may run at with buddy copies (two pods at least: one
    pod has no buddy), where each shard is largest; None when it never has two pods."""
    two_pods = 1 if spec.pods_per_replica > 1 else 2 * spec.replicas_per_pod
    unit = math.lcm(spec.ep, spec.replicas_per_pod)
    dp = -(-max(spec.min_replicas, two_pods) // unit) * unit
    return dp if dp <= spec.replicas else None


@dataclasses.dataclass(frozen=True)
class HostMemoryNeed:
    """What a job's pods need for buddy copies, and what its trainer container asks for."""

    dp: int  # the data-parallel size the need is stated for
    need: int  # bytes per pod
    request: int | None  # bytes: memory request of the trainer container (its limit when only that is set)


def host_memory_need(spec: MegatronJobSpec) -> HostMemoryNeed | None:
    """The job's host memory need for buddy copies at the smallest size it may run at with them;
    None without the distributed optimizer, with a model of its own (sizes unknown) or one pod."""
    if not spec.training.optimizer.distributed or spec.model.model_provider is not None:
        return None
    dp = smallest_dp_with_copies(spec)
    if dp is None:
        return None
    return HostMemoryNeed(dp, pod_copy_bytes(spec, dp), trainer_memory_request(spec))


def trainer_memory_request(spec: MegatronJobSpec) -> int | None:
    """Bytes of memory the trainer container requests, from where the operator takes its resources
    (the template's trainer container when it gives resources, else ``spec.resources``); without a
    request, its limit (Kubernetes defaults the request to it); None when neither is set."""
    trainer = spec.template.trainer() if spec.template is not None else None
    given = trainer.resources.to_wire() if trainer is not None and trainer.resources is not None else {}
    requests, limits = (
        (given.get("requests") or {}, given.get("limits") or {})
        if given
        else (spec.resources.requests, spec.resources.limits)
    )
    value = requests.get("memory", limits.get("memory"))
    return quantity_bytes(value) if value is not None else None


_SUFFIXES = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(1000) ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
    **{"m": Decimal("1e-3"), "u": Decimal("1e-6"), "n": Decimal("1e-9"), "": Decimal(1)},
}
# QUANTITY_PATTERN's grammar, with the number and the suffix (binary, decimal or an exponent) apart.
_QUANTITY = re.compile(r"^\+?(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)(?P<suffix>[KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$")


def quantity_bytes(value: Quantity) -> int:
    """A Kubernetes quantity ("64Gi", "1.5G", "2e9", 1000) in whole units, rounded up as Kubernetes
    rounds a memory quantity."""
    if isinstance(value, int):
        return value
    match = _QUANTITY.fullmatch(value)
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    number, suffix = Decimal(match["number"]), match["suffix"] or ""
    scale = _SUFFIXES[suffix] if suffix in _SUFFIXES else Decimal(f"1{suffix}")  # 1e9, 1E-3
    return math.ceil(number * scale)
