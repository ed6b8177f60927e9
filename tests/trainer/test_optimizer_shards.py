"""A real Megatron distributed optimizer's shards held flat and resharded in memory
(worker/optimizer_shards.py, worker/reshard.py, worker/reshard_exchange.py), in real gloo processes
building the trainer's own model, DDP and optimizer on CPU.

Scenario: DP 2 (two processes) gives every element of every parameter's main copy and Adam
moments a value naming it, checks that the flat shards hold them where ``BufferLayout`` says (and
that the layout recomputed from parameter sizes is the live one), and keeps the flat shards as
host copies. Then DP 3 (three processes): old rank 1's process is gone, its copy is kept by
process 2 (its buddy); the new layout's shards are exchanged point to point and loaded into the
new optimizer, and every parameter element's main copy and moments are the values it had. Every
process a test starts is waited for, and killed if it outlives the test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from worker_harness import make_spec, run_rank_scripts

from localcluster.cluster import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

_RANK = r"""
import datetime, json, sys
import torch, torch.distributed as dist
from megatron_trainer import cpu_compat
cpu_compat.install()
from megatron.core import parallel_state
from megatron_contract.job import MegatronJobSpec
from megatron_trainer.worker.model import build_train_state
from megatron_trainer.worker.optimizer_shards import (
    STATE_KEYS, buffer_layouts, distributed_optimizers, flat_shards, load_flat_shards,
)
from megatron_trainer.worker.reshard import BufferLayout, reshard_transfers
from megatron_trainer.worker.reshard_exchange import exchange_shards

phase, rank, world, port, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
spec = MegatronJobSpec.model_validate(json.loads(sys.argv[6]))
store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
ts = build_train_state(spec, torch.device("cpu"), initialize=True)
[opt] = distributed_optimizers(ts.optimizer)

def value(index, element, column):
    # Exact in fp32: below 2**22, quarters.
    return float(index * 16384 + element) + 0.25 * column

def pieces():
    # (buffer, parameter index in the buffer, parameter, its sub-range in this rank's shard)
    for b, (buffer, ranges) in enumerate(zip(opt.buffers, opt.gbuf_ranges)):
        order = {p: i for i, p in enumerate(buffer.params)}
        for _, buckets in ranges.items():
            for bucket in buckets:
                for param, r in bucket["param_map"].items():
                    assert param.numel() < 16384
                    yield b, order[param], param, r["param"]

def expected(index, sub, columns):
    element = torch.arange(sub.start, sub.end, dtype=torch.float64)
    return [(index * 16384 + element + 0.25 * c).float() for c in range(columns)]

checked = 0
if phase == "old":
    for b, index, param, sub in pieces():
        current = opt._get_main_param_and_optimizer_states(param)
        values = expected(index, sub, 1 + len(STATE_KEYS))
        with torch.no_grad():
            opt._set_main_param_and_optimizer_states(
                param, current | {k: v.reshape(current[k].shape) for k, v in zip(["param", *STATE_KEYS], values)}
            )
    shards = flat_shards(ts.optimizer)
    for layout, buffer in zip(buffer_layouts(ts.optimizer), opt.buffers):
        assert layout == BufferLayout.of_buffer_for_dp(buffer, layout.dp, ts.model.bucket_size), "layout differs"
    for b, index, param, sub in pieces():
        layout = buffer_layouts(ts.optimizer)[b]
        start = opt.buffers[b].param_index_map[param][0] + sub.start
        row = layout.local_offset(parallel_state.get_data_parallel_rank(), start)
        for c, want in enumerate(expected(index, sub, 3)):
            assert torch.equal(shards[b][row : row + sub.end - sub.start, c], want), (b, index, c)
            checked += 1
    torch.save(shards, f"{workdir}/old-{rank}.pt")
else:
    scenario = json.loads(sys.argv[7])
    held_files = {int(k): v for k, v in scenario["held"][str(rank)].items()}
    loaded = {old_rank: torch.load(f"{workdir}/{name}") for old_rank, name in held_files.items()}
    new_shards = []
    for b, buffer in enumerate(opt.buffers):
        old = BufferLayout.of_buffer_for_dp(buffer, scenario["old_dp"], ts.model.bucket_size)
        new = BufferLayout.of_buffer(buffer)
        got = exchange_shards(
            reshard_transfers(old, new), old, new, {r: s[b] for r, s in loaded.items()},
            scenario["holder_of_old"], list(range(world)), rank, columns=1 + len(STATE_KEYS),
        )
        new_shards.append(got)
    load_flat_shards(ts.optimizer, new_shards)
    for b, index, param, sub in pieces():
        current = opt._get_main_param_and_optimizer_states(param)
        for c, key in enumerate(["param", *STATE_KEYS]):
            assert torch.equal(current[key].reshape(-1), expected(index, sub, 3)[c]), (b, index, key)
            checked += 1
dist.barrier()
dist.destroy_process_group()
print(json.dumps({"rank": rank, "checked": checked}), flush=True)
"""


def _run(phase: str, world: int, workdir: Path, spec: str, scenario: str = "{}") -> list[dict[str, int]]:
    port = free_port()
    return run_rank_scripts(
        _RANK, lambda r: [phase, str(r), str(world), str(port), str(workdir), spec, scenario], world, timeout=400
    )


def test_a_lost_ranks_shard_is_resharded_from_its_buddys_copy_into_the_new_optimizer(tmp_path: Path) -> None:
    wire = make_spec(tp=1, gpus_per_pod=1).to_wire()
    wire["training"]["optimizer"]["distributed"] = True
    wire["checkpoint"] = {"path": str(tmp_path / "ckpt")}
    spec_json = json.dumps(wire)
    old = _run("old", 2, tmp_path, spec_json)
    assert all(r["checked"] > 0 for r in old), old
    # Old rank 1's process is gone; process 2 keeps its copy; process 1 is new and holds nothing.
    scenario = {"old_dp": 2, "holder_of_old": [0, 2], "held": {"0": {"0": "old-0.pt"}, "1": {}, "2": {"1": "old-1.pt"}}}
    new = _run("new", 3, tmp_path, spec_json, json.dumps(scenario))
    assert all(r["checked"] > 0 for r in new), new
