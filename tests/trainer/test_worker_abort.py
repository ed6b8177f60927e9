"""The worker's group teardown against real torch.distributed (gloo, one process).

``forget_process_groups`` clears torch's group registry by hand (private names of torch 2.11,
worker/abort.py); these tests fail if torch moves them: after forgetting, torch and Megatron see no
groups, and a new world can be built on a new store and run a collective, twice over.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_trainer.worker import abort


def _join(store: dist.Store) -> None:
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    parallel_state.initialize_model_parallel(create_gloo_process_groups=False)


def test_forgotten_groups_leave_no_trace_and_a_new_world_works() -> None:
    from megatron.core import parallel_state

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        for epoch in (1, 2, 3):
            _join(dist.PrefixStore(f"epoch-{epoch}/", server))
            assert len(dist.distributed_c10d._world.pg_map) > 1  # world plus Megatron's groups
            t = torch.ones(3)
            dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
            assert t.tolist() == [1.0, 1.0, 1.0]

            started = abort.start_abort()
            assert started is abort.start_abort()  # once per world, from any thread
            assert started.count == 0  # gloo: no communicator to abort
            abort.forget_process_groups()

            assert not dist.is_initialized()
            assert not parallel_state.model_parallel_is_initialized()
            assert not dist.distributed_c10d._world.pg_map
            assert dist.distributed_c10d._world.group_count == 0
    finally:
        if dist.is_initialized():
            abort.release_process_groups()


def test_abort_of_no_world_is_empty_and_not_remembered() -> None:
    assert not dist.is_initialized()
    first = abort.start_abort()
    assert first.count == 0 and first.wait(1.0) < 1.0
    assert abort.start_abort() is not first
