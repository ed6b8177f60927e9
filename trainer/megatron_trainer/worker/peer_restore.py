"""Restore state by broadcast from a data-parallel peer with the same tp/cp/pp coordinates.

Every rank of a data-parallel group takes part; for each distinct source named by the plan for
that group, the source's state tensors are broadcast in place over the epoch's DP group. Ranks that
already hold the state (kind ``self``) hold the same bits as the source, so the broadcast changes
nothing for them. Device-resident tensors go as they are; host scalars (Adam's ``step``) are packed
into one device tensor because NCCL cannot send host memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_contract.mesh import MeshPlan, StateSourceKind
from megatron_trainer.worker.model import TrainState, state_tensors
from megatron_trainer.worker.rendezvous import replica_group


def unique_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Drop repeats (with fp32 params the optimizer's main param is the model param itself)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def peer_sources(plan: MeshPlan, group_ranks: list[int]) -> list[int]:
    """Global ranks that must send to their DP group (sorted, so every member agrees)."""
    sources = {plan.source_of(r).peer_rank for r in group_ranks if plan.source_of(r).kind is StateSourceKind.PEER}
    return sorted(s for s in sources if s is not None)


def restore_from_peers(ts: TrainState, plan: MeshPlan, device: torch.device) -> int:
    """Run the broadcasts this rank's DP group needs; returns bytes received or sent per source."""
    group = replica_group()
    sources = peer_sources(plan, dist.get_process_group_ranks(group))
    if not sources:
        return 0
    tensors = unique_tensors(state_tensors(ts))
    on_device = [t for t in tensors if t.device == device]
    on_host = [t for t in tensors if t.device != device]
    moved = 0
    for src in sources:
        for t in on_device:
            dist.broadcast(t, src=src, group=group)
        packed = torch.cat([t.reshape(-1).to(torch.float64) for t in on_host] + [torch.tensor([float(ts.step)])])
        packed = packed.to(device)
        dist.broadcast(packed, src=src, group=group)
        packed = packed.cpu()
        offset = 0
        for t in on_host:
            n = t.numel()
            t.copy_(packed[offset : offset + n].reshape(t.shape).to(t.dtype))
            offset += n
        ts.step = int(packed[offset].item())
        moved = sum(t.numel() * t.element_size() for t in tensors)
    return moved
