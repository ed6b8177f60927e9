"""Shards moved between real gloo processes for a reshard (worker/reshard_exchange.py), on
megatron-core's layouts of two data-parallel sizes.

Scenarios, each checked element by element in every process (every state column of every
parameter element where the new layout puts it, padding zero):
- shrink, a pod lost: old DP 4 over processes that kept old ranks 0, 1 and 3; old rank 2's shard
  comes from the host copy its buddy (the process of old rank 3) keeps; new DP 3;
- grow: old DP 2, new DP 4; the two newcomers hold nothing and receive their whole shard;
- replacement, same DP 3: the spare takes the lost rank's shard from its buddy's copy, the
  survivors keep theirs (a local copy, no transfer);
- a process told to send a shard it does not hold refuses, before any transfer.

Shrink and grow run with the held shards laid out by row and, as the worker holds them, with each
column whole in memory; the new shard always has its columns apart.

Every process a test starts is waited for, and killed if it outlives the test.
"""

from __future__ import annotations

import json

import pytest
from worker_harness import run_rank_scripts

from localcluster.cluster import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: One process: build both layouts, hold what the scenario gives this process (the reference
#: shards, whose every value names its parameter element and column), exchange, check, print JSON.
_RANK = r"""
import datetime, json, sys
import torch, torch.distributed as dist
from megatron_trainer.worker.reshard import BufferLayout, reshard_transfers
from megatron_trainer.worker.reshard_exchange import exchange_shards

scenario, rank, world, port = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
numels, bucket_size, columns = [1000, 37, 4096, 5, 300, 64], 2000, 3
old = BufferLayout.of_megatron(numels, scenario["old_dp"], bucket_size)
new = BufferLayout.of_megatron(numels, scenario["new_dp"], bucket_size)

def reference(layout):
    # Buffer element -> a value unique to its parameter element (padding 0), one column per state tensor.
    values = torch.zeros(layout.buckets[-1][1], columns, dtype=torch.float64)
    first = 1
    for start, end in layout.params:
        ids = torch.arange(first, first + end - start, dtype=torch.float64)
        values[start:end] = torch.stack([ids + 0.25 * c for c in range(columns)], dim=1)
        first += end - start
    return values

def shard_of(layout, values, r):
    return torch.cat([values[s:e] for s, e in layout.shard(r)])

store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
old_values = reference(old)
held = {int(r): shard_of(old, old_values, int(r)) for r in scenario["held"][str(rank)]}
if scenario.get("columns_apart"):  # as the worker holds them: each column whole in memory
    held = {r: t.t().contiguous().t() for r, t in held.items()}
try:
    got = exchange_shards(
        reshard_transfers(old, new), old, new, held, scenario["holder_of_old"], scenario["process_of_new"], rank,
        columns=columns, dtype=torch.float64,
    )
except ValueError as err:
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "refused": str(err)}), flush=True)
    sys.exit(0)
mine = [r for r, p in enumerate(scenario["process_of_new"]) if p == rank]
expected = shard_of(new, reference(new), mine[0]) if mine else None
ok = (got is None and expected is None) or (got is not None and torch.equal(got, expected))
dist.barrier()
dist.destroy_process_group()
apart = got is None or got.t().is_contiguous()  # the new shard's columns lie apart too
print(json.dumps({"rank": rank, "ok": ok and apart, "rows": 0 if got is None else got.shape[0]}), flush=True)
"""


def _run(scenario: dict[str, object], world: int) -> list[dict[str, object]]:
    port = free_port()
    results = run_rank_scripts(
        _RANK, lambda r: [json.dumps(scenario), str(r), str(world), str(port)], world, timeout=240
    )
    return results


@pytest.mark.parametrize("columns_apart", [False, True], ids=["by-row", "columns-apart"])
def test_shrink_takes_the_lost_shard_from_its_buddys_copy(columns_apart: bool) -> None:
    # Processes 0, 1, 2 held old ranks 0, 1, 3; old rank 2 is gone, its copy is on process 2.
    scenario = {
        "old_dp": 4,
        "new_dp": 3,
        "held": {"0": [0], "1": [1], "2": [3, 2]},
        "holder_of_old": [0, 1, 2, 2],
        "process_of_new": [0, 1, 2],
        "columns_apart": columns_apart,
    }
    results = _run(scenario, 3)
    assert all(r["ok"] for r in results), results


@pytest.mark.parametrize("columns_apart", [False, True], ids=["by-row", "columns-apart"])
def test_grow_fills_the_newcomers(columns_apart: bool) -> None:
    scenario = {"old_dp": 2, "new_dp": 4, "held": {"0": [0], "1": [1], "2": [], "3": []}}
    scenario |= {"holder_of_old": [0, 1], "process_of_new": [0, 1, 2, 3], "columns_apart": columns_apart}
    results = _run(scenario, 4)
    assert all(r["ok"] for r in results) and all(r["rows"] > 0 for r in results), results


def test_a_spare_takes_the_lost_shard_from_the_buddy_and_survivors_keep_theirs() -> None:
    # Old rank 2's process is gone; process 0 (its buddy) keeps its copy; process 2 is the spare.
    scenario = {
        "old_dp": 3,
        "new_dp": 3,
        "held": {"0": [0, 2], "1": [1], "2": []},
        "holder_of_old": [0, 1, 0],
        "process_of_new": [0, 1, 2],
    }
    results = _run(scenario, 3)
    assert all(r["ok"] for r in results), results


def test_a_process_without_the_shard_it_should_send_refuses() -> None:
    scenario = {"old_dp": 2, "new_dp": 2, "held": {"0": [], "1": [1]}, "holder_of_old": [0, 1]}
    scenario |= {"process_of_new": [0, 1]}
    results = _run(scenario, 2)
    refused = [r for r in results if "refused" in r]
    assert [r["rank"] for r in refused] == [0] and "old shard 0" in str(refused[0]["refused"])
    assert results[1]["ok"]  # the other one kept its own shard: nothing to receive
