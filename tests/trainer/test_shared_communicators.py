"""Megatron's groups of the same ranks share one communicator (``rendezvous.share_communicators``):
which groups share, and that every collective on a shared group still reduces over its own ranks.
Real torch.distributed processes on gloo; the worker's recovery tests run it inside every epoch.
And NCCL's one-time warm-up in a worker's start (``rendezvous.warm_up_nccl``), on a GPU."""

from __future__ import annotations

import pytest
import torch
from worker_harness import run_rank_scripts

from localcluster.cluster import free_port

_RANK = r"""
import json, sys
import torch, torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron_trainer.worker.rendezvous import communicator_groups, replica_group, share_communicators

rank, world, tp, pp, port = (int(a) for a in sys.argv[1:])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                             create_gloo_process_groups=False)
def layout():
    groups = {"dp": ps.get_data_parallel_group(), "mp": ps.get_model_parallel_group(),
              "tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group()}
    ranks = {name: dist.get_process_group_ranks(g) for name, g in groups.items()}
    return {**ranks, "dp_rank": ps.get_data_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank()}

before = layout()
shared = share_communicators()
after = layout()
sums = {}
for name, group in (("dp", ps.get_data_parallel_group()), ("mp", ps.get_model_parallel_group()),
                    ("pp", ps.get_pipeline_model_parallel_group())):
    t = torch.tensor([float(1 << rank)])
    dist.all_reduce(t, group=group)
    sums[name] = int(t.item())
print(json.dumps({
    "shared": shared, "same": before == after, "sums": sums, "groups": len(communicator_groups()),
    "dp_is_world": replica_group() is dist.group.WORLD,
    "replica_is_ddps": replica_group() is ps.get_data_parallel_group(with_context_parallel=True),
    "mp_is_pp": ps.get_model_parallel_group() is ps.get_pipeline_model_parallel_group(),
}))
ps.destroy_model_parallel()
dist.destroy_process_group()
"""


def _bits(ranks: list[int]) -> int:
    return sum(1 << r for r in ranks)


@pytest.mark.timeout(300)
def test_with_tp_1_the_replica_group_is_the_world_and_the_model_group_the_pipeline_group() -> None:
    world, port = 2, free_port()
    results = run_rank_scripts(_RANK, lambda r: [str(r), str(world), "1", "1", str(port)], world, 240)
    for rank, r in enumerate(results):
        assert r["same"], "sharing changed a group's ranks or a rank's number"
        assert r["dp_is_world"] and r["mp_is_pp"]
        assert r["replica_is_ddps"], "with CP 1 the trainer's replica group is not the one DDP uses"
        assert r["shared"]["_DATA_PARALLEL_GROUP"] == "WORLD"
        # Two communicators an epoch instead of four: the world and the rank's own.
        assert r["groups"] == 2
        assert r["sums"] == {"dp": 0b11, "mp": 1 << rank, "pp": 1 << rank}


@pytest.mark.timeout(300)
def test_with_tp_2_the_groups_that_differ_keep_their_own() -> None:
    world, port = 4, free_port()
    results = run_rank_scripts(_RANK, lambda r: [str(r), str(world), "2", "1", str(port)], world, 240)
    for rank, r in enumerate(results):
        assert r["same"]
        assert not r["dp_is_world"] and r["mp_is_pp"] is False
        assert r["replica_is_ddps"]
        assert "_DATA_PARALLEL_GROUP" not in r["shared"]
        tp = [rank - rank % 2, rank - rank % 2 + 1]
        dp = [rank % 2, rank % 2 + 2]
        # With PP 1 the model-parallel group is the tensor-parallel group.
        assert r["sums"] == {"dp": _bits(dp), "mp": _bits(tp), "pp": 1 << rank}
        assert r["groups"] == 4  # world, replica, model (= tensor) and pipeline


_WARM_UP = r"""
import json
import torch, torch.distributed as dist
from megatron_trainer.worker.rendezvous import warm_up_nccl

seconds = warm_up_nccl(torch.device("cuda", 0))
# The spare holds no group afterwards, and NCCL still serves the next communicator.
pg = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1, dist.ProcessGroupNCCL.Options())
t = torch.full((4,), 3.0, device="cuda")
pg.allreduce([t]).wait()
torch.cuda.synchronize()
pg.shutdown()
print(json.dumps({"seconds": seconds, "initialized": dist.is_initialized(), "sum": t.tolist()}))
"""


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the warm-up runs on GPU workers)")
def test_the_nccl_warm_up_leaves_no_group_and_nccl_usable() -> None:
    (result,) = run_rank_scripts(_WARM_UP, lambda r: [], 1, 150)
    assert result["seconds"] > 0
    assert result["initialized"] is False
    assert result["sum"] == [3.0] * 4
