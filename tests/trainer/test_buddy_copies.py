"""Host copies of optimizer shards kept by buddies (worker/buddy_copies.py), in real gloo processes.

Scenario (4 processes, buddies a ring 0->1->2->3->0, the ranks' shards of different shapes and
numbers, as at different model-parallel positions): refreshes of steps 1 and 2 finish; the one of
step 3 is started (in step 1's buffers) and, while in flight, the complete copy is still that
of step 2 (every rank's own snapshot and its ward's copy hold that step's values), step 3 is not
yet a copy and a second refresh is refused; asked without waiting (``poll``), it is done once its
transfers are; then steps 3 and 2 are kept and step 1 is gone (two generations); the next epoch's
copies refresh into those host buffers (``recycled``), not new ones, and while their first refresh
is in flight all ranks agree on the largest of their values (``agree``). Bad buddy
assignments are refused without processes.

Two processes on their own gloo pair links, as the training loop makes them: a ward that dies
with its refresh sent but unfinished leaves a copy its survivor salvages (complete, with the ward's
values); a refresh started once the ward is gone fails with an error the worker takes for a failed
collective, well within the links' timeout, is not salvaged, and the newest copy before it stays.

On a GPU (skipped elsewhere), the agreement of one rank over NCCL, and one asked to stop refused.
On two GPUs or more (skipped elsewhere), the first scenario again with the shards on the GPUs and
sent over NCCL, in chunks (the worker's transport on GPU), then five refreshes more that must leave
no GPU memory behind with the cyclic collector off; and a refresh whose ward is gone, ended
by aborting the communicators as the watchdog does: its empty receives are not taken for a copy.

Every process a test starts is waited for, and killed if it outlives the test.
"""

from __future__ import annotations

import pytest
import torch
from worker_harness import run_rank_scripts

from localcluster.cluster import free_port
from megatron_trainer.worker.buddy_copies import BuddyCopies, ward_of

GPUS = torch.cuda.device_count()

_DYING_WARD = r"""
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from megatron_trainer.worker.buddy_copies import BuddyCopies, exchange_links
from megatron_trainer.worker.collective_errors import is_collective_error

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
links = exchange_links(store, rank, 1 - rank, 1 - rank, datetime.timedelta(seconds=60))
copies = BuddyCopies(rank, 1 - rank, 1 - rank, links=links)
copies.start_refresh(1, [torch.full((64, 3), float(rank))])
copies.finish_refresh()
copies.start_refresh(2, [torch.full((64, 3), 10.0 + rank)])
if rank == 1:
    time.sleep(0.5)
    print("{}", flush=True)
    os._exit(0)  # gone with its refresh of step 2 sent, unfinished; its sockets close with it
time.sleep(1.5)
out = {"salvaged": copies.salvage(datetime.timedelta(seconds=0.25)), "after_salvage": copies.complete_steps()}
out["ward_copy_2"] = copies.ward_copy(2)[0][0, 0].item()
start = time.monotonic()
try:  # the ward is gone: this refresh cannot complete
    copies.start_refresh(3, [torch.full((64, 3), 20.0)])
    copies.finish_refresh()
    out["error"] = None
except RuntimeError as err:
    out["error"], out["collective"] = str(err)[:200], is_collective_error(err)
out["seconds"] = time.monotonic() - start
out["salvaged_3"] = copies.salvage(datetime.timedelta(seconds=0.25))
copies.abandon()
out["steps"] = copies.complete_steps()
print(json.dumps(out), flush=True)
"""

