"""``benchmarks/step_replay.py`` on two CUDA GPUs with NCCL, bf16 and a small GPT: the replayed
updates bring an old copy of each rank's shard to the newest step bitwise with CUDA's kernels too.
Skipped with fewer than two GPUs (CI has none)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmark_runs import run_benchmark

GPUS = torch.cuda.device_count()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason=f"needs two CUDA devices; this machine has {GPUS}"),
    pytest.mark.timeout(600),
]

SMALL = ["--layers", "2", "--hidden", "512", "--heads", "8", "--seq", "256", "--vocab", "1024"]


def test_replaying_the_logged_updates_is_bitwise_on_cuda(tmp_path: Path) -> None:
    args = ("--gpus", "2", "--global-batch", "4", "--warmup", "2", "--steps", "3", *SMALL)
    result = run_benchmark("step_replay.py", tmp_path / "replay.json", *args)
    for r in result["ranks"]:
        assert r["device"] != "cpu" and r["updates_logged"] == 3, r
        assert r["whole"]["bitwise"] and r["halves"]["bitwise"] and not r["one_short"]["bitwise"], r
