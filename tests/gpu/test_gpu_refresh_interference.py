"""``benchmarks/refresh_interference.py`` on two CUDA GPUs with NCCL at a small size: the control
arm, the whole refresh, a third of its bytes and the paced copy to host memory, each with its paired
cost and its refresh's time on the side stream. Skipped with fewer than two GPUs (CI has none)."""

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


def test_each_arm_charges_its_refreshes_to_the_steps_beside_them(tmp_path: Path) -> None:
    arms = ["none", "full", "full_third", "host_paced_40"]
    args = ("--gpus", "2", "--params", str(1 << 28), "--step-ms", "50", "--steps", "10", "--arms", ",".join(arms))
    report = run_benchmark("refresh_interference.py", tmp_path / "refresh.json", *args)
    assert report["args"]["arms"] == arms
    for rank in ("0", "1"):
        got = report["ranks"][rank]["arms"]
        assert list(got) == arms
        for arm, row in got.items():
            assert row["pairs"] == 2 and row["beside_s"] > 0 and row["clear_s"] > 0, (arm, row)
            assert (row["refresh_ms"] > 0) == (arm != "none"), (arm, row)