# Two ranks on two GPUs, each the other's buddy, with their copies.
_PAIR_ON_GPUS = r"""
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from megatron_trainer.worker.buddy_copies import BuddyCopies, exchange_links
from megatron_trainer.worker.settings import NCCL_DEFAULTS

rank, port = int(sys.argv[1]), int(sys.argv[2])
os.environ.update(NCCL_DEFAULTS)
device = torch.device("cuda", rank)
torch.cuda.set_device(device)
timeout = datetime.timedelta(seconds=60)
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
dist.init_process_group("nccl", store=store, rank=rank, world_size=2, timeout=timeout, device_id=device)
copies = BuddyCopies(rank, 1 - rank, 1 - rank, links=exchange_links(store, rank, 1 - rank, 1 - rank, timeout))
"""

_ABORTED_WARD = (
    _PAIR_ON_GPUS
    + r"""
from megatron_trainer.worker.abort import abort_communicators
for step in (1, 2):
    copies.start_refresh(step, [torch.full((64, 3), float(rank + step), device=device)])
    copies.finish_refresh()
if rank == 1:
    print("{}", flush=True)
    os._exit(0)  # gone before the refresh of step 3: nothing of it will ever come
copies.start_refresh(3, [torch.full((64, 3), 20.0, device=device)])
time.sleep(2)
out = {"done_before_abort": copies.poll()}
out["abort_seconds"] = abort_communicators()  # what the worker's watchdog does: the receives end, empty
out["salvaged"] = copies.salvage(datetime.timedelta(seconds=10))
try:
    copies.finish_refresh()
    out["error"] = None
except RuntimeError as err:
    out["error"] = str(err)[:200]
copies.abandon()
out["steps"] = copies.complete_steps()
out["ward_copy_2"] = copies.ward_copy(2)[0][0, 0].item()
print(json.dumps(out), flush=True)
os._exit(0)  # the aborted communicators are not destroyed
"""
)

_ASSEMBLED_BESIDE = (
    _PAIR_ON_GPUS
    + r"""
state = torch.zeros(1 << 20, 3, device=device)  # the optimizer's state, as the step leaves it
out = {}
for step in (1, 2, 3):
    torch.cuda._sleep(50_000_000)  # the step's last kernels, still running
    state.fill_(10 * rank + step)  # its update
    def assemble():
        torch.cuda._sleep(200_000_000)  # a slow read (on the side stream)
        return [state * 1.0]
    shards = copies.assemble(assemble, device)
    copies.hold_update(device)  # as the next step's update does
    state.fill_(-1.0)  # the next update: after the read, though queued while it runs
    copies.start_refresh(step, shards)
    copies.finish_refresh()
    out[step] = [copies.own(step)[0].unique().tolist(), copies.ward_copy(step)[0].unique().tolist()]
out["steps"] = copies.complete_steps()
copies.abandon()
print(json.dumps(out), flush=True)
"""
)

