"""``benchmarks/steady_state.py`` on CUDA GPUs with NCCL at a small model size: the plain
Megatron-Core loop and the real worker alternated on every visible GPU (DP = GPUs), for the GPT
configuration and the Llama-3 1B shape with the distributed optimizer and warmup + cosine; each
arm trains its windows and the plain loop reports its peak memory. Skipped without CUDA (CI has
none)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmark_runs import run_benchmark

GPUS = torch.cuda.device_count()
SMALL = ["--layers", "2", "--hidden", "256", "--heads", "8", "--seq", "128", "--vocab", "1024"]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device; this machine has none"),
    pytest.mark.timeout(600),
]


def test_plain_loop_and_worker_alternate_on_gpu(tmp_path: Path) -> None:
    args = ("--configs", "gpt", "llama3-1b", "--rounds", "2", "--warmup", "2", "--steps", "4", *SMALL)
    configs = run_benchmark("steady_state.py", tmp_path / "steady.json", *args)["configs"]
    assert [c["config"] for c in configs] == ["gpt", "llama3-1b"]
    for c in configs:
        assert c["gpus"] == GPUS
        assert len(c["windows"]) == 4
        assert c["plain"]["mean_s"] > 0 and c["worker"]["mean_s"] > 0
        assert c["memory_per_gpu"]["max_allocated_gib"] > 0
    assert configs[1]["training"]["optimizer"]["distributed"] is True
