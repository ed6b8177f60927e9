"""Which errors a worker takes for a failed collective (and waits for the next plan), and which
fail it loudly. Real gloo processes and real workers.

Scenarios:
- the errors a survivor's gloo collective raises when its peer was SIGKILLed, shut its connections
  down (what the watchdog does on a hang) or stopped answering past the group timeout are plain
  RuntimeErrors (gloo's errors are untyped in torch 2.11) and are classified as collective; a
  store that times out raises torch's typed DistStoreError, classified too;
- errors that merely mention collective words (timeout, connection, peer, nccl, ...), subclasses of
  RuntimeError carrying gloo's text, and other types are not;
- in a real 2-pod run, a bug in one rank's step (an injected exception) fails that worker loudly:
  it reports ``failed`` with the error and where it was raised, and exits 1; its peers, whose
  collectives broke when it exited, report a collective failure and wait for a plan instead.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from worker_harness import WorkerCluster, make_spec, wait_for

from localcluster.cluster import free_port
from megatron_trainer.channel import CollectiveFailed, WorkerStatus
from megatron_trainer.faults import ENV_FAULTS, Fault, FaultPlan, InjectedFault
from megatron_trainer.worker.runtime import is_collective_error
from megatron_trainer.worker.step import StepAborted

#: Two gloo ranks (forked); rank 1 fails as ``mode`` says while rank 0 is in an all-reduce with it;
#: rank 0 prints the type and message of what its all-reduce raised, as JSON.
_TWO_RANKS = r"""
import datetime, json, os, signal, sys, time
import torch, torch.distributed as dist
from megatron_trainer.worker.abort import close_gloo_connections

mode, port = sys.argv[1], int(sys.argv[2])
rank = 0 if os.fork() else 1
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
t = torch.ones(8)
dist.all_reduce(t)
if rank == 1:
    if mode == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1)
    if mode == "closed":
        close_gloo_connections()
    time.sleep(5)
    os._exit(0)
try:
    dist.all_reduce(t)
    print(json.dumps({"type": None}), flush=True)
except Exception as err:
    print(json.dumps({"type": type(err).__qualname__, "message": str(err)}), flush=True)
os.wait()
os._exit(0)
"""


@pytest.mark.parametrize("mode", ["killed", "closed", "stopped"])
def test_gloo_errors_of_a_failed_peer_are_collective(mode: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", _TWO_RANKS, mode, str(free_port())], capture_output=True, text=True, timeout=120, env=env
    )
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("{")] or [proc.stdout + proc.stderr]
    raised = json.loads(line)
    assert raised["type"] == "RuntimeError", raised  # untyped: the reason for the narrow fallback
    assert is_collective_error(RuntimeError(raised["message"])), raised


def test_a_store_timeout_is_a_typed_collective_error() -> None:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError) as caught:
        store.get("never-set")
    assert is_collective_error(caught.value)
    assert is_collective_error(StepAborted("epoch aborted during the forward passes"))


@pytest.mark.parametrize(
    "err",
    [
        RuntimeError("connection timeout: peer socket aborted (nccl, gloo)"),
        RuntimeError("optimizer skipped step 3 (non-finite gradients)"),
        RuntimeError("Timed out waiting for recv operation to complete"),  # gloo's words, not its location
        InjectedFault("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer"),
        ValueError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer"),
        TimeoutError("timed out"),
    ],
)
def test_other_errors_are_not_collective(err: BaseException) -> None:
    assert not is_collective_error(err)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[WorkerCluster]:
    # Rank 1 (pod a's second worker) raises in step 1, after step 0 was committed by everyone.
    faults = FaultPlan().fail_at(rank=1, step=1, fault=Fault.EXCEPTION).to_env()
    made = WorkerCluster(make_spec(train_iters=4), tmp_path, extra_env={ENV_FAULTS: faults})
    yield made
    print(made.logs())  # shown when the test fails
    made.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_bug_fails_its_worker_loudly_and_its_peers_wait_for_a_plan(cluster: WorkerCluster) -> None:
    cluster.start_pod("a")
    cluster.start_pod("b")
    cluster.wait_ready(["a", "b"])
    cluster.assign(cluster.plan(["a", "b"]))
    buggy, *peers = [w for w in cluster.workers() if w.name == "a/1"] + [
        w for w in cluster.workers() if w.name != "a/1"
    ]
    wait_for(lambda: "failed" in buggy.states(), 300, "the buggy worker to report failure")
    [detail] = [m.detail for m in buggy.of_type(WorkerStatus) if m.state == "failed"]
    assert detail.startswith("InjectedFault at faults.py:") and "rank 1 step 1" in detail, detail
    assert buggy.process.wait(60) == 1
    assert not buggy.of_type(CollectiveFailed)
    for w in peers:
        wait_for(lambda w=w: w.of_type(CollectiveFailed), 120, f"{w.name} to report the collective failure")
        assert "failed" not in w.states(), w.log_tail()
        assert w.states()[-1] == "reconfiguring"  # waiting for the next plan, alive
        assert w.process.poll() is None