_RANK = r"""
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from megatron_trainer.worker.buddy_copies import BuddyCopies, ward_of

from megatron_trainer.worker import buddy_copies
from megatron_trainer.worker.buddy_copies import exchange_links
from megatron_trainer.worker.settings import NCCL_DEFAULTS

rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
backend = sys.argv[4] if len(sys.argv) > 4 else "gloo"
device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
timeout = datetime.timedelta(seconds=60)
store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
buddies = [(r + 1) % world for r in range(world)]
ward = ward_of(buddies)[rank]
if backend == "nccl":  # as a worker on GPU: the shards over NCCL, their shapes over gloo pair links
    buddy_copies.CHUNK_ELEMENTS = 16  # shards of several chunks, as many as their sizes make
    os.environ.update(NCCL_DEFAULTS)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, timeout=timeout, device_id=device)
    copies = BuddyCopies(rank, buddies[rank], ward, links=exchange_links(store, rank, buddies[rank], ward, timeout))
else:
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    copies = BuddyCopies(rank, buddies[rank], ward)

def shards(r, step, on=torch.device("cpu")):
    # Shapes and numbers of shards differ by rank, as at another model-parallel position.
    counting = torch.arange((7 + 2 * r) * 3, dtype=torch.float32).reshape(-1, 3) + r + step
    made = [torch.full((5 + r, 3), 100.0 * r + step), counting] + [torch.full((3, 3), -float(step))] * (r % 2)
    return [t.to(on) for t in made]

def equal(got, want):
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))

def holds(step):
    return equal(copies.own(step), shards(rank, step)) and equal(copies.ward_copy(step), shards(ward, step))

out = {}
for step in (1, 2):
    copies.start_refresh(step, shards(rank, step, device))
    copies.finish_refresh()
copies.start_refresh(3, shards(rank, 3, device))
out["in_flight_steps"] = copies.complete_steps()
out["in_flight_holds_2"] = holds(2)
try:
    copies.ward_copy(3)
    out["step_3_early"] = "given"
except KeyError:
    out["step_3_early"] = "refused"
try:
    copies.start_refresh(4, shards(rank, 4, device))
    out["second_refresh"] = "started"
except RuntimeError:
    out["second_refresh"] = "refused"
deadline = time.monotonic() + 60
while not copies.poll() and time.monotonic() < deadline:  # the training loop's look between refreshes
    time.sleep(0.01)
out["polled_done"] = not copies.in_flight
copies.finish_refresh()  # nothing in flight any more: returns at once
out["steps"] = copies.complete_steps()
out["holds_3_and_2"] = holds(3) and holds(2)
try:
    copies.own(1)
    out["step_1"] = "kept"
except KeyError:
    out["step_1"] = "gone"
# The next epoch's copies fill these host buffers (same shapes) instead of pinning new ones.
kept = {t.data_ptr() for own, theirs in copies.buffers() for t in (*own, *theirs)}
copies = BuddyCopies(rank, buddies[rank], ward, links=copies._links, recycled=copies.buffers())
copies.start_refresh(20, shards(rank, 20, device))
# The ranks agree on the largest of their values, a refresh in flight (on GPU queued after it).
out["agreed_the_largest"] = copies.agree(10 + rank, stop=lambda: False) == 10 + world - 1
copies.finish_refresh()
out["recycled"] = all(t.data_ptr() in kept for t in (*copies.own(20), *copies.ward_copy(20))) and holds(20)
if backend == "nccl":  # a refresh frees its GPU memory when it is done, not when a collector runs
    import gc

    def allocated():
        torch.cuda.synchronize()
        torch.empty(1, device=device)  # the allocator frees blocks whose streams are done at its next call
        return torch.cuda.memory_allocated()

    gc.disable()
    before = allocated()
    for step in range(21, 26):
        copies.start_refresh(step, shards(rank, step, device))
        copies.finish_refresh()
    out["gpu_bytes_kept"] = allocated() - before
    gc.enable()
dist.barrier()
dist.destroy_process_group()
print(json.dumps(out), flush=True)
"""


