"""``benchmarks/steady_state.py`` on CUDA GPUs with NCCL at a small model size: the plain
Megatron-Core loop and the real worker alternated on every visible GPU (DP = GPUs), for the GPT
configuration and the Llama-3 1B shape with the distributed optimizer and warmup + cosine; each
arm trains its windows and the plain loop reports its peak memory. Skipped without CUDA (CI has
none)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count()
SMALL = ["--layers", "2", "--hidden", "256", "--heads", "8", "--seq", "128", "--vocab", "1024"]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device; this machine has none"),
    pytest.mark.timeout(600),
]


def test_plain_loop_and_worker_alternate_on_gpu(tmp_path: Path) -> None:
    out = tmp_path / "steady.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "steady_state.py"),
            *("--configs", "gpt", "llama3-1b", "--rounds", "2", "--warmup", "2", "--steps", "4"),
            *("--out", str(out)),
            *SMALL,
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, f"steady_state.py failed:\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    configs = json.loads(out.read_text())["configs"]
    assert [c["config"] for c in configs] == ["gpt", "llama3-1b"]
    for c in configs:
        assert c["gpus"] == GPUS
        assert len(c["windows"]) == 4
        assert c["plain"]["mean_s"] > 0 and c["worker"]["mean_s"] > 0
        assert c["memory_per_gpu"]["max_allocated_gib"] > 0
    assert configs[1]["training"]["optimizer"]["distributed"] is True
