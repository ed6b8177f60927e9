"""``benchmarks/restart_vs_in_place.py`` on CUDA GPUs with NCCL at a small model size: warm spares
and a cold restart restore the newest checkpoint after every trainer is SIGKILLed (and, with two
GPUs or more, a peer-restored shrink runs first); the steps since the checkpoint are redone, none
from a peer. Skipped without CUDA (CI has none)."""

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


def test_in_place_and_cold_restart_arms_on_gpu(tmp_path: Path) -> None:
    gpus = min(GPUS, 2)
    args = ("--gpus", str(gpus), "--interval", "6", "--steps-after", "3", *SMALL)
    arms = run_benchmark("restart_vs_in_place.py", tmp_path / "restart.json", *args)["arms"]
    assert [a["arm"].split(",")[0] for a in arms] == ["in place"] * (len(arms) - 1) + ["cold restart"]
    assert len(arms) == (3 if gpus >= 2 else 2)
    for arm in arms:
        restored = "checkpoint" in arm["arm"]
        assert (arm["steps_redone"] >= 3) if restored else (arm["steps_redone"] == 0)
        assert all("restore_load" in phases for phases in arm["phases_by_pod"].values()) == restored