#: What every rank of the ``_RANK`` scenario reports, on either transport.
_EVERY_RANK_SEES = {
    "in_flight_steps": [2],
    "in_flight_holds_2": True,
    "step_3_early": "refused",
    "second_refresh": "refused",
    "polled_done": True,
    "steps": [3, 2],
    "holds_3_and_2": True,
    "step_1": "gone",
    "recycled": True,
    "agreed_the_largest": True,
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_refreshes_keep_two_complete_generations_and_the_previous_one_while_in_flight() -> None:
    world, port = 4, free_port()
    results = run_rank_scripts(_RANK, lambda r: [str(r), str(world), str(port)], world, timeout=240)
    for r in results:
        assert r == _EVERY_RANK_SEES


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA devices (a rank and its buddy); this machine has {GPUS}")
def test_on_gpus_the_shards_go_over_nccl_and_keep_the_same_generations() -> None:
    world, port = min(GPUS, 4), free_port()
    results = run_rank_scripts(_RANK, lambda r: [str(r), str(world), str(port), "nccl"], world, timeout=240)
    for r in results:
        assert r.pop("gpu_bytes_kept") == 0, "refreshes that were done still hold GPU memory"
        assert r == _EVERY_RANK_SEES


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA devices (a rank and its buddy); this machine has {GPUS}")
def test_on_gpus_a_refresh_ended_by_an_abort_is_not_taken_for_a_copy() -> None:
    port = free_port()
    result, gone = run_rank_scripts(_ABORTED_WARD, lambda r: [str(r), str(port)], 2, timeout=240)
    assert gone == {}
    assert result["done_before_abort"] is False
    # The aborted receives ended without data: the copy is refused, the newest whole one stands.
    assert result["salvaged"] is False and result["error"] is not None and "did not arrive whole" in result["error"]
    assert result["steps"] == [2] and result["ward_copy_2"] == 3.0


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA devices (a rank and its buddy); this machine has {GPUS}")
def test_on_gpus_the_shards_assembled_beside_the_step_are_the_steps_state() -> None:
    port = free_port()
    results = run_rank_scripts(_ASSEMBLED_BESIDE, lambda r: [str(r), str(port)], 2, timeout=240)
    for rank, r in enumerate(results):
        # The assembly read the update queued before it, not the one queued after it.
        for step in (1, 2, 3):
            assert r[str(step)] == [[10.0 * rank + step], [10.0 * (1 - rank) + step]], (rank, step, r)
        assert r["steps"] == [3, 2]


_AGREE_ON_ONE_GPU = r"""
import datetime, json, os, sys
import torch, torch.distributed as dist
from megatron_trainer.worker.buddy_copies import BuddyCopies
from megatron_trainer.worker.settings import NCCL_DEFAULTS

os.environ.update(NCCL_DEFAULTS)
device = torch.device("cuda", 0)
torch.cuda.set_device(device)
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, True, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
copies = BuddyCopies(0, 1, 1)  # agree() needs no buddy: the world's one rank
out = {"agreed": copies.agree(7, stop=lambda: False)}
try:
    copies.agree(3, stop=lambda: True)
    out["stopped"] = None
except RuntimeError as err:
    out["stopped"] = str(err)
dist.destroy_process_group()
print(json.dumps(out), flush=True)
"""


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(GPUS < 1, reason=f"needs a CUDA device; this machine has {GPUS}")
def test_on_a_gpu_the_agreement_is_an_all_reduce_on_the_side_stream_and_a_stop_refuses_it() -> None:
    [result] = run_rank_scripts(_AGREE_ON_ONE_GPU, lambda r: [str(free_port())], 1, timeout=240)
    assert result["agreed"] == 7
    # Asked to stop (a newer plan, an abort), whatever the collective left is not taken.
    assert result["stopped"] is not None and "agreeing on the refresh interval" in result["stopped"]


def test_bad_buddy_assignments_are_refused() -> None:
    assert ward_of([1, 2, 0]) == [2, 0, 1]
    with pytest.raises(ValueError, match="permutation"):
        ward_of([1, 1, 0])
    with pytest.raises(ValueError, match="own copy"):
        BuddyCopies(rank=0, buddy=0, ward=1)
    with pytest.raises(ValueError, match="two generations"):
        BuddyCopies(rank=0, buddy=1, ward=1, generations=1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_ward_lost_after_sending_is_salvaged_and_one_lost_before_fails_as_a_collective_does() -> None:
    port = free_port()
    result, gone = run_rank_scripts(_DYING_WARD, lambda r: [str(r), str(port)], 2, timeout=240)
    assert gone == {}
    assert result["salvaged"] and result["after_salvage"] == [2, 1] and result["ward_copy_2"] == 11.0
    assert result["error"] is not None, "a refresh with a dead ward completed"
    assert result["collective"], result["error"]
    assert result["seconds"] < 30, "the wait ran into the links' timeout instead of failing at once"
    # Step 1's buffers went to the refresh of step 3: the newest complete copy stands.
    assert not result["salvaged_3"] and result["steps"] == [2]
